"""The torch backend's triton mat-vec at real model sizes: microseconds and GB/s of weights
read, timed as decode runs it (launches replayed from a CUDA graph, weights cold: each launch
reads another copy of the matrix, more copies than the L2 holds). Needs CUDA.

    python benchmarks/torch_matvec.py [--tiles]

Without --tiles: the kernel as decode runs it (each shape's tile timed at first use,
``tuning.py``, unless kernels.MATVEC_TILES sets one), 1 and 8 tokens. With
--tiles: every tile the tuner would time for the matrix (``kernels.matvec_candidates``:
rows per program, chunks per step, warps, K split), one token, each replayed from a graph as
decode runs it; the best three per matrix, and per type the best of the tiles every matrix
of that type took (what the defaults, ``matvec_tile``, should be).
"""

from __future__ import annotations

import collections
import sys

import torch

from edgellm.backends.torch import kernels
from edgellm.backends.torch.packing import K_QUANTS, pack
from edgellm.quants import Q
from tests.test_backend_conformance import random_tensor

# (type, rows, cols): Qwen2.5-1.5B Q4_K_M's matrices (q; k and v; o; gate, up; down in both
# types; q+k and gate+up as one matrix; the output), the 0.5B's (Q5_0, Q8_0) and Gemma 3's
SHAPES = [(Q.Q4_K, 1536, 1536), (Q.Q4_K, 256, 1536), (Q.Q6_K, 256, 1536),
          (Q.Q4_K, 1792, 1536), (Q.Q4_K, 8960, 1536), (Q.Q4_K, 17920, 1536),
          (Q.Q6_K, 1536, 8960), (Q.Q4_K, 1536, 8960), (Q.Q6_K, 151936, 1536),
          (Q.Q5_0, 896, 896), (Q.Q8_0, 896, 4864), (Q.Q5_0, 1024, 896), (Q.Q8_0, 4864, 896),
          (Q.Q5_0, 2048, 640), (Q.Q8_0, 640, 2048), (Q.Q6_K, 262144, 640)]
SWEPT = 11  # --tiles sweeps the first SWEPT shapes (the 1.5B's and two of the 0.5B's)
COLD_BYTES = 256 << 20


def planes(qtype, rows, cols):
    t = random_tensor(qtype, rows, cols, seed=rows)
    p = pack(t.data, qtype, rows, cols)
    for key, a in p.arrays().items():
        setattr(p, key, torch.from_numpy(a).cuda())
    return p


def copies(p, count: int) -> list:
    """count planes with the same numbers in distinct memory (count 1: p itself)."""
    out = [p]
    for _ in range(count - 1):
        c = type(p)(p.qtype, p.rows, p.cols, p.padded, **{k: a.clone() for k, a in
                                                          p.arrays().items()})
        out.append(c)
    return out


def time_graph(mats: list, n: int, tile=None) -> float:
    """Microseconds per launch: one launch per copy captured in a graph, replayed (in
    ``tile``, all four of its numbers, where given)."""
    x = torch.randn(n, mats[0].cols, device="cuda")
    p0 = mats[0]
    xq, xd = kernels.quantize_activations(x, 256 if p0.qtype in K_QUANTS else 32, p0.padded)
    saved = dict(kernels.MATVEC_TILES)
    if tile:
        kernels.MATVEC_TILES[p0.kind] = tile
    try:
        return replayed_us([lambda p=p: kernels.qmatvec(xq, xd, p) for p in mats])
    finally:
        kernels.MATVEC_TILES.clear()
        kernels.MATVEC_TILES.update(saved)


def replayed_us(runs: list) -> float:
    """Microseconds a launch: ``runs`` (functions of none, one launch each, e.g. one per
    copy of a matrix) captured in one graph, replayed; the first two run before the
    capture (compile, allocate, tune)."""
    for run in runs[:2]:
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for run in runs:
            run()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(3, 200 // len(runs))
    begin.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * begin.elapsed_time(end) / (reps * len(runs))


def main() -> None:
    sweep = "--tiles" in sys.argv
    per_type: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for qtype, rows, cols in SHAPES[:SWEPT] if sweep else SHAPES:
        p = planes(qtype, rows, cols)
        mats = copies(p, max(1, min(64, COLD_BYTES // p.nbytes)))
        if not sweep:
            for n in (1, 8):
                us = time_graph(mats, n)
                print(f"{qtype.name} {rows}x{cols} n={n}: {us:.1f} us, "
                      f"{p.nbytes / us / 1e3:.0f} GB/s", flush=True)
            continue
        results = []
        for tile in kernels.matvec_candidates(p.padded // 64,
                                              p.rows >= kernels.LOOP_MIN_ROWS):
            try:
                us = time_graph(mats, 1, tile)
            except Exception as exc:  # a tile too large for the registers
                print(f"  {tile}: {type(exc).__name__}")
                continue
            results.append((us, tile))
            per_type[qtype.name][tile].append(us)
        results.sort()
        best = ", ".join(f"{t}: {us:.1f} us {p.nbytes / us / 1e3:.0f} GB/s"
                         for us, t in results[:3])
        print(f"{qtype.name} {rows}x{cols}: {best}", flush=True)
        del mats
    for name, times in per_type.items():
        shared = {t: sum(us) for t, us in times.items() if len(us) == max(map(len, times.values()))}
        tile, us = min(shared.items(), key=lambda kv: kv[1])
        print(f"best over all {name} matrices: {tile} ({us:.0f} us)")


if __name__ == "__main__":
    main()
