"""GGUF blocks -> MLX's affine quantization (w = scale * q + bias), in numpy.

MLX packs ``bits``-bit unsigned integers as one little-endian bit stream per row (element i
at bit ``i * bits``, in uint32 words) with one scale and one bias per ``group_size`` elements
of a row. Most ggml block types are exactly that with groups of 32, once their integers are
unpacked and reordered:

====== ==== ======================== ============================ =========================
type   bits q                        scale                        bias
====== ==== ======================== ============================ =========================
Q4_0   4    nibble                   d                            -8 d
Q4_1   4    nibble                   d                            m
Q5_0   5    nibble | high bit << 4   d                            -16 d
Q5_1   5    nibble | high bit << 4   d                            m
Q8_0   8    q xor 0x80 (q + 128)     d                            -128 d
Q4_K   4    nibble (sub-block of 32) d * sc[j]                    -dmin * m[j]
Q5_K   5    nibble | high bit << 4   d * sc[j]                    -dmin * m[j]
====== ==== ======================== ============================ =========================

Every one of them dequantizes to the same float32 values as the numpy oracle
(``edgellm.quants.dequantize``), bit for bit: the products are exact in f32 (an 11-bit f16
significand times a <= 6-bit integer times a <= 5-bit integer), so the one rounding left is
the final add, which both sides do once. The legacy types' scales and biases are f16 values
(d, m, and d times a power of two), so they are stored as float16 at no loss; the K-quants'
products ``d * sc`` need up to 17 significant bits, so they are float32 (as float16 they are
off by up to 8e-3).

Q6_K has 16-value sub-blocks, each with its own int8 scale, and MLX's groups are 32, 64 or 128:
no single affine group of 32 holds two different sub-block scales exactly, and an exact
encoding needs twice the elements (each 16 padded to 32: 16 bits a weight with f32 scales,
more than float16). It is re-quantized instead: 8 bits, groups of 32, min/max affine from the
exactly dequantized values, float32 scale and bias (10 bits a weight against the file's
6.56). The error is at most half a step, ``(max - min) / 510`` per group; the two sub-blocks'
values span at most 64 of the larger one's steps (d * |sc|, q - 32 in -32..31, either sign),
so the error is at most 64/510 (~1/8) of the Q6_K group's own step: measured 0.1255 at most
and 0.104 on average on the 1.5B's output.weight (tests/test_mlx_backend.py). Types without
an affine mapping (Q2_K, Q3_K, IQ*) take the same 8-bit path; F32/F16/BF16 stay dense f32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgellm.quants import Q, dequantize

GROUP = 32

#: bits of MLX's affine encoding for each exactly mapped type
EXACT_BITS: dict[Q, int] = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8,
                            Q.Q4_K: 4, Q.Q5_K: 5}
#: plain float types, kept dense
DENSE = frozenset({Q.F32, Q.F16, Q.BF16})
#: bits used where the file's blocks have no exact affine form (Q6_K, ...)
REQUANT_BITS = 8


@dataclass
class AffineWeight:
    """A (rows, cols) matrix in MLX's affine layout: ``packed`` (rows, cols*bits/32) uint32,
    ``scales``/``biases`` (rows, cols/GROUP) float16 or float32."""

    packed: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    exact: bool  # dequantizes to the numpy oracle's values bit for bit

    group_size: int = GROUP

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes + self.scales.nbytes + self.biases.nbytes)


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ints q (rows, cols) < 2**bits -> MLX's bit stream (rows, cols*bits/32) uint32.

    The stream repeats every lcm(bits, 32) bits: ``per`` values fill ``words`` words, so
    each word is an OR of the (shifted) few values that overlap it.
    """
    rows, cols = q.shape
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)
    if bits == 4:
        q = np.asarray(q, dtype=np.uint8).reshape(rows, cols // 2, 2)
        return np.ascontiguousarray(q[..., 0] | (q[..., 1] << 4)).view(np.uint32)
    per = int(np.lcm(bits, 32)) // bits  # values per period (5 bits: 32; 6 bits: 16)
    words = per * bits // 32
    v = np.asarray(q, dtype=np.uint64).reshape(rows, cols // per, per)
    out = np.zeros((rows, cols // per, words), dtype=np.uint64)
    for i in range(per):
        first, last = (i * bits) // 32, (i * bits + bits - 1) // 32
        for w in range(first, last + 1):
            shift = i * bits - 32 * w
            out[..., w] |= (v[..., i] << np.uint64(shift)) if shift >= 0 else (
                v[..., i] >> np.uint64(-shift))
    return (out & np.uint64(0xFFFFFFFF)).astype(np.uint32).reshape(rows, -1)


def unpack_bits(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """The inverse of ``pack_bits``: (rows, cols*bits/32) uint32 -> (rows, cols) uint8."""
    rows = packed.shape[0]
    stream = np.unpackbits(np.ascontiguousarray(packed).view(np.uint8), axis=-1,
                           bitorder="little").reshape(rows, cols, bits)
    return np.packbits(stream, axis=-1, bitorder="little").reshape(rows, cols)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 field at byte ``offset`` of each block (rows, nb, bytes) -> (rows, nb) f16."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0]


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """16 bytes (..., 16) -> 32 values (..., 32): low nibbles first, then high (Q4_0/Q5_0)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """A block's 4-byte little-endian high-bit word (..., 4) -> bit i of it (..., 32)."""
    word = np.ascontiguousarray(qh).view(np.uint32)  # (..., 1)
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 packed bytes (..., 12) -> 6-bit sc and m (..., 8) (ggml's
    get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _f16_or_f32(*fields: np.ndarray) -> tuple[np.ndarray, ...]:
    """f16 fields as float16 when every value is finite there (always, short of an
    overflowing bias such as -128 d with |d| > 511), else as float32: both exact."""
    f32 = [np.asarray(f, dtype=np.float32) for f in fields]
    f16 = [f.astype(np.float16) for f in f32]
    if all(np.array_equal(a.astype(np.float32), b, equal_nan=True) for a, b in zip(f16, f32,
                                                                                 strict=True)):
        return tuple(f16)
    return tuple(f32)


def _legacy(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 blocks (rows, nb, bytes) -> q (rows, nb*32), scale, bias."""
    d = _f16(blocks, 0).astype(np.float32)  # (rows, nb)
    if qtype == Q.Q8_0:
        q = blocks[..., 2:34] ^ np.uint8(0x80)
        scale, bias = _f16_or_f32(d, -128 * d)
    elif qtype == Q.Q4_0:
        q = _nibbles_32(blocks[..., 2:18])
        scale, bias = _f16_or_f32(d, -8 * d)
    elif qtype == Q.Q4_1:
        q = _nibbles_32(blocks[..., 4:20])
        scale, bias = _f16_or_f32(d, _f16(blocks, 2))
    elif qtype == Q.Q5_0:
        q = _nibbles_32(blocks[..., 6:22]) | (_high_bits_32(blocks[..., 2:6]) << 4)
        scale, bias = _f16_or_f32(d, -16 * d)
    else:  # Q5_1
        q = _nibbles_32(blocks[..., 8:24]) | (_high_bits_32(blocks[..., 4:8]) << 4)
        scale, bias = _f16_or_f32(d, _f16(blocks, 2))
    rows = blocks.shape[0]
    return q.reshape(rows, -1), scale, bias


def _k_quant(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks (rows, nb, bytes) -> q (rows, nb*256), f32 scale and bias
    (rows, nb*8), one per 32-value sub-block."""
    rows, nb = blocks.shape[:2]
    d = _f16(blocks, 0).astype(np.float32)[..., None]  # (rows, nb, 1)
    dmin = _f16(blocks, 2).astype(np.float32)[..., None]
    sc, mn = _scale_min_k4(blocks[..., 4:16])  # (rows, nb, 8)
    if qtype == Q.Q4_K:
        qs = blocks[..., 16:144].reshape(rows, nb, 4, 32)
    else:
        qs = blocks[..., 48:176].reshape(rows, nb, 4, 32)
    # sub-block 2c: low nibbles of the c-th 32 bytes; 2c+1: their high nibbles
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, nb, 8, 32)
    if qtype == Q.Q5_K:
        qh = blocks[..., 16:48]  # (rows, nb, 32): bit j of byte i -> value i of sub-block j
        high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (.., 8, 32)
        q = q | (high << 4)
    scale = (d * sc.astype(np.float32)).reshape(rows, nb * 8)
    bias = -(dmin * mn.astype(np.float32)).reshape(rows, nb * 8)
    return q.reshape(rows, -1), scale, bias


def requantize(values: np.ndarray, bits: int = REQUANT_BITS) -> AffineWeight:
    """f32 (rows, cols) -> min/max affine ``bits``-bit groups of 32 (f32 scale and bias).

    Error per value <= scale / 2 = (max - min) / (2 (2**bits - 1)) of its group."""
    rows, cols = values.shape
    g = values.reshape(rows, cols // GROUP, GROUP).astype(np.float32)
    lo, hi = g.min(-1), g.max(-1)  # (rows, groups)
    levels = (1 << bits) - 1
    scale = (hi - lo) / np.float32(levels)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.clip(np.rint((g - lo[..., None]) / safe[..., None]), 0, levels).astype(np.uint8)
    return AffineWeight(pack_bits(q.reshape(rows, cols), bits), scale.astype(np.float32),
                        lo.astype(np.float32), bits, exact=False)


def to_affine(data: np.ndarray, qtype: Q, rows: int, cols: int) -> AffineWeight | None:
    """A weight's file blocks (rows, row_bytes) uint8 -> MLX's affine layout; None for the
    dense float types (and widths that are not a multiple of 32)."""
    if qtype in DENSE or cols % GROUP:
        return None
    blocks = np.asarray(data).reshape(rows, -1)
    if qtype in EXACT_BITS:
        from edgellm.quants import type_size

        blocks = blocks.reshape(rows, -1, type_size(qtype))
        split = _legacy if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0) else _k_quant
        q, scale, bias = split(blocks, qtype)
        bits = EXACT_BITS[qtype]
        return AffineWeight(pack_bits(q, bits), np.ascontiguousarray(scale),
                            np.ascontiguousarray(bias), bits, exact=True)
    return requantize(dequantize(blocks, qtype).reshape(rows, cols))


def dequantize_affine(w: AffineWeight) -> np.ndarray:
    """The values an AffineWeight stands for, f32 (rows, cols), computed in numpy as MLX
    does (scale * q + bias, one rounding): for tests and the exporter's checks."""
    rows = w.packed.shape[0]
    cols = w.packed.shape[1] * 32 // w.bits
    q = unpack_bits(w.packed, w.bits, cols).astype(np.float32).reshape(rows, -1, w.group_size)
    s = w.scales.astype(np.float32)[..., None]
    b = w.biases.astype(np.float32)[..., None]
    return (s * q + b).reshape(rows, cols)
