"""The torch backend's triton mat-vec at the 1.5B's real sizes: GB/s of weights per tile
shape, for 1 and 8 tokens (needs CUDA).

    python benchmarks/torch_matvec.py [--tiles]

Without --tiles: the kernel as configured (kernels.MATVEC_TILES). With --tiles: every
(rows per program, chunks per step, warps) in a small grid, best first per matrix.
"""

from __future__ import annotations

import itertools
import sys

import numpy as np
import torch
from triton.testing import do_bench

from edgellm.backends.torch import kernels
from edgellm.backends.torch.packing import pack
from edgellm.quants import Q
from tests.test_backend_conformance import random_tensor

# (type, rows, cols) of Qwen2.5-1.5B Q4_K_M's matrices (the output is 151936 x 1536 Q6_K)
SHAPES = [(Q.Q4_K, 1536, 1536), (Q.Q4_K, 256, 1536), (Q.Q4_K, 8960, 1536),
          (Q.Q6_K, 1536, 8960), (Q.Q4_K, 1536, 8960), (Q.Q6_K, 151936, 1536),
          (Q.Q5_0, 896, 896), (Q.Q8_0, 4864, 896)]
GRID = list(itertools.product((4, 8, 16), (2, 4), (2, 4)))


def planes(qtype, rows, cols):
    t = random_tensor(qtype, rows, cols, seed=rows)
    p = pack(t.data, qtype, rows, cols)
    for key, a in p.arrays().items():
        setattr(p, key, torch.from_numpy(a).cuda())
    return p


def time_it(p, n, tile=None) -> float:
    x = torch.randn(n, p.cols, device="cuda")
    saved = dict(kernels.MATVEC_TILES)
    if tile:
        kernels.MATVEC_TILES[p.kind] = tile
    try:
        return do_bench(lambda: kernels.qmatvec(x, p), warmup=20, rep=80, return_mode="median")
    finally:
        kernels.MATVEC_TILES.clear()
        kernels.MATVEC_TILES.update(saved)


def main() -> None:
    sweep = "--tiles" in sys.argv
    for qtype, rows, cols in SHAPES:
        p = planes(qtype, rows, cols)
        for n in (1, 8):
            if sweep:
                results = []
                for tile in GRID:
                    try:
                        results.append((time_it(p, n, tile), tile))
                    except Exception as exc:  # a tile too large for the registers
                        print(f"  {tile}: {type(exc).__name__}")
                results.sort()
                best = ", ".join(f"{t}: {p.nbytes / ms / 1e6:.0f} GB/s" for ms, t in results[:3])
                print(f"{qtype.name} {rows}x{cols} n={n}: {best}", flush=True)
            else:
                ms = time_it(p, n)
                print(f"{qtype.name} {rows}x{cols} n={n}: {1e3 * ms:.1f} us, "
                      f"{p.nbytes / ms / 1e6:.0f} GB/s", flush=True)
        np.random.default_rng(0)


if __name__ == "__main__":
    main()
