"""The Numba path's repacked weights: integer mat-vec over int8 activations, no C compiler.

Why repack: in the file's blocks every 32 weights sit behind an f16 scale at an odd offset
(Q8_0: 34-byte blocks), Q5_0's fifth bits and the K-quants' 6-bit scales are packed across
bytes, and Numba has neither f16 nor int8 vector arithmetic from plain loops. So at load each
weight is split into planes, one array each, per row:

    Q8_0: q int8 (rows, cols)         | d f32 (rows, cols/32)                       36 B / 32
    Q5_0: nib u8 (rows, cols/2)        | qh u32 (rows, cols/32) | d f32               24 B / 32
    Q4_K: nib u8 (rows, cols/2)        | sc, mn u8 (rows, cols/32) | d, dmin f32 (rows, cols/256)
    Q6_K: ql u8 (rows, cols/2), qh u8 (rows, cols/4) | sc int8 (rows, cols/16) | d f32

Nibbles keep the file's order (so 16 or 32 contiguous bytes hold one or two whole sub-blocks)
and only the scales change form (f16 -> f32, 6-bit -> bytes): the planes are within 9% of the
file's bytes, and the file's pages are let go once a slice is packed (resident memory stays
near the file size). Decode rounds the activations to int8 once per matmul as llama.cpp does
(Q8_0 per 32; Q8_K per 256 for K-quants) and dots them with the weights 32 at a time in
``numba_simd``'s vector code, rows split across threads in chunks of 16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba as nb
import numpy as np
from numba import prange

from edgellm.quants import Q

from .numba_pool import MatvecPool, weight_job
from .numba_quant import _JIT, F16_TABLE, _h, _scale_min_k4

#: the types repacked for the integer kernels (the rest keep the file-block kernels)
PACKED_TYPES = frozenset((Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K))
#: exact arithmetic for the activation rounding (fastmath may turn 127 / amax into a
#: reciprocal multiply and round differently from llama.cpp)
_EXACT = dict(cache=True, boundscheck=False, error_model="numpy")


def packed_block(qtype: Q) -> int:
    """Columns per block of a packed type's activations (Q8_K: 256, Q8_0: 32)."""
    return 256 if qtype in (Q.Q4_K, Q.Q6_K) else 32


# -- activations -----------------------------------------------------------------------------
@nb.njit(inline="always", **_EXACT)
def _f16_round(v):
    """Positive finite f32 v rounded to the nearest f16 (ties to even), as f32."""
    if v >= 65520.0:
        return np.float32(np.inf)
    _, e = math.frexp(np.float64(v))  # v in [2^(e-1), 2^e)
    ulp = math.ldexp(1.0, max(e - 11, -24))  # f16: 10 fraction bits; subnormals below 2^-14
    return np.float32(np.rint(np.float64(v) / ulp) * ulp)


