"""Where decode time goes: milliseconds per token in each backend op, and the rest.

Wraps the backend's ops with timers, prefills 100 tokens, then decodes --steps tokens one at
a time through ``model.net.forward`` (what ``generate_step`` calls per token). "other" is
everything outside the timed ops: Python, the cache update, numpy glue.

    python benchmarks/decode_profile.py -m gemma-3-270m --steps 32
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import numpy as np

import edgellm

OPS = ("matmul", "matmuls", "attention", "rms_norm", "rope", "embed", "silu_mul",
       "gelu_tanh_mul", "softcap")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    model = edgellm.load(args.model, backend=args.backend, threads=args.threads)
    backend = model.net.backend
    seconds: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for op in OPS:
        if hasattr(backend, op):
            inner = getattr(backend, op)

            def timed(*a, inner=inner, op=op, **k):
                start = time.perf_counter()
                try:
                    return inner(*a, **k)
                finally:
                    seconds[op] += time.perf_counter() - start
                    calls[op] += 1

            setattr(backend, op, timed)
    cache = model.make_cache(100 + args.steps)
    model.net.forward(np.arange(1000, 1100), cache)
    seconds.clear()
    calls.clear()
    start = time.perf_counter()
    for i in range(args.steps):
        model.net.forward(np.array([1100 + i]), cache)
    total = time.perf_counter() - start
    per_token = {op: round(s / args.steps * 1e3, 2) for op, s in seconds.most_common()}
    print(f"{args.model} [{backend.name}]: {args.steps / total:.1f} t/s, "
          f"{total / args.steps * 1e3:.1f} ms/token")
    print("ms/token:", per_token, "other", round((total - sum(seconds.values()))
                                                  / args.steps * 1e3, 2))
    print("calls/token:", {op: c // args.steps for op, c in calls.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
