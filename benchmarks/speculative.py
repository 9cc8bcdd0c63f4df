"""Speculative decoding benchmark: plain vs. drafted decoding of one target model.

Prompts are function completions from Python's standard library: a function's header and
docstring, the model writes the body (greedy, temperature 0). For each prompt the target runs
plain, then speculatively; the table gives generation speed, acceptance and the speedup, and
checks the two outputs are identical. With ``--llama DIR`` llama.cpp's ``llama-speculative``
(and ``llama-bench`` for its plain speed) run on the same prompts in the same session.

    python benchmarks/speculative.py --model qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct -n 128 --llama /work/llama/build/bin
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from edgellm.api import Model, load
from edgellm.generate import stream_generate
from edgellm.sampling import SamplingParams
from edgellm.speculative import DEFAULT_DRAFT_VOCAB, check_same_vocabulary, make_drafter

#: (module file, function): short-bodied, documented functions of the standard library.
STDLIB_FUNCTIONS = [
    ("textwrap.py", "indent"), ("shlex.py", "quote"), ("genericpath.py", "commonprefix"),
    ("fnmatch.py", "filter"), ("calendar.py", "leapdays"), ("base64.py", "b64encode"),
    ("shutil.py", "copyfileobj"), ("bisect.py", "insort_right"),
]


def stdlib_prompt(stdlib: Path, filename: str, function: str) -> str:
    """The source of ``function`` in ``filename`` up to the end of its docstring, plus "\\n"."""
    source = (stdlib / filename).read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            if ast.get_docstring(node) is None:
                raise ValueError(f"{filename}:{function} has no docstring")
            lines = source.splitlines()[node.lineno - 1: node.body[0].end_lineno]
            return "\n".join(lines) + "\n"
    raise LookupError(f"no top-level function {function!r} in {filename}")


@dataclass
class Run:
    tokens: list[int]
    tps: float  # generation tokens per second (after the first token)
    stats: dict


def run_edgellm(model: Model, prompt_ids: list[int], n: int, draft=None,
                draft_n: int | None = None) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    responses = list(stream_generate(model, prompt_ids, params, draft=draft, draft_n=draft_n))
    last = responses[-1]
    return Run([r.token for r in responses], last.generation_tps,
               last.extra.get("speculative", {}))


def run_llama_speculative(bin_dir: Path, target: Path, draft: Path, prompt: str, n: int,
                          draft_max: int, threads: int) -> dict:
    """llama-speculative (greedy) on one prompt: speed and acceptance from its log."""
    cmd = [str(bin_dir / "llama-speculative"), "-m", str(target), "-md", str(draft),
           "-p", prompt, "-n", str(n), "--temp", "0", "-t", str(threads), "-td", str(threads),
           "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", "0", "-c", "2048",
           "--seed", "1", "-no-cnv"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = out.stdout + out.stderr
    speed = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    accept = re.search(r"accept\s*=\s*([\d.]+)%", log)
    if not speed:
        raise RuntimeError("llama-speculative failed:\n" + log[-2000:])
    return {"tps": float(speed.group(3)), "acceptance": float(accept.group(1)) / 100
            if accept else None}


def run_llama_plain(bin_dir: Path, target: Path, n: int, threads: int) -> float:
    """llama-bench tg<n>: the target's plain generation speed (tokens/s)."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(target), "-p", "0", "-n", str(n),
           "-t", str(threads), "-r", "2", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="model or 'ngram'")
    ap.add_argument("--draft-n", type=int, default=None, help="pin k (default adaptive)")
    ap.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB,
                    help="rows of the draft's cut-down output head (0 = full head)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=len(STDLIB_FUNCTIONS))
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--llama", type=Path, default=None, help="llama.cpp bin dir to compare")
    ap.add_argument("--llama-draft-max", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)

    target = load(args.model, backend=args.backend, threads=args.threads, context_length=1024)
    draft = None
    if args.draft != "ngram":
        draft = load(args.draft, backend=args.backend, threads=args.threads,
                     context_length=1024)
        check_same_vocabulary(target, draft)
    print(f"# target {target.path.name}, draft {args.draft if draft is None else draft.path.name}"
          f", backend {target.backend.name}, {args.threads} threads, {args.tokens} tokens, "
          f"draft length {args.draft_n or 'adaptive'}, draft head {args.draft_vocab or 'full'}",
          flush=True)
    llama_plain = None
    if args.llama:
        llama_plain = run_llama_plain(args.llama, target.path, args.tokens, args.threads)
        print(f"# llama.cpp plain (llama-bench tg{args.tokens}): {llama_plain:.2f} t/s")
    header = ("| prompt | plain t/s | spec t/s | speedup | accepted | mean acc. len | tok/pass "
              "| mean k | same output |")
    if args.llama:
        header += " llama.cpp spec t/s | llama.cpp accepted | llama.cpp speedup |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = []
    for filename, function in STDLIB_FUNCTIONS[: args.prompts]:
        text = stdlib_prompt(args.stdlib, filename, function)
        ids = target.encode(text)
        plain = run_edgellm(target, ids, args.tokens)
        drafter = "ngram" if draft is None else make_drafter(
            target, draft, ids, target.context_length, head_vocab=args.draft_vocab or None)
        spec = run_edgellm(target, ids, args.tokens, drafter, args.draft_n)
        s = spec.stats
        row = {"prompt": f"{filename[:-3]}.{function}", "prompt_tokens": len(ids),
               "plain_tps": plain.tps, "spec_tps": spec.tps, "speedup": spec.tps / plain.tps,
               "same_output": spec.tokens == plain.tokens, **s}
        line = (f"| {row['prompt']} | {plain.tps:.2f} | {spec.tps:.2f} | {row['speedup']:.2f}x "
                f"| {s['acceptance_rate']:.1%} | {s['mean_accepted_length']:.2f} "
                f"| {s['tokens_per_target_pass']:.2f} | {s['mean_draft_length']:.2f} "
                f"| {'yes' if row['same_output'] else 'NO'} |")
        if args.llama and draft is not None:
            ll = run_llama_speculative(args.llama, target.path, draft.path, text, args.tokens,
                                       args.llama_draft_max, args.threads)
            row.update(llama_tps=ll["tps"], llama_acceptance=ll["acceptance"],
                       llama_speedup=ll["tps"] / llama_plain)
            line += (f" {ll['tps']:.2f} | {ll['acceptance'] or 0:.1%} "
                     f"| {row['llama_speedup']:.2f}x |")
        print(line, flush=True)
        rows.append(row)
    speedups = [r["speedup"] for r in rows]
    print(f"\nmean speedup {sum(speedups) / len(speedups):.2f}x, min {min(speedups):.2f}x, "
          f"all outputs identical: {all(r['same_output'] for r in rows)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
