"""Numba kernels over ggml's quantized blocks, read in place: the portable path (no C compiler).

``dequant_row`` decodes one row of blocks into a small f32 buffer; mat-vec decodes a row at a
time and dots it with the activations, so f32 weights never exist beyond one row per thread.
Block layouts are ggml's (``ggml-common.h``); f16 scales go through a 65536-entry table since
Numba has no float16 type.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange

from edgellm.quants import Q

#: qtype -> small int code the kernels branch on.
CODES = {Q.Q8_0: 8, Q.Q4_0: 2, Q.Q4_1: 3, Q.Q5_0: 6, Q.Q5_1: 7, Q.Q4_K: 12, Q.Q5_K: 13,
         Q.Q6_K: 14}

#: f16 bit pattern -> f32 value.
F16_TABLE = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_JIT = dict(cache=True, fastmath=True, boundscheck=False, error_model="numpy")


@nb.njit(inline="always", **_JIT)
def _h(row, o, tab):
    """f16 at byte offset o of row."""
    return tab[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]


@nb.njit(inline="always", **_JIT)
def _scale_min_k4(j, row, base):
    """6-bit scale and min of K-quant sub-block j from the 12 scale bytes at row[base:]."""
    if j < 4:
        return row[base + j] & 63, row[base + j + 4] & 63
    sc = (row[base + j + 4] & 0xF) | ((row[base + j - 4] >> 6) << 4)
    mn = (row[base + j + 4] >> 4) | ((row[base + j] >> 6) << 4)
    return sc, mn


@nb.njit(**_JIT)
def dequant_row(code, row, out, tab):
    """Decode one row of blocks (uint8, row_bytes) into out (cols,) f32."""
    cols = out.shape[0]
    if code == 8:  # Q8_0: d, 32 x int8
        for b in range(cols // 32):
            o = b * 34
            d = _h(row, o, tab)
            for i in range(32):
                out[b * 32 + i] = d * np.float32(np.int8(row[o + 2 + i]))
    elif code == 2 or code == 3:  # Q4_0: d, 16 B nibbles (-8); Q4_1: d, m, 16 B nibbles
        size = 18 if code == 2 else 20
        for b in range(cols // 32):
            o = b * size
            d = _h(row, o, tab)
            m = -8.0 * d if code == 2 else _h(row, o + 2, tab)
            qo = o + size - 16
            for i in range(16):
                v = row[qo + i]
                out[b * 32 + i] = d * np.float32(v & 15) + m
                out[b * 32 + 16 + i] = d * np.float32(v >> 4) + m
    elif code == 6 or code == 7:  # Q5_0: d, qh u32, nibbles (-16); Q5_1: d, m, qh, nibbles
        size = 22 if code == 6 else 24
        for b in range(cols // 32):
            o = b * size
            d = _h(row, o, tab)
            m = -16.0 * d if code == 6 else _h(row, o + 2, tab)
            ho = o + size - 20
            qh = (np.uint32(row[ho]) | (np.uint32(row[ho + 1]) << 8)
                  | (np.uint32(row[ho + 2]) << 16) | (np.uint32(row[ho + 3]) << 24))
            for i in range(16):
                v = row[ho + 4 + i]
                lo = np.uint32(v & 15) | (((qh >> i) & 1) << 4)
                hi = np.uint32(v >> 4) | (((qh >> (i + 16)) & 1) << 4)
                out[b * 32 + i] = d * np.float32(lo) + m
                out[b * 32 + 16 + i] = d * np.float32(hi) + m
    elif code == 12 or code == 13:  # Q4_K / Q5_K superblocks of 256
        size = 144 if code == 12 else 176
        qs0 = 16 if code == 12 else 48
        for sb in range(cols // 256):
            o = sb * size
            d, dmin = _h(row, o, tab), _h(row, o + 2, tab)
            for j in range(4):
                sc1, m1 = _scale_min_k4(2 * j, row, o + 4)
                sc2, m2 = _scale_min_k4(2 * j + 1, row, o + 4)
                d1, dm1 = d * np.float32(sc1), dmin * np.float32(m1)
                d2, dm2 = d * np.float32(sc2), dmin * np.float32(m2)
                base = sb * 256 + 64 * j
                for i in range(32):
                    v = row[o + qs0 + 32 * j + i]
                    lo = np.int32(v & 15)
                    hi = np.int32(v >> 4)
                    if code == 13:
                        h = np.int32(row[o + 16 + i])
                        lo += ((h >> (2 * j)) & 1) << 4
                        hi += ((h >> (2 * j + 1)) & 1) << 4
                    out[base + i] = d1 * np.float32(lo) - dm1
                    out[base + 32 + i] = d2 * np.float32(hi) - dm2
    elif code == 14:  # Q6_K: ql 128, qh 64, int8 scales 16, d
        for sb in range(cols // 256):
            o = sb * 210
            d = _h(row, o + 208, tab)
            for h in range(2):
                ql, qh, sc = o + 64 * h, o + 128 + 32 * h, o + 192 + 8 * h
                base = sb * 256 + 128 * h
                for i in range(32):
                    a, c = np.int32(row[ql + i]), np.int32(row[ql + 32 + i])
                    hb = np.int32(row[qh + i])
                    s = i // 16
                    q1 = ((a & 15) | ((hb & 3) << 4)) - 32
                    q2 = ((c & 15) | (((hb >> 2) & 3) << 4)) - 32
                    q3 = ((a >> 4) | (((hb >> 4) & 3) << 4)) - 32
                    q4 = ((c >> 4) | (((hb >> 6) & 3) << 4)) - 32
                    out[base + i] = d * np.float32(np.int8(row[sc + s])) * np.float32(q1)
                    out[base + 32 + i] = d * np.float32(np.int8(row[sc + 2 + s])) * np.float32(q2)
                    out[base + 64 + i] = d * np.float32(np.int8(row[sc + 4 + s])) * np.float32(q3)
                    out[base + 96 + i] = d * np.float32(np.int8(row[sc + 6 + s])) * np.float32(q4)


@nb.njit(nogil=True, **_JIT)
def dequant_rows(code, data, ids, out, tab):
    """out[i] = decoded row ids[i] of data (rows, row_bytes): (len(ids), cols) f32.

    Serial on purpose: embedding lookups are a few rows, and a parallel region per token
    would leave Numba's OpenMP workers spinning against the mat-vec threads."""
    for i in range(ids.shape[0]):
        dequant_row(code, data[ids[i]], out[i], tab)


@nb.njit(nogil=True, **_JIT)
def dequant_rows_serial(code, data, r0, r1, out, tab):
    """out (r1 - r0, cols) = decoded rows r0..r1 of data, on the calling thread (GIL released)."""
    for r in range(r0, r1):
        dequant_row(code, data[r], out[r - r0], tab)


@nb.njit(parallel=True, **_JIT)
def matvec(code, data, x, out, tab):
    """out (n, rows) = x (n, cols) @ W.T for a few tokens, decoding W one row at a time."""
    rows, n, cols = data.shape[0], x.shape[0], x.shape[1]
    chunk = 32
    for c in prange((rows + chunk - 1) // chunk):
        buf = np.empty(cols, dtype=np.float32)  # one decoded row, per chunk
        for r in range(c * chunk, min(rows, (c + 1) * chunk)):
            dequant_row(code, data[r], buf, tab)
            for t in range(n):
                acc = np.float32(0.0)
                for i in range(cols):
                    acc += buf[i] * x[t, i]
                out[t, r] = acc
