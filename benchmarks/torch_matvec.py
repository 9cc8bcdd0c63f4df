"""The torch backend's triton mat-vec at the 1.5B's real sizes: GB/s of weights read, for 1
and 8 tokens (needs CUDA).

    python benchmarks/torch_matvec.py [--tiles]

Without --tiles: the kernel as configured (kernels.MATVEC_TILES). With --tiles: every
(rows per program, chunks per step, warps) in a small grid for one token, the best three per
matrix and the best per type over all matrices (what MATVEC_TILES should hold). Matrices
under the GPU's L2 (all but the output) are read from it when timed alone.
"""

from __future__ import annotations

import collections
import itertools
import sys

import torch
from triton.testing import do_bench

from edgellm.backends.torch import kernels
from edgellm.backends.torch.packing import K_QUANTS, pack
from edgellm.quants import Q
from tests.test_backend_conformance import random_tensor

# (type, rows, cols) of Qwen2.5-1.5B Q4_K_M's matrices (the output is 151936 x 1536 Q6_K),
# and two of the 0.5B's (Q5_0, Q8_0)
SHAPES = [(Q.Q4_K, 1536, 1536), (Q.Q4_K, 256, 1536), (Q.Q4_K, 8960, 1536),
          (Q.Q6_K, 1536, 8960), (Q.Q4_K, 1536, 8960), (Q.Q6_K, 151936, 1536),
          (Q.Q5_0, 896, 896), (Q.Q8_0, 4864, 896)]
GRID = [*itertools.product((8, 16, 32), (2, 4, 8), (4,)), (32, 8, 8), (64, 4, 8)]


def planes(qtype, rows, cols):
    t = random_tensor(qtype, rows, cols, seed=rows)
    p = pack(t.data, qtype, rows, cols)
    for key, a in p.arrays().items():
        setattr(p, key, torch.from_numpy(a).cuda())
    return p


def time_it(p, n, tile=None) -> float:
    x = torch.randn(n, p.cols, device="cuda")
    xq, xd = kernels.quantize_activations(x, 256 if p.qtype in K_QUANTS else 32, p.padded)
    saved = dict(kernels.MATVEC_TILES)
    if tile:
        kernels.MATVEC_TILES[p.kind] = tile
    try:
        return do_bench(lambda: kernels.qmatvec(xq, xd, p), warmup=20, rep=60,
                        return_mode="median")
    finally:
        kernels.MATVEC_TILES.clear()
        kernels.MATVEC_TILES.update(saved)


def main() -> None:
    sweep = "--tiles" in sys.argv
    per_type: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    for qtype, rows, cols in SHAPES:
        p = planes(qtype, rows, cols)
        for n in ((1,) if sweep else (1, 8)):  # the sweep: decode's single token
            if sweep:
                results = []
                for tile in GRID:
                    try:
                        ms = time_it(p, n, tile)
                    except Exception as exc:  # a tile too large for the registers
                        print(f"  {tile}: {type(exc).__name__}")
                        continue
                    results.append((ms, tile))
                    per_type[qtype.name][tile] += ms
                results.sort()
                best = ", ".join(f"{t}: {p.nbytes / ms / 1e6:.0f} GB/s" for ms, t in results[:3])
                print(f"{qtype.name} {rows}x{cols} n={n}: {best}", flush=True)
            else:
                ms = time_it(p, n)
                line = f"{qtype.name} {rows}x{cols} n={n}: {1e3 * ms:.1f} us, " \
                       f"{p.nbytes / ms / 1e6:.0f} GB/s"
                print(line, flush=True)
    for name, totals in per_type.items():
        tile, ms = min(totals.items(), key=lambda kv: kv[1])
        print(f"best over all {name} matrices: {tile} ({1e3 * ms:.0f} us in all)")


if __name__ == "__main__":
    main()
