"""Where decode (or prompt) time goes: milliseconds in each backend op, and the rest.

Wraps the backend's ops with timers, prefills 100 tokens, then decodes --steps tokens one at
a time through ``model.net.forward`` (what ``generate_step`` calls per token). "other" is
everything outside the timed ops: Python, the cache update, numpy glue. With ``--prompt N``
it times prompt processing instead: --steps passes over N tokens, each into an empty cache.

    python benchmarks/decode_profile.py -m gemma-3-270m --steps 32
    python benchmarks/decode_profile.py -m qwen2.5-coder-1.5b-instruct -t 2 --prompt 512 --steps 3
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import numpy as np

import edgellm

OPS = ("matmul", "matmuls", "attention", "attention_append", "rms_norm", "rope", "embed",
       "silu_mul", "gelu_tanh_mul", "softcap")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=0, help="time N-token prompts instead")
    ap.add_argument("--batch", type=int, default=1,
                    help="tokens per decode step, all with logits (a speculative check)")
    args = ap.parse_args(argv)
    model = edgellm.load(args.model, backend=args.backend, threads=args.threads)
    backend = model.net.backend
    seconds: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    active = []  # the op being timed: one op calling another (a prompt's matmuls runs
    # matmul per weight) is that op's time, not counted twice
    for op in OPS:
        if hasattr(backend, op):
            inner = getattr(backend, op)

            def timed(*a, inner=inner, op=op, **k):
                if active:
                    return inner(*a, **k)
                active.append(op)
                start = time.perf_counter()
                try:
                    return inner(*a, **k)
                finally:
                    seconds[op] += time.perf_counter() - start
                    calls[op] += 1
                    active.pop()

            setattr(backend, op, timed)
    if args.prompt:
        total = profile_prompts(model, args.prompt, args.steps, seconds, calls)
        unit, per = "pass", args.steps
        print(f"{args.model} [{backend.name}]: prompt of {args.prompt} tokens, "
              f"{args.prompt * args.steps / total:.1f} t/s, {total / args.steps * 1e3:.1f} ms/pass")
    else:
        total = profile_decode(model, args.steps, seconds, calls, args.batch)
        unit, per = "token", args.steps
        print(f"{args.model} [{backend.name}]: {args.steps / total:.1f} t/s, "
              f"{total / args.steps * 1e3:.1f} ms/token")
    per_unit = {op: round(s / per * 1e3, 2) for op, s in seconds.most_common()}
    print(f"ms/{unit}:", per_unit, "other", round((total - sum(seconds.values())) / per * 1e3, 2))
    print(f"calls/{unit}:", {op: c // per for op, c in calls.items()})
    return 0


def profile_decode(model, steps: int, seconds, calls, batch: int = 1) -> float:
    """Seconds for ``steps`` passes over ``batch`` tokens after a 100-token prompt (batch > 1
    returns every token's logits and trims the cache back, as a speculative check does)."""
    cache = model.make_cache(100 + steps + batch)
    model.net.forward(np.arange(1000, 1100), cache)
    seconds.clear()
    calls.clear()
    start = time.perf_counter()
    for i in range(steps):
        tokens = np.arange(1100 + i, 1100 + i + batch)
        model.net.forward(tokens, cache, all_logits=batch > 1)
        if batch > 1:
            cache.trim(batch - 1)
    return time.perf_counter() - start


def profile_prompts(model, n: int, passes: int, seconds, calls) -> float:
    """Seconds for ``passes`` n-token prompts (one untimed warm-up), each into a fresh cache."""
    tokens = np.arange(1000, 1000 + n)
    model.net.forward(tokens, model.make_cache(n))
    seconds.clear()
    calls.clear()
    total = 0.0
    for _ in range(passes):
        cache = model.make_cache(n)
        start = time.perf_counter()
        model.net.forward(tokens, cache)
        total += time.perf_counter() - start
    return total


if __name__ == "__main__":
    sys.exit(main())
