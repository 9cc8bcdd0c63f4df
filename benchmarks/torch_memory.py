"""Where a model's CUDA memory goes under ``edgellm bench``'s work: bytes allocated after each
phase (load, the bench's cache, the prompt's first run: capture; more prompts; greedy decode;
a sampled decode), and at the peak, the live allocations grouped by the line of ours (or
torch's, where none of ours is on the stack) that made them, from torch's allocation history.
Needs CUDA.

    python benchmarks/torch_memory.py MODEL.gguf [--prompt 512] [--gen 128] [--top 16] [--ctx N]

Run it after a bench on the same card (``$EDGELLM_HOME/tuning``): kernel tuning allocates
its own buffers (a 256 MiB L2 flush among them), which the bench's peak leaves out and
which would swamp the picture here; allocations made under ``tuning.py`` are left out too.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

import edgellm
from edgellm.bench import _time_prompt, time_generation
from edgellm.modelinfo import read_header

OURS = ("/edgellm/", "/backends/", "/benchmarks/")
TIMING = ("tuning.py", "triton/testing.py")


def live_at_peak(events: list[dict]) -> tuple[int, list[dict]]:
    """Replay an allocation history (torch's ``device_traces``: "alloc" and "free_requested"
    or "free_completed" events with addr, size and frames): the most bytes live at once and
    the allocations live then. Allocations made while timing kernels are skipped."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for e in events:
        if e["action"] == "alloc":
            if any(f["filename"].endswith(TIMING) for f in e.get("frames", ())):
                continue
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    return peak, at_peak


def origin(frames: list[dict]) -> str:
    """The innermost frame of ours ("file:line function"), else the innermost at all."""
    for f in frames:
        if any(part in f["filename"] for part in OURS):
            return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
    return f"{Path(frames[0]['filename']).name}:{frames[0]['line']}" if frames else "?"


def by_origin(allocations: list[dict]) -> list[tuple[str, int, int]]:
    """(origin, bytes, count) per origin, largest first."""
    sizes: dict[str, list[int]] = defaultdict(list)
    for a in allocations:
        sizes[origin(a.get("frames", []))].append(a["size"])
    return sorted(((k, sum(v), len(v)) for k, v in sizes.items()), key=lambda r: -r[1])


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=0,
                    help="the caches' budget in tokens (default: the bench's, prompt + gen + 16)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_memory.py needs CUDA")
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    mib = 2 ** 20

    model = edgellm.load(args.model, backend="torch")

    def phase(label: str) -> None:
        torch.cuda.synchronize()
        memory = model.backend.device_memory()  # (the bench's figures: tuning's left out)
        print(f"{label:<28} allocated {memory['active'] / mib:8.1f} MiB, "
              f"peak {memory['peak'] / mib:8.1f} MiB, reserved "
              f"{torch.cuda.memory_reserved() / mib:8.1f} MiB")

    net = model.net
    phase("load")
    size = args.ctx or args.prompt + args.gen + 16

    def make_cache():
        return model.make_cache(size)

    cache = make_cache()
    kv = cache.nbytes
    phase("a cache")
    del cache
    tokens = np.random.default_rng(0).integers(100, min(model.args.vocab_size, 30000),
                                               args.prompt)
    _time_prompt(net, make_cache, tokens)
    phase(f"pp{args.prompt}, first (capture)")
    _time_prompt(net, make_cache, tokens)
    phase(f"pp{args.prompt}, again")
    time_generation(net, make_cache, args.gen, 100)
    phase(f"tg{args.gen} greedy")
    from edgellm.generate import generate_step
    from edgellm.sampling import SamplingParams

    steps = generate_step([1, 2, 3], net, make_cache(), SamplingParams(seed=1))
    for _ in range(16):
        next(steps)
    steps.close()
    phase("16 sampled tokens")
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    peak, live = live_at_peak(events)
    print(f"history: {len(events)} events, peak {peak / mib:.1f} MiB live "
          f"(tuning's allocations left out)")
    for where, nbytes, count in by_origin(live)[:args.top]:
        print(f"  {nbytes / mib:8.2f} MiB  {count:5d}  {where}")
    gguf, top = read_header(args.model).gguf_bytes, model.backend.device_memory()["peak"]
    print(f"peak over GGUF + KV ({size} tokens): {top:,} / ({gguf:,} + {kv:,}) = "
          f"{top / (gguf + kv):.3f}x")
    model.close()


if __name__ == "__main__":
    main()
