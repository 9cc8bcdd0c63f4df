"""The C mat-vec kernels' prefetch distance, measured once per CPU model and cached.

How far ahead of the weights being read a kernel should ask for more differs between cores
and memory systems: on two Zen 5 cores with non-temporal prefetches the 0.5B decoded at 9.5
ms a token at 1 KB, 9.0 at 2 KB, 8.2 at 4 KB, 8.0 at 8 KB and 8.6 at 16 KB. So the first
backend on a machine times one large decode mat-vec at each candidate distance and at the
build's own (x86 8 KB, NEON 1 KB), interleaved, best of rounds (~0.7 s), and keeps in the
cache folder, keyed by CPU model, kernel build and thread count, the fastest where it beats
the build's by MARGIN, else the build's. ``EDGELLM_PREFETCH_AHEAD=N`` sets it by hand.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from edgellm.atomic import atomic_write_text
from edgellm.native.cpu_kernels import cache_dir
from edgellm.quants import Q

CANDIDATES = (1024, 2048, 4096, 8192, 16384)  # bytes ahead
#: the kernels leave their build's distance only for one this much faster: on a shared VM, in
#: a phase of slow memory, every distance read ~50 GB/s give or take 3% (and a pick by noise,
#: cached, cost 15% in the fast phases); in a fast phase 8 KB read 86 GB/s against 68-80
MARGIN = 0.05
#: the timed matrix: past the last-level cache of any laptop CPU (96 MB on AMD's X3D parts)
MATRIX_BYTES = 192 << 20
ROUNDS = 5
CACHE_FILE = "prefetch_distance.json"
_this_process: dict[str, int] = {}  # key -> answer: the file and the CPU read once a process


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; the platform's word elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "CPU part")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def prefetch_distance(native: Any, variant: str, threads: int) -> int | None:
    """The distance the kernels should prefetch at on this machine: $EDGELLM_PREFETCH_AHEAD,
    else the cached measurement, else a new one (cached for next time): the fastest
    candidate where it beats the build's distance by MARGIN, else the build's. None: no
    measurement could be made (keep the build's)."""
    forced = os.environ.get("EDGELLM_PREFETCH_AHEAD")
    if forced is not None:
        try:
            return int(forced)
        except ValueError:
            raise ValueError(f"EDGELLM_PREFETCH_AHEAD={forced!r} is not a byte count") from None
    key = f"{cpu_model()} | {variant} | {threads} threads"
    if key in _this_process:
        return _this_process[key]
    path = cache_dir() / CACHE_FILE
    known = _read_cache(path)
    if isinstance(known.get(key), int):
        _this_process[key] = known[key]
        return known[key]
    try:
        times = time_prefetch_distances(native, threads)
    except MemoryError:  # no room for the timed matrix now: measure another time
        return None
    current = native.lib.ek_prefetch_ahead()  # the build's, the prior to beat
    best = min(times, key=times.get)
    if times[best] > times[current] * (1 - MARGIN):
        best = current
    _this_process[key] = best
    known[key] = best
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(known, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only cache: measure again next time
    return best


def _read_cache(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def time_prefetch_distances(native: Any, threads: int) -> dict[int, float]:
    """Seconds a decode mat-vec over a MATRIX_BYTES Q8_0 matrix takes at each of CANDIDATES
    and the kernels' present distance (each its best of ROUNDS, the candidates interleaved
    so that a drift in memory speed favours none). Leaves the distance as it found it."""
    lib, ffi = native.lib, native.ffi
    cols = 4096
    packed_bytes = lib.ek_packed_bytes(int(Q.Q8_0), 16, cols)  # 0: this build does not pack
    row_bytes = packed_bytes // 16 if packed_bytes > 0 else cols // 32 * 34
    rows = MATRIX_BYTES // row_bytes // 16 * 16
    size = lib.ek_packed_bytes(int(Q.Q8_0), rows, cols) if packed_bytes > 0 else rows * row_bytes
    # 0x11 bytes: f16 scales of 5.8e-4 (normal numbers: no denormal slow paths), int8 weights 17
    weights = np.full(size, 0x11, dtype=np.uint8)
    x = np.ones((1, cols), dtype=np.float32)
    out = np.empty((1, rows), dtype=np.float32)
    w, xs, o = (ffi.from_buffer(t, a) for t, a in (("uint8_t[]", weights), ("float[]", x),
                                                   ("float[]", out)))
    if packed_bytes > 0:  # the kernels decode runs: packed records, else the file's blocks
        def matvec():
            lib.ek_matmul_packed(int(Q.Q8_0), w, rows, cols, xs, 1, o, threads)
    else:
        def matvec():
            lib.ek_matmul_f32(int(Q.Q8_0), w, row_bytes, rows, cols, xs, 1, o, threads, 8)
    matvec()  # warm: pages touched, the pool's threads started
    before = lib.ek_prefetch_ahead()
    best = dict.fromkeys(sorted({*CANDIDATES, before}), float("inf"))
    try:
        for _ in range(ROUNDS):
            for distance in best:
                lib.ek_set_prefetch_ahead(distance)
                start = time.perf_counter()
                matvec()
                best[distance] = min(best[distance], time.perf_counter() - start)
    finally:
        lib.ek_set_prefetch_ahead(before)
    return best
