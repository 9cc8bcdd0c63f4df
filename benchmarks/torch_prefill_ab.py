"""A prompt's prefill on the torch backend (CUDA graphs), the variants of its GEMMs and of a
ring's first prompt interleaved in one process, each against the one before this change:

- GEMM ``cast``: dequantize W to f16, cuBLAS f16 GEMM, then a cast of its output to f32;
- GEMM ``f32out``: the same GEMM writing its f32 sums (``torch.mm(.., out_dtype)``);
- GEMM ``fused``: one triton kernel dequantizing W's tiles in registers
  (``kernels.dequantized_matmul``, EDGELLM_FUSED_GEMM=1);
- GEMM ``tuned``: per shape the fastest of f32out and the fused kernel's tiles, timed at
  first use (the default: ``tuning.py``; EDGELLM_FUSED_GEMM unset);
- ring ``old``: a ring layer's prompt longer than its reserve attends over the whole ring
  before the write followed by the new rows (2 x 512 + 64 keys for Gemma 3's pp512);
- ring ``new``: before the first wrap it is written in place and attends over the slots
  so far (``LayerCache.writes_in_place``). Models without sliding windows have no rings.

    python benchmarks/torch_prefill_ab.py MODEL.gguf [--prompt 512] [--rounds 7]
        [--tiles 128x64x2x8,64x128x2x4]

``--tiles`` adds fused variants with other tiles (tokens x rows x chunks x warps:
``kernels.DQ_GEMM_TILE``), each captured with its own; by default the other tiles the tuner
times (``kernels.GEMM_CANDIDATES``).

Each GEMM variant is its own loaded model (the backend reads its switches when made); the
ring rule is swapped in place (its graphs are separate buckets). Prints t/s (median over
rounds, the variants' order rotating each round), the ratio to ``cast/old`` (the prefill
before these two changes, but with the launch fusions of the environment:
EDGELLM_FUSE_LAUNCHES=0 runs all of them without those) and the logits' largest difference
from it, relative to their peak. Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

import edgellm
from edgellm.backends.torch import kernels
from edgellm.cache import LayerCache

GEMMS = {"cast": {"EDGELLM_GEMM_F32_OUT": "0", "EDGELLM_FUSED_GEMM": "0"},
         "f32out": {"EDGELLM_GEMM_F32_OUT": "1", "EDGELLM_FUSED_GEMM": "0"},
         "fused": {"EDGELLM_GEMM_F32_OUT": "1", "EDGELLM_FUSED_GEMM": "1"},
         "tuned": {"EDGELLM_GEMM_F32_OUT": "1", "EDGELLM_FUSED_GEMM": ""}}
NEW_RING = LayerCache.writes_in_place


def _old_ring(layer: LayerCache, start: int, n: int) -> bool:
    """The rule before: in place only up to the reserve (+ 1), wrapped or not."""
    return n <= layer.plan.max_inplace


RINGS = {"old": _old_ring, "new": NEW_RING}


def _load(path: str, switches: dict):
    saved = {k: os.environ.get(k) for k in switches}
    os.environ.update(switches)
    try:
        return edgellm.load(path, backend="torch")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _prefill(model, tokens: np.ndarray, ring, tile=None) -> tuple[float, np.ndarray]:
    """Seconds of one prompt into a fresh cache (the bench's size), and its logits; ``tile``:
    the fused GEMM's, read when a step is captured (its replays keep it)."""
    LayerCache.writes_in_place = ring
    default_tile = kernels.DQ_GEMM_TILE
    kernels.DQ_GEMM_TILE = tile or default_tile
    try:
        cache = model.make_cache(len(tokens) + 128 + 16)
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model.net.forward(tokens, cache)
        torch.cuda.synchronize()
        return time.perf_counter() - start, logits
    finally:
        LayerCache.writes_in_place = NEW_RING
        kernels.DQ_GEMM_TILE = default_tile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    others = [t for t in kernels.GEMM_CANDIDATES if t not in ("cublas", kernels.DQ_GEMM_TILE)]
    ap.add_argument("--tiles", default=",".join("x".join(map(str, t)) for t in others),
                    help="more fused tiles: BMxBNxCHxWARPS,...")
    args = ap.parse_args()

    tokens = np.arange(100, 100 + args.prompt)
    gemms = {name: (switches, None) for name, switches in GEMMS.items()}
    for text in filter(None, args.tiles.split(",")):
        gemms[f"fused:{text}"] = (GEMMS["fused"], tuple(int(v) for v in text.split("x")))
    models = {name: _load(args.model, switches) for name, (switches, _) in gemms.items()}
    variants = [(g, r) for g in gemms for r in RINGS]

    def run(g: str, r: str) -> tuple[float, np.ndarray]:
        return _prefill(models[g], tokens, RINGS[r], gemms[g][1])

    for g, r in variants:  # warm-up: captures, compiles
        for _ in range(2):
            run(g, r)
    seconds: dict = {v: [] for v in variants}
    logits: dict = {}
    for i in range(args.rounds):
        for g, r in variants[i % len(variants):] + variants[:i % len(variants)]:
            dt, logits[g, r] = run(g, r)
            seconds[g, r].append(dt)
    base = statistics.median(seconds["cast", "old"])
    ref = logits["cast", "old"]
    name = os.path.basename(args.model)
    for g, r in variants:
        mid = statistics.median(seconds[g, r])
        diff = np.abs(logits[g, r] - ref).max() / np.abs(ref).max()
        print(f"{name} pp{args.prompt} gemm={g:14s} ring={r}: {args.prompt / mid:9.0f} t/s "
              f"({base / mid:.3f}x)  logits {diff:.2e} of peak")


if __name__ == "__main__":
    main()
