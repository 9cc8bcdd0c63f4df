"""GGUF blocks repacked at load into planes that a GPU kernel reads with wide, aligned loads.

Every core block type is the same thing underneath: an unsigned integer ``u`` of 4, 5, 6 or 8
bits per weight, and per group of 32 (Q6_K: 16) weights a scale and an offset, the weight
being ``u * scale + offset``. The file interleaves these in blocks of 18..210 bytes, which
no vector load can take apart cheaply (a Q5_0 block is 22 bytes: never aligned). Here each
part gets its own plane, per matrix row:

- ``q``: the low 4 bits two to a byte, in chunks of 64 weights: byte i of a chunk holds
  weight i (low nibble) and weight 32 + i (high nibble), which is Q4_K's own order; 8-bit
  types (Q8_0) keep one byte per weight (``u = q + 128``).
- ``qh``: the bits above the fourth, as int32 words: 1 bit per weight (Q5_0, Q5_1, Q5_K), a
  word per group of 32; 2 bits (Q6_K), a word per 16.
- ``s``: per group: d (f16) for the simple types, the 6-bit sub-block scale (uint8) for
  Q4_K/Q5_K, the signed sub-block scale (int8, per 16) for Q6_K.
- ``m``: per group: the f16 minimum of Q4_1/Q5_1, the 6-bit minimum (uint8) of Q4_K/Q5_K.
- ``d``, ``dm``: per 256-weight super-block (K-quants): the f16 scale and minimum scale.

The numbers are the file's own (no rounding): scale = d (simple) or d * s (K-quants, exact in
f32), offset = const * scale (Q4_0: -8, Q5_0: -16, Q8_0: -128, Q6_K: -32), m (Q4_1, Q5_1)
or -dm * m (K-quants). Memory equals the file's for the simple types and Q6_K, +2.8% for
Q4_K. Rows are padded with zero weights to a multiple of 64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgellm.quants import GGML_QUANT_SIZES, Q

CHUNK = 64  # weights per chunk of the nibble plane

#: the kernels' type codes
KINDS = {Q.Q8_0: 0, Q.Q4_0: 1, Q.Q4_1: 2, Q.Q5_0: 3, Q.Q5_1: 4, Q.Q4_K: 5, Q.Q5_K: 6, Q.Q6_K: 7}
#: offset = OFFSET_UNITS * scale for the symmetric types
OFFSET_UNITS = {Q.Q8_0: -128.0, Q.Q4_0: -8.0, Q.Q5_0: -16.0, Q.Q6_K: -32.0}
BITS = {Q.Q8_0: 8, Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


@dataclass
class Planes:
    """One matrix (rows, cols) repacked; arrays are numpy here, torch after upload."""

    qtype: Q
    rows: int
    cols: int
    padded: int  # cols rounded up to a multiple of CHUNK
    q: object
    qh: object = None
    s: object = None
    m: object = None
    d: object = None
    dm: object = None
    words: object = None  # q as int32 words, a view made by the mat-vec (not in arrays())

    @property
    def kind(self) -> int:
        return KINDS[self.qtype]

    def arrays(self) -> dict:
        return {k: getattr(self, k) for k in ("q", "qh", "s", "m", "d", "dm")
                if getattr(self, k) is not None}

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays().values()))

    def upload(self, device) -> Planes:
        """These planes (numpy, as ``pack`` makes them) as torch tensors on ``device``, in
        place; returns self."""
        import torch

        for key, a in self.arrays().items():
            setattr(self, key, torch.from_numpy(a).to(device))
        return self


def _f16(raw: np.ndarray) -> np.ndarray:
    """(..., 2) uint8 -> (...) float16."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes (..., 12) -> 6-bit scales and minimums (..., 8) uint8."""
    s = scales.astype(np.uint8)
    sc = np.empty((*s.shape[:-1], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _decode(data: np.ndarray, qtype: Q, rows: int, cols: int) -> dict:
    """The file's blocks (rows, row_bytes) -> u (rows, cols) uint8 and the per-group factors."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    nb = cols // bs
    b = np.ascontiguousarray(data).reshape(rows, nb, ts)
    out: dict = {}
    if qtype == Q.Q8_0:
        out["s"] = _f16(b[..., 0:2])
        out["u"] = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    elif qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        out["s"] = _f16(b[..., 0:2])
        pos = 2
        if qtype in (Q.Q4_1, Q.Q5_1):
            out["m"] = _f16(b[..., 2:4])
            pos = 4
        hbits = None
        if qtype in (Q.Q5_0, Q.Q5_1):
            qh = np.ascontiguousarray(b[..., pos:pos + 4]).view("<u4")[..., 0]  # (rows, nb)
            hbits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # (rows, nb, 32)
            pos += 4
        qs = b[..., pos:pos + 16]
        u = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # (rows, nb, 32): j and j + 16
        if hbits is not None:
            u = u | (hbits.astype(np.uint8) << 4)
        out["u"] = u
    elif qtype in (Q.Q4_K, Q.Q5_K):
        out["d"], out["dm"] = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        out["s"], out["m"] = sc.reshape(rows, nb * 8), mn.reshape(rows, nb * 8)
        if qtype == Q.Q4_K:
            qs = b[..., 16:144].reshape(rows, nb, 4, 32)
            high = 0
        else:
            qh = b[..., 16:48]  # (rows, nb, 32): bit 2c / 2c+1 of byte l = chunk c's l / 32+l
            qs = b[..., 48:176].reshape(rows, nb, 4, 32)
            shifts = np.arange(8, dtype=np.uint8).reshape(4, 2)
            high = ((qh[:, :, None, None, :] >> shifts[None, None, :, :, None]) & 1) << 4
        u = np.stack([qs & 0xF, qs >> 4], axis=3)  # (rows, nb, 4, 2, 32)
        out["u"] = (u | high).astype(np.uint8)
    elif qtype == Q.Q6_K:
        ql = b[..., 0:128].reshape(rows, nb, 2, 64)
        qh = b[..., 128:192].reshape(rows, nb, 2, 32)
        out["s"] = b[..., 192:208].view(np.int8).reshape(rows, nb * 16)
        out["d"] = _f16(b[..., 208:210])
        lo = np.stack([ql[..., :32] & 0xF, ql[..., 32:] & 0xF,
                       ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)  # (rows, nb, 2, 4, 32)
        hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
        out["u"] = lo | (hi << 4)
    else:
        raise ValueError(f"{qtype.name} blocks are not packed for the GPU")
    out["u"] = np.ascontiguousarray(out["u"]).reshape(rows, cols)
    return out


def pack(data: np.ndarray, qtype: Q, rows: int, cols: int) -> Planes:
    """Repack a (rows, cols) matrix of ``qtype`` blocks (data: (rows, row_bytes) uint8)."""
    if qtype not in KINDS:
        raise ValueError(f"{qtype.name} blocks are not packed for the GPU")
    parts = _decode(data, qtype, rows, cols)
    padded = -(-cols // CHUNK) * CHUNK
    u = np.zeros((rows, padded), np.uint8)
    u[:, :cols] = parts["u"]
    group = 16 if qtype == Q.Q6_K else 32

    def per_group(a: np.ndarray) -> np.ndarray:  # zero scales/minimums on the padding
        out = np.zeros((rows, padded // group), a.dtype)
        out[:, :a.shape[1]] = a
        return out

    bits = BITS[qtype]
    if bits == 8:
        q = u
    else:
        lo = (u & 0xF).reshape(rows, padded // CHUNK, 2, 32)
        q = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(rows, padded // 2)
    qh = None
    if bits in (5, 6):
        width = bits - 4  # high bits per weight
        per_word = 32 // width
        h = (u >> 4).astype(np.uint32).reshape(rows, padded // per_word, per_word)
        words = (h << (np.arange(per_word, dtype=np.uint32) * width)).sum(-1, dtype=np.uint32)
        qh = words.view(np.int32)
    planes = Planes(qtype, rows, cols, padded, np.ascontiguousarray(q),
                    None if qh is None else np.ascontiguousarray(qh))
    planes.s = per_group(parts["s"])
    if "m" in parts:
        planes.m = per_group(parts["m"])
    if "d" in parts:
        n_super = padded // 256 + (padded % 256 > 0)
        for key in ("d", "dm"):
            if key in parts:
                a = np.zeros((rows, n_super), np.float16)
                a[:, :parts[key].shape[1]] = parts[key]
                setattr(planes, key, a)
    return planes


def stack_rows(parts: list[Planes], cat) -> tuple[Planes, list[Planes]]:
    """Matrices of one type and width as one taller matrix (``cat``: torch.cat or
    np.concatenate), and each part again as a view of its rows of it: one mat-vec for Q, K
    and V, or gate and up, in the memory the parts took."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.cols != first.cols for p in parts):
        raise ValueError("stack_rows: matrices of one block type and width only")
    keys = first.arrays().keys()
    whole = Planes(first.qtype, sum(p.rows for p in parts), first.cols, first.padded,
                   **{k: cat([getattr(p, k) for p in parts]) for k in keys})
    views, start = [], 0
    for p in parts:
        rows = slice(start, start + p.rows)
        views.append(Planes(p.qtype, p.rows, p.cols, p.padded,
                            **{k: getattr(whole, k)[rows] for k in keys}))
        start += p.rows
    return whole, views


def dequantize_planes(p: Planes, xp=np) -> np.ndarray:
    """The packed matrix back to f32 (rows, cols), in numpy (xp=np) or torch (xp=torch):
    the same formulas as the GPU kernels, used on the CPU and to test the repacking."""
    rows, padded = p.rows, p.padded
    chunks = padded // CHUNK
    if BITS[p.qtype] == 8:
        u = _as_int(p.q, xp)
    else:
        q = _as_int(p.q, xp).reshape(rows, chunks, 1, 32)
        u = _cat([q & 0xF, q >> 4], axis=2, xp=xp).reshape(rows, padded)
    if p.qh is not None:
        width = BITS[p.qtype] - 4
        per_word = 32 // width
        words = _as_int(p.qh, xp).reshape(rows, -1, 1)
        shifts = _arange(per_word, xp) * width
        u = u | (((words >> shifts) & ((1 << width) - 1)) << 4).reshape(rows, padded)
    group = 16 if p.qtype == Q.Q6_K else 32
    s = _as_float(p.s, xp)
    if p.qtype in K_QUANTS:
        per_super = 256 // group
        d = _as_float(p.d, xp)
        d = _repeat(d, per_super, xp)[:, :s.shape[1]]
        scale = d * s
        if p.qtype == Q.Q6_K:
            offset = -32.0 * scale
        else:
            dm = _repeat(_as_float(p.dm, xp), per_super, xp)[:, :s.shape[1]]
            offset = -(dm * _as_float(p.m, xp))
    else:
        scale = s
        offset = _as_float(p.m, xp) if p.m is not None else OFFSET_UNITS[p.qtype] * scale
    uf = _as_float(u, xp).reshape(rows, -1, group)
    w = uf * scale.reshape(rows, -1, 1) + offset.reshape(rows, -1, 1)
    return w.reshape(rows, padded)[:, :p.cols]


def _as_int(a, xp):
    return a.astype(np.int32) if xp is np else a.to(xp.int32)


def _as_float(a, xp):
    return a.astype(np.float32) if xp is np else a.to(xp.float32)


def _cat(parts, axis, xp):
    return np.concatenate(parts, axis=axis) if xp is np else xp.cat(parts, dim=axis)


def _arange(n, xp):
    return np.arange(n, dtype=np.int32) if xp is np else xp.arange(n, dtype=xp.int32)


def _repeat(a, n, xp):
    return np.repeat(a, n, axis=1) if xp is np else a.repeat_interleave(n, dim=1)
