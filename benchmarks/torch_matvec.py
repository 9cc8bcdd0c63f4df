"""The torch backend's triton mat-vec at real model sizes: microseconds and GB/s of weights
read, timed as decode runs it (launches replayed from a CUDA graph, weights cold: each launch
reads another copy of the matrix, more copies than the L2 holds). Needs CUDA.

    python benchmarks/torch_matvec.py [--tiles]

Without --tiles: the kernel as decode runs it (each shape's tile timed at first use,
``tuning.py``, unless kernels.MATVEC_TILES sets one), 1 and 8 tokens. With
--tiles: every (rows per program, chunks per step, warps) of a small grid, and for matrices
that split K every programs-per-multiprocessor target, one token; the best three per matrix
and the best per type over all matrices (what MATVEC_TILES should hold).
"""

from __future__ import annotations

import collections
import itertools
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
# (rows, chunks a step, warps): 16 and 32 chunks take a 1536-wide row in one or two steps
# (fewer dependent loads: small matrices are latency-bound), not yet swept on a GPU
GRID = [*itertools.product((4, 8, 16, 32), (4, 8), (4, 8)), (8, 2, 4), (16, 2, 4), (2, 8, 4),
        *itertools.product((2, 4), (16, 32), (4, 8))]
SWEPT = 11  # --tiles sweeps the first SWEPT shapes (the 1.5B's and two of the 0.5B's)
SPLIT_TARGETS = (0, 8, 16, 32)  # kernels.PROGRAMS_PER_SM values (0: never split)
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


def time_graph(mats: list, n: int, tile=None, target=None) -> float:
    """Microseconds per launch: one launch per copy captured in a graph, replayed."""
    x = torch.randn(n, mats[0].cols, device="cuda")
    p0 = mats[0]
    xq, xd = kernels.quantize_activations(x, 256 if p0.qtype in K_QUANTS else 32, p0.padded)
    saved, saved_target = dict(kernels.MATVEC_TILES), kernels.PROGRAMS_PER_SM
    if tile:
        kernels.MATVEC_TILES[p0.kind] = tile
    if target is not None:
        kernels.PROGRAMS_PER_SM = target
    try:
        for p in mats[:2]:
            kernels.qmatvec(xq, xd, p)  # compile, allocate
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for p in mats:
                kernels.qmatvec(xq, xd, p)
        graph.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = max(3, 200 // len(mats))
        begin.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return 1e3 * begin.elapsed_time(end) / (reps * len(mats))
    finally:
        kernels.MATVEC_TILES.clear()
        kernels.MATVEC_TILES.update(saved)
        kernels.PROGRAMS_PER_SM = saved_target


def splits_k(p, tile) -> bool:
    bn = tile[0]
    programs = -(-p.rows // bn)
    return programs < 16 * kernels._multiprocessors(torch.device("cuda"))


def main() -> None:
    sweep = "--tiles" in sys.argv
    per_type: dict = collections.defaultdict(lambda: collections.defaultdict(float))
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
        for tile in GRID:
            for target in (SPLIT_TARGETS if splits_k(p, tile) else (None,)):
                try:
                    us = time_graph(mats, 1, tile, target)
                except Exception as exc:  # a tile too large for the registers
                    print(f"  {tile} {target}: {type(exc).__name__}")
                    continue
                results.append((us, tile, target))
                if target in (None, kernels.PROGRAMS_PER_SM):
                    per_type[qtype.name][tile] += us
        results.sort()
        best = ", ".join(f"{t}/{g}: {us:.1f} us {p.nbytes / us / 1e3:.0f} GB/s"
                         for us, t, g in results[:3])
        print(f"{qtype.name} {rows}x{cols}: {best}", flush=True)
        del mats
    for name, totals in per_type.items():
        tile, us = min(totals.items(), key=lambda kv: kv[1])
        print(f"best over all {name} matrices (default split target): {tile} ({us:.0f} us)")


if __name__ == "__main__":
    main()
