"""`edgellm perplexity -m MODEL -f FILE`: perplexity of a text, as llama.cpp measures it.

Chunked by default (non-overlapping --ctx chunks, second half of each scored, as
llama-perplexity); --stream runs the whole file as one stream through the budgeted cache
(e.g. --ctx 512 --policy rotate --keep 4) and scores every token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .common import add_model_args, load_from_args

DEFAULT_CTX = 512  # llama-perplexity's default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgellm perplexity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("-f", "--file", required=True, help="text file to score")
    p.add_argument("--stream", action="store_true",
                   help="one stream through the budgeted cache, every token scored")
    p.add_argument("--batch", type=int, default=64,
                   help="tokens per forward pass in --stream mode (default 64)")
    p.add_argument("--chunks", type=int, default=None, help="score only the first N chunks")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="--stream: use only the first N tokens of the file")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


class ProgressLine:
    """`[####    ] 1234/8000 tok  95.2 tok/s  PPL 13.91` on stderr, redrawn in place."""

    def __init__(self, what: str):
        self.what, self.start = what, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int, ppl: float) -> None:
        if not self.tty and done < total:
            return
        width = 30
        bar = "#" * int(width * done / max(total, 1))
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        end = "\n" if done >= total else ""
        print(f"\r{self.what} [{bar:<{width}}] {done}/{total} tok {rate:7.1f} tok/s "
              f"PPL {ppl:8.4f}", end=end, file=sys.stderr, flush=True)


def main(argv: list[str], command: str = "perplexity") -> int:
    args = build_parser().parse_args(argv)
    from edgellm.perplexity import (
        chunked_perplexity,
        streaming_perplexity,
        tokenize_for_perplexity,
    )

    args.ctx = args.ctx or DEFAULT_CTX
    text = Path(args.file).read_text(encoding="utf-8", errors="replace")
    model = load_from_args(args)
    tokens = tokenize_for_perplexity(model, text)
    config = model.cache_config
    print(f"edgellm: {model.name} on {model.backend.name}: {len(tokens)} tokens; "
          f"{model.cache_plan().describe()}", file=sys.stderr)
    if args.stream:
        result = streaming_perplexity(model, tokens, config, batch=args.batch,
                                      progress=ProgressLine("stream"),
                                      max_tokens=args.max_tokens)
    else:
        result = chunked_perplexity(model, tokens, model.context_length,
                                    progress=ProgressLine("chunks"), max_chunks=args.chunks,
                                    kv_dtype=config.dtype)
    if args.json:
        print(json.dumps({
            "model": str(model.path), "backend": model.backend.name, "file": args.file,
            "mode": result.mode, "ctx": result.ctx, "policy": config.policy,
            "keep": config.keep, "kv_dtype": config.dtype, "ppl": round(result.ppl, 4),
            "ppl_error": round(result.ppl_error, 5), "scored": result.scored,
            "tokens": result.tokens, "seconds": round(result.seconds, 2),
            "tokens_per_s": round(result.tokens_per_s, 2), **result.details,
        }))
    else:
        print(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}  "
              f"({result.mode}, ctx {result.ctx}, {result.scored} tokens scored, "
              f"{result.tokens_per_s:.1f} tok/s)")
    return 0
