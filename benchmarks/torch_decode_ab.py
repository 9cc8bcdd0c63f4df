"""Decode on the torch backend (CUDA graphs) three ways, interleaved in one process:

- ``host``: ``forward`` then the argmax on the host (the logits copied back every step:
  the loop ``edgellm bench`` ran before ``Model.greedy_tokens``);
- ``device``: ``Model.greedy_tokens`` (the argmax on the device, each step queued before
  the token of the one before is read back);
- ``replay``: the decode graph replayed back to back, timed with CUDA events (the GPU's
  own time per step: what neither loop can beat).

    python benchmarks/torch_decode_ab.py MODEL.gguf [--steps 128] [--rounds 3] [--ctx N]

Run it under EDGELLM_FUSE_LAUNCHES=0 and =1 (alternating processes) to see the launch
fusions' share, EDGELLM_UNFUSE=glu (etc.: backend.FUSIONS) for one fusion's,
EDGELLM_TUNE=0 and =1 for the tuned tiles' (backends/torch/tuning.py), or EDGELLM_PDL=0, 1
and 2 for programmatic dependent launches' (``kernels._pdl``). ``--ctx N``: a cache of N
slots (default: the steps + 16, as ``edgellm bench``): a graph attends over its cache's
whole storage, so this is decode's cost in a chat's cache (4096 by default) against the
bench's. Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

import edgellm
from edgellm.bench import time_generation


def _host(net, make_cache, steps: int, token: int) -> float:
    """Seconds for ``steps`` greedy tokens with the logits copied back and the argmax taken
    on the host (time_generation's signature)."""
    cache = make_cache()
    start = time.perf_counter()
    for _ in range(steps):
        token = int(net.forward(np.array([token]), cache)[0].argmax())
    return time.perf_counter() - start


def _synced(run):
    """``run`` timed until the GPU has finished."""
    def timed(*args) -> float:
        start = time.perf_counter()
        run(*args)
        torch.cuda.synchronize()
        return time.perf_counter() - start
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=0, help="cache slots (default steps + 16)")
    args = ap.parse_args()

    model = edgellm.load(args.model, backend="torch")
    net = model.net
    runs = {"host": _synced(_host), "device": _synced(time_generation)}

    slots = max(args.ctx, args.steps + 16)

    def make_cache():
        return model.make_cache(slots)

    for run in runs.values():  # warm-up: captures, compiles
        run(net, make_cache, 8, 100)
    rates: dict[str, list[float]] = {name: [] for name in (*runs, "replay")}
    graphs = model.backend.graphs
    for _ in range(args.rounds):
        for name, run in runs.items():
            rates[name].append(args.steps / run(net, make_cache, args.steps, 100))
        replay = graphs.decode_graph(net)
        begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        begin.record()
        for _ in range(args.steps):
            replay.replay()
        end.record()
        torch.cuda.synchronize()
        rates["replay"].append(1e3 * args.steps / begin.elapsed_time(end))
    fuse = os.environ.get("EDGELLM_FUSE_LAUNCHES", "1")
    tune = os.environ.get("EDGELLM_TUNE", "1")
    pdl = os.environ.get("EDGELLM_PDL", "0")
    unfused = ",".join(sorted(model.backend.unfused)) or "-"
    print(f"{os.path.basename(args.model)} fuse_launches={fuse} tune={tune} "
          f"unfused={unfused} pdl={pdl} ctx={slots}: " + ", ".join(
        f"{name} {statistics.median(r):.1f} t/s ({' '.join(f'{v:.0f}' for v in r)})"
        for name, r in rates.items()))


if __name__ == "__main__":
    main()
