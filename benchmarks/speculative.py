"""Speculative decoding benchmark on standard-library function completions (greedy).

For each prompt the target decodes plain, then with the draft; with ``--llama DIR``,
llama.cpp's ``llama-bench`` (plain) and ``llama-speculative`` run on the same prompts too.
(``edgellm bench --draft`` runs the same benchmark.)

    python benchmarks/speculative.py --model qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct -n 128 --llama /work/llama/build/bin
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgellm.speculative import DEFAULT_DRAFT_VOCAB
from edgellm.speculative_bench import STDLIB_FUNCTIONS, bench_draft, markdown_table


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
    ap.add_argument("--llama", type=Path, default=None, help="llama.cpp bin dir to compare")
    ap.add_argument("--llama-draft-max", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    about, rows = bench_draft(args.model, args.draft, args.backend, args.threads, args.tokens,
                              args.draft_n, args.prompts, args.draft_vocab or None, args.llama,
                              args.llama_draft_max)
    print(f"# {about}")
    print(markdown_table(rows, llama=args.llama is not None))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