@nb.njit(**_EXACT)
def quantize_q8_0(x, xq, xd, xs):
    """x (n, cols) f32 -> xq int8 (n, cols), xd f32 (n, cols/32), xs int32 (n, cols/32) block
    sums: x86 llama.cpp's quantize_row_q8_0 (q = rint(x * 127/amax), d = f16(amax/127))."""
    for t in range(x.shape[0]):
        for b in range(x.shape[1] // 32):
            amax = np.float32(0.0)
            for i in range(32):
                amax = max(amax, abs(x[t, 32 * b + i]))
            total = 0
            if amax == 0:
                for i in range(32):
                    xq[t, 32 * b + i] = 0
                xd[t, b] = 0.0
            else:
                inv = np.float32(127.0) / amax
                for i in range(32):
                    q = np.int32(np.rint(x[t, 32 * b + i] * inv))
                    xq[t, 32 * b + i] = q
                    total += q
                xd[t, b] = _f16_round(amax / np.float32(127.0))
            xs[t, b] = total


@nb.njit(**_EXACT)
def quantize_q8_k(x, xq, xd, xs16, xs32):
    """x (n, cols) f32 -> xq int8, xd f32 (n, cols/256), sums of xq per 16 and per 32 (int32):
    ggml's quantize_row_q8_K_ref (iscale = -127/peak, q = min(127, rint(iscale * x)))."""
    for t in range(x.shape[0]):
        for s in range(x.shape[1] // 256):
            o = 256 * s
            amax, peak = np.float32(0.0), np.float32(0.0)
            for i in range(256):
                a = abs(x[t, o + i])
                if a > amax:
                    amax, peak = a, x[t, o + i]
            if amax == 0:
                xq[t, o:o + 256] = 0
                xd[t, s] = 0.0
                xs16[t, 16 * s:16 * s + 16] = 0
                xs32[t, 8 * s:8 * s + 8] = 0
                continue
            iscale = np.float32(-127.0) / peak
            for i in range(256):
                xq[t, o + i] = min(np.int32(127), np.int32(np.rint(iscale * x[t, o + i])))
            xd[t, s] = np.float32(1.0) / iscale
            for j in range(16):
                total = 0
                for i in range(16):
                    total += xq[t, o + 16 * j + i]
                xs16[t, 16 * s + j] = total
            for j in range(8):
                xs32[t, 8 * s + j] = xs16[t, 16 * s + 2 * j] + xs16[t, 16 * s + 2 * j + 1]


def quantize_activations(x: np.ndarray, qtype: Q) -> tuple:
    """x (n, cols) f32 rounded to int8 for ``qtype``'s kernel: xq int8 (n, cols), xd f32 scales
    per block, sums of xq per 16 (Q8_K only, else None) and per 32 (int32)."""
    n, cols = x.shape
    xq = np.empty((n, cols), dtype=np.int8)
    if packed_block(qtype) == 256:
        xd = np.empty((n, cols // 256), dtype=np.float32)
        xs16 = np.empty((n, cols // 16), dtype=np.int32)
        xs32 = np.empty((n, cols // 32), dtype=np.int32)
        quantize_q8_k(x, xq, xd, xs16, xs32)
        return xq, xd, xs16, xs32
    xd = np.empty((n, cols // 32), dtype=np.float32)
    xs = np.empty((n, cols // 32), dtype=np.int32)
    quantize_q8_0(x, xq, xd, xs)
    return xq, xd, None, xs


# -- packing (once, at load) ----------------------------------------------------------------
@dataclass
class PackedWeight:
    """A (rows, cols) weight as planes (see the module docstring), in ``planes``' order."""

    qtype: Q
    rows: int
    cols: int
    planes: tuple

    def __post_init__(self):
        blocks = self.cols // packed_block(self.qtype)
        #: the planes' addresses for the pool's jobs (numba_pool.weight_job)
        self.job = weight_job(self.qtype.name, self.rows, blocks, self.planes)

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.planes)


def allocate(qtype: Q, rows: int, cols: int) -> PackedWeight:
    """Empty planes for a rows x cols weight of qtype."""
    u8, f32 = np.uint8, np.float32
    if qtype == Q.Q8_0:
        planes = (np.empty((rows, cols), np.int8), np.empty((rows, cols // 32), f32))
    elif qtype == Q.Q5_0:
        planes = (np.empty((rows, cols // 2), u8), np.empty((rows, cols // 32), np.uint32),
                  np.empty((rows, cols // 32), f32))
    elif qtype == Q.Q4_K:
        planes = (np.empty((rows, cols // 2), u8), np.empty((rows, cols // 32), u8),
                  np.empty((rows, cols // 32), u8), np.empty((rows, cols // 256), f32),
                  np.empty((rows, cols // 256), f32))
    elif qtype == Q.Q6_K:
        planes = (np.empty((rows, cols // 2), u8), np.empty((rows, cols // 4), u8),
                  np.empty((rows, cols // 16), np.int8), np.empty((rows, cols // 256), f32))
    else:
        raise ValueError(f"{qtype.name} is not a packed type")
    return PackedWeight(qtype, rows, cols, planes)


def packable(qtype: Q, cols: int) -> bool:
    """Whether a weight of this type and width takes the packed kernels."""
    return qtype in PACKED_TYPES and cols % packed_block(qtype) == 0


@nb.njit(parallel=True, **_EXACT)
def _pack_q8_0(data, r0, q, d, tab):
    for r in prange(data.shape[0]):
        row = data[r]
        for b in range(d.shape[1]):
            d[r0 + r, b] = _h(row, 34 * b, tab)
            for i in range(32):
                q[r0 + r, 32 * b + i] = np.int8(row[34 * b + 2 + i])


@nb.njit(parallel=True, **_EXACT)
def _pack_q5_0(data, r0, nib, qh, d, tab):
    for r in prange(data.shape[0]):
        row = data[r]
        for b in range(d.shape[1]):
            o = 22 * b
            d[r0 + r, b] = _h(row, o, tab)
            qh[r0 + r, b] = (np.uint32(row[o + 2]) | (np.uint32(row[o + 3]) << 8)
                             | (np.uint32(row[o + 4]) << 16) | (np.uint32(row[o + 5]) << 24))
            for i in range(16):
                nib[r0 + r, 16 * b + i] = row[o + 6 + i]


@nb.njit(parallel=True, **_EXACT)
def _pack_q4_k(data, r0, nib, sc, mn, dd, dm, tab):
    for r in prange(data.shape[0]):
        row = data[r]
        for s in range(dd.shape[1]):
            o = 144 * s
            dd[r0 + r, s] = _h(row, o, tab)
            dm[r0 + r, s] = _h(row, o + 2, tab)
            for j in range(8):
                a, m = _scale_min_k4(j, row, o + 4)
                sc[r0 + r, 8 * s + j] = a
                mn[r0 + r, 8 * s + j] = m
            for i in range(128):
                nib[r0 + r, 128 * s + i] = row[o + 16 + i]


@nb.njit(parallel=True, **_EXACT)
def _pack_q6_k(data, r0, ql, qh, sc, d, tab):
    for r in prange(data.shape[0]):
        row = data[r]
        for s in range(d.shape[1]):
            o = 210 * s
            for i in range(128):
                ql[r0 + r, 128 * s + i] = row[o + i]
            for i in range(64):
                qh[r0 + r, 64 * s + i] = row[o + 128 + i]
            for i in range(16):
                sc[r0 + r, 16 * s + i] = np.int8(row[o + 192 + i])
            d[r0 + r, s] = _h(row, o + 208, tab)


_PACKERS = {Q.Q8_0: _pack_q8_0, Q.Q5_0: _pack_q5_0, Q.Q4_K: _pack_q4_k, Q.Q6_K: _pack_q6_k}


def pack_rows(packed: PackedWeight, data: np.ndarray, r0: int) -> None:
    """Pack the file rows ``data`` (k, row_bytes) uint8 into rows r0..r0+k of ``packed``."""
    _PACKERS[packed.qtype](data, r0, *packed.planes, F16_TABLE)


# -- mat-vec (decode, speculative checks) ---------------------------------------------------
def matvec(packed: PackedWeight, x: np.ndarray, pool: MatvecPool) -> np.ndarray:
    """(n, rows) f32 = x (n, cols) f32 @ W.T, the activations rounded to int8 first, the rows
    shared out by ``pool``."""
    out = np.empty((x.shape[0], packed.rows), dtype=np.float32)
    xq, xd, xs16, xs32 = quantize_activations(x, packed.qtype)
    pool.run(packed.job, xq, xd, xs16 if packed.qtype == Q.Q6_K else xs32, out)
    return out


# -- back to f32 (embedding lookups, prefill tiles) -----------------------------------------
@nb.njit(inline="always", **_JIT)
def _row_q8_0(r, q, d, out):
    for b in range(d.shape[1]):
        for i in range(32):
            out[32 * b + i] = d[r, b] * np.float32(q[r, 32 * b + i])


@nb.njit(inline="always", **_JIT)
def _row_q5_0(r, nib, qh, d, out):
    for b in range(d.shape[1]):
        h = qh[r, b]
        for i in range(16):
            v = nib[r, 16 * b + i]
            lo = np.int32(v & 15) | np.int32(((h >> i) & 1) << 4)
            hi = np.int32(v >> 4) | np.int32(((h >> (i + 16)) & 1) << 4)
            out[32 * b + i] = d[r, b] * np.float32(lo - 16)
            out[32 * b + 16 + i] = d[r, b] * np.float32(hi - 16)


@nb.njit(inline="always", **_JIT)
def _row_q4_k(r, nib, sc, mn, dd, dm, out):
    for s in range(dd.shape[1]):
        for j in range(4):
            for k in range(2):
                sub = 8 * s + 2 * j + k
                scale = dd[r, s] * np.float32(sc[r, sub])
                low = dm[r, s] * np.float32(mn[r, sub])
                for i in range(32):
                    v = nib[r, 128 * s + 32 * j + i]
                    q = (v >> 4) if k else (v & 15)
                    out[256 * s + 64 * j + 32 * k + i] = scale * np.float32(q) - low


@nb.njit(inline="always", **_JIT)
def _row_q6_k(r, ql, qh, sc, d, out):
    for s in range(d.shape[1]):
        for h in range(2):
            for i in range(32):
                a = np.int32(ql[r, 128 * s + 64 * h + i])
                c = np.int32(ql[r, 128 * s + 64 * h + 32 + i])
                hb = np.int32(qh[r, 64 * s + 32 * h + i])
                qs = (((a & 15) | ((hb & 3) << 4)) - 32, ((c & 15) | (((hb >> 2) & 3) << 4)) - 32,
                      ((a >> 4) | (((hb >> 4) & 3) << 4)) - 32, ((c >> 4) | (((hb >> 6) & 3) << 4))
                      - 32)
                for g in range(4):
                    scale = d[r, s] * np.float32(sc[r, 16 * s + 8 * h + 2 * g + i // 16])
                    out[256 * s + 128 * h + 32 * g + i] = scale * np.float32(qs[g])


@nb.njit(nogil=True, **_JIT)
def _rows_q8_0(ids, q, d, out):
    for i in range(ids.shape[0]):
        _row_q8_0(ids[i], q, d, out[i])


@nb.njit(nogil=True, **_JIT)
def _rows_q5_0(ids, nib, qh, d, out):
    for i in range(ids.shape[0]):
        _row_q5_0(ids[i], nib, qh, d, out[i])


@nb.njit(nogil=True, **_JIT)
def _rows_q4_k(ids, nib, sc, mn, dd, dm, out):
    for i in range(ids.shape[0]):
        _row_q4_k(ids[i], nib, sc, mn, dd, dm, out[i])


@nb.njit(nogil=True, **_JIT)
def _rows_q6_k(ids, ql, qh, sc, d, out):
    for i in range(ids.shape[0]):
        _row_q6_k(ids[i], ql, qh, sc, d, out[i])


_ROWS = {Q.Q8_0: _rows_q8_0, Q.Q5_0: _rows_q5_0, Q.Q4_K: _rows_q4_k, Q.Q6_K: _rows_q6_k}


def dequantize_rows(packed: PackedWeight, ids: np.ndarray, out: np.ndarray) -> None:
    """out (len(ids), cols) f32 = the weight's rows ``ids`` (int64), on the calling thread with
    the GIL released (prefill tiles run on several threads)."""
    _ROWS[packed.qtype](ids, *packed.planes, out)
