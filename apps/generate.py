"""`edgellm generate`: stream a completion to stdout, or print one JSON record with --json."""

from __future__ import annotations

import argparse
import json
import sys

from .common import (
    add_draft_args,
    add_model_args,
    add_sampling_args,
    load_draft_from_args,
    load_from_args,
    sampling_from_args,
    speculative_summary,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgellm generate", description=__doc__)
    add_model_args(p)
    p.add_argument("-p", "--prompt", required=True,
                   help="prompt text (special-token text like <|im_start|> is parsed)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user turn in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (ids, text, finish_reason, timings)")
    add_sampling_args(p)
    add_draft_args(p)
    return p


def main(argv: list[str], command: str = "generate") -> int:
    args = build_parser().parse_args(argv)
    from edgellm.generate import stream_generate

    model = load_from_args(args)
    draft = load_draft_from_args(args, model)
    prompt = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": prompt})
        prompt = model.apply_chat_template(messages)
    prompt_ids = model.encode(prompt)
    params = sampling_from_args(args)
    out_ids: list[int] = []
    pieces: list[str] = []
    last = None
    rotated = False
    for r in stream_generate(model, prompt_ids, params, draft=draft, draft_n=args.draft_n):
        if "context" in r.extra and not rotated:  # the KV budget is full: say so, once
            rotated = True
            c = r.extra["context"]
            print(f"\n[context full at {c['budget']} tokens: rotating, keeping the first "
                  f"{c['keep']} and the most recent]", file=sys.stderr, flush=True)
        ended_by_eos = r.finish_reason == "stop" and r.token in model.tokenizer.eos_ids
        if r.token is not None and not ended_by_eos:
            out_ids.append(r.token)
        pieces.append(r.text)
        if not args.json:
            sys.stdout.write(r.text)
            sys.stdout.flush()
        last = r
    if args.json:
        record = {
            "model": str(model.path), "backend": model.backend.name,
            "prompt": prompt, "prompt_ids": prompt_ids, "ids": out_ids, "text": "".join(pieces),
            "finish_reason": last.finish_reason if last else None,
            "timings": {
                "prompt_tokens": len(prompt_ids), "generated_tokens": last.generation_tokens,
                "ttft_s": round(last.ttft_s, 4), "prompt_tps": round(last.prompt_tps, 2),
                "generation_tps": round(last.generation_tps, 2),
            },
        }
        if "speculative" in last.extra:
            record["speculative"] = last.extra["speculative"]
        print(json.dumps(record, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        print(f"[{last.finish_reason}] prompt {len(prompt_ids)} tok @ {last.prompt_tps:.1f} t/s, "
              f"generated {last.generation_tokens} tok @ {last.generation_tps:.1f} t/s, "
              f"ttft {last.ttft_s:.2f}s", file=sys.stderr)
        if "speculative" in last.extra:
            print(speculative_summary(last.extra["speculative"]), file=sys.stderr)
    return 0
