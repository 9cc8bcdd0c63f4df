"""Triton kernels of the torch backend, over the planes of ``packing.py``.

- ``quantize_activations`` + ``qmatvec``: x (n <= 8, K) @ W.T for decode and speculative
  checks, in integers as llama.cpp's MMVQ does it: x as int8 blocks with a scale per 32
  values (Q8_0 per 32, or Q8_K per 256 against K-quants: llama.cpp's CPU rounding), the
  weights' 4-6 bit values packed four to a word, ``dp4a`` for each word, then per group
  ``xd * (scale * sum(u q) + offset * sum(q))``. Matrices with few rows split K among
  programs; the last program of a row block adds the partial sums in a fixed order.
  ``qmatvec_glu``: gate and up (stacked) in one launch with the GLU and its 8-bit blocks.
- ``dequantize``: W (or some of its rows: embedding lookups) to f16/f32, for prefill GEMMs;
  ``dequantized_matmul``: a prefill GEMM with W's tiles dequantized inside it.
  ``prompt_matmul`` takes one or the other; on a GPU it and the mat-vec's tile are timed
  per shape at first use (``tuning.choose``).
- ``round_activations``: x rounded to those 8-bit blocks, in float (the GEMM's input).
- ``attention``: flash-decoding for <= 8 queries: programs over (token, head, 32 key slots)
  in f32 from the f16 cache; the last of a head's programs to finish combines them, the
  last head of each 256 columns may write their 8-bit blocks for the output projection,
  and the step's new keys and values may be stored in the same launch.
- ``flash_prompt_attention``: a prompt's attention (flash attention, GQA rows stacked per
  KV head) on tensor cores with f32 accuracy (f16 parts of the f32 operands).
- ``rms_norm``, ``rope``, ``glu``, ``store_kv``: one launch each instead of a handful of
  torch ops (in decode, launches rather than bytes set much of the pace).

They run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests). Every
launch goes through ``_launch``, and every kernel starts with ``_await_inputs``: on a
Hopper GPU they are programmatic dependent launches (``_pdl``; EDGELLM_PDL=0: plain).
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

from . import tuning
from .packing import CHUNK, Planes

try:  # grid dependency control (triton >= 3.4; Hopper and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # (then PDL is never on, and neither is called)
    gdc_launch_dependents = gdc_wait = None

#: tokens up to which a matmul runs the mat-vec kernel (above: dequantize + GEMM)
MATVEC_MAX_TOKENS = 8
#: what attention's ``apart`` offsets are a multiple of, in elements (64 bytes of f32,
#: ``offsets``): so a sequence's cache loads as its own would, in 16-byte vectors
OFFSET_ALIGN = tl.constexpr(16)
#: 1.5 * 2**23: (v + M) - M rounds |v| < 2**22 to the nearest even int (a constexpr: triton
#: kernels may read no other globals)
_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _await_inputs(PDL: tl.constexpr):
    """Every kernel's first step (the mat-vecs' after ``_prefetch_weights``). PDL (a
    programmatic dependent launch, ``_pdl``): the program may start while the launch
    before it is still running, so it waits here until that launch has finished and its
    writes are visible (everything before it had, in turn, finished: every kernel waits
    here first), then lets the next launch's programs be scheduled. What it saves: the gap
    between launches, where a graph's decode step has 230-255 of them."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _group_scales(s_ptr, m_ptr, d_ptr, dm_ptr, r, c, sub, mk, ng, nsup, KIND: tl.constexpr):
    """Scale and offset of the weight groups of chunks c in rows r, for each chunk's low and
    high 32 weights: (s_lo, s_hi, o_lo, o_hi). r, c and sub (which 16 of a half: Q6_K's
    groups) broadcast to the caller's tile; mk masks rows and chunks."""
    return _scales_of(*_scale_loads(s_ptr, m_ptr, d_ptr, dm_ptr, r, c, sub, mk, ng, nsup,
                                    KIND), KIND)


@triton.jit
def _scale_loads(s_ptr, m_ptr, d_ptr, dm_ptr, r, c, sub, mk, ng, nsup, KIND: tl.constexpr):
    """``_group_scales``' loads alone, nothing computed from them (a pipelined mat-vec
    issues them a step ahead: arithmetic on a load would wait for it there): the planes'
    values (a_lo, a_hi, b_lo, b_hi, dd, dmin) as ``_scales_of`` reads them, 0 where KIND
    has no such plane."""
    b_lo, b_hi, dd, dmin = 0, 0, 0, 0
    if KIND == 7:  # Q6_K: a scale per 16 weights
        a_lo = tl.load(s_ptr + r * (2 * ng) + c * 4 + sub, mask=mk, other=0)
        a_hi = tl.load(s_ptr + r * (2 * ng) + c * 4 + 2 + sub, mask=mk, other=0)
    else:  # per 32
        a_lo = tl.load(s_ptr + r * ng + c * 2, mask=mk, other=0)
        a_hi = tl.load(s_ptr + r * ng + c * 2 + 1, mask=mk, other=0)
    if KIND == 2 or KIND == 4 or KIND == 5 or KIND == 6:  # offsets (K-quants: mins)
        b_lo = tl.load(m_ptr + r * ng + c * 2, mask=mk, other=0)
        b_hi = tl.load(m_ptr + r * ng + c * 2 + 1, mask=mk, other=0)
    if KIND >= 5:  # K-quants: a super-block's d (and dmin)
        dd = tl.load(d_ptr + r * nsup + c // 4, mask=mk, other=0)
        if KIND != 7:
            dmin = tl.load(dm_ptr + r * nsup + c // 4, mask=mk, other=0)
    return a_lo, a_hi, b_lo, b_hi, dd, dmin


@triton.jit
def _scales_of(a_lo, a_hi, b_lo, b_hi, dd, dmin, KIND: tl.constexpr):
    """(s_lo, s_hi, o_lo, o_hi) f32 from ``_scale_loads``' values."""
    if KIND <= 4:  # d (and m) per 32
        s_lo = a_lo.to(tl.float32)
        s_hi = a_hi.to(tl.float32)
        if KIND == 2 or KIND == 4:
            o_lo = b_lo.to(tl.float32)
            o_hi = b_hi.to(tl.float32)
        else:
            unit = -128.0 if KIND == 0 else (-8.0 if KIND == 1 else -16.0)
            o_lo = s_lo * unit
            o_hi = s_hi * unit
    elif KIND == 5 or KIND == 6:  # Q4_K / Q5_K: d * sc, -dmin * m
        d = dd.to(tl.float32)
        dm = dmin.to(tl.float32)
        s_lo = d * a_lo.to(tl.float32)
        s_hi = d * a_hi.to(tl.float32)
        o_lo = -(dm * b_lo.to(tl.float32))
        o_hi = -(dm * b_hi.to(tl.float32))
    else:  # Q6_K: d * sc per 16 weights, offset -32 units
        d = dd.to(tl.float32)
        s_lo = d * a_lo.to(tl.float32)
        s_hi = d * a_hi.to(tl.float32)
        o_lo = s_lo * -32.0
        o_hi = s_hi * -32.0
    return s_lo, s_hi, o_lo, o_hi


@triton.jit
def _weights_tile(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask, c, cmask,
                  nq, ng, nsup, KIND: tl.constexpr):
    """Weights of rows (BN,) x chunks (CH,) as two (BN, CH, 32) f32 halves: weights
    64c + i and 64c + 32 + i."""
    i = tl.arange(0, 32)
    r = rows[:, None, None]
    cc = c[None, :, None]
    ii = i[None, None, :]
    mk = rmask[:, None, None] & cmask[None, :, None]  # (BN, CH, 1)
    if KIND == 0:  # Q8_0: a byte per weight
        base = q_ptr + r * nq + cc * 64 + ii
        u_lo = tl.load(base, mask=mk, other=0).to(tl.int32)
        u_hi = tl.load(base + 32, mask=mk, other=0).to(tl.int32)
    else:
        byte = tl.load(q_ptr + r * nq + cc * 32 + ii, mask=mk, other=0).to(tl.int32)
        u_lo = byte & 15
        u_hi = byte >> 4
    if KIND == 3 or KIND == 4 or KIND == 6:  # a fifth bit, one int32 word per 32 weights
        h_lo = tl.load(qh_ptr + r * ng + cc * 2, mask=mk, other=0)
        h_hi = tl.load(qh_ptr + r * ng + cc * 2 + 1, mask=mk, other=0)
        u_lo = u_lo | (((h_lo >> ii) & 1) << 4)
        u_hi = u_hi | (((h_hi >> ii) & 1) << 4)
    if KIND == 7:  # Q6_K: two more bits, a word per 16 weights
        sh = (ii % 16) * 2
        h_lo = tl.load(qh_ptr + r * (2 * ng) + cc * 4 + ii // 16, mask=mk, other=0)
        h_hi = tl.load(qh_ptr + r * (2 * ng) + cc * 4 + 2 + ii // 16, mask=mk, other=0)
        u_lo = u_lo | (((h_lo >> sh) & 3) << 4)
        u_hi = u_hi | (((h_hi >> sh) & 3) << 4)
    s_lo, s_hi, o_lo, o_hi = _group_scales(s_ptr, m_ptr, d_ptr, dm_ptr, r, cc, ii // 16, mk,
                                            ng, nsup, KIND)
    w_lo = u_lo.to(tl.float32) * s_lo + o_lo
    w_hi = u_hi.to(tl.float32) * s_hi + o_hi
    return w_lo, w_hi


@triton.jit
def _dp4a(a, b, c, INTERP: tl.constexpr, SIGNED: tl.constexpr = False):
    """c + the dot product of a's 4 unsigned bytes (``SIGNED``: signed) with b's 4 signed
    bytes (int32 words): one ``dp4a`` instruction on the GPU, byte arithmetic in the
    interpreter."""
    if INTERP:
        r = c
        for k in tl.static_range(4):
            if SIGNED:
                r += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
            else:
                r += ((a >> (8 * k)) & 0xFF) * ((b << (24 - 8 * k)) >> 24)
        return r
    elif SIGNED:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [a, b, c], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _centred(u, KIND: tl.constexpr):
    """A symmetric type's u bytes (4 a word) less its offset in units (Q8_0 128, Q4_0 8,
    Q5_0 16, Q6_K 32: half of u's range) as signed bytes: the top bit of u's width
    flipped, then copied to the byte's bits above it (no carry leaves a byte)."""
    if KIND == 0:
        return u ^ -2139062144  # 0x80808080
    else:
        bit: tl.constexpr = 8 if KIND == 1 else (16 if KIND == 3 else 32)  # u's top bit
        top: tl.constexpr = bit * 0x01010101
        t = u ^ top
        return t | ((t & top) * (256 // bit - 2))  # (bit * (256 // bit - 2): the bits above)


@triton.jit
def _spread_bits(h, WIDTH: tl.constexpr):
    """The low 4 * WIDTH bits of h (WIDTH per weight, 4 weights) moved to bit 4 of each of
    the 4 bytes of a word: the weights' bits above the fourth, ready to OR into nibbles."""
    if WIDTH == 1:
        return ((h & 1) << 4) | ((h & 2) << 11) | ((h & 4) << 18) | ((h & 8) << 25)
    else:
        return (((h & 3) << 4) | ((h & 0xC) << 10) | ((h & 0x30) << 16)
                | ((h & 0xC0) << 22))


@triton.jit
def _qmv_loads(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask, c0, c_end, nqw, ng,
               nsup, KIND: tl.constexpr, CH: tl.constexpr):
    """The loads of one step of a mat-vec (``_qmv_sums``' weights: chunks c0.., CH of them
    up to c_end, of rows (BN,)) and nothing computed from them: (w_lo, w_hi, h_lo, h_hi,
    a_lo, a_hi, b_lo, b_hi, dd, dmin). A tile of (BN rows, CH chunks, 2 sixteens per half
    chunk, 4 words) of u bytes, the high bits' words, the scales' planes
    (``_scale_loads``); 0 where KIND has none."""
    r = rows.to(tl.int64)[:, None, None, None]
    sub = tl.arange(0, 2)[None, None, :, None]
    jj = tl.arange(0, 4)[None, None, None, :]
    word = sub * 4 + jj  # word of its half chunk (8 words: 32 weights)
    c = c0 + tl.arange(0, CH)
    cmask = c < c_end
    cc = c[None, :, None, None]
    mk = rmask[:, None, None, None] & cmask[None, :, None, None]
    h_lo, h_hi = 0, 0
    if KIND == 0:  # Q8_0: a byte per weight, 16 words a chunk
        w_lo = tl.load(q_ptr + r * nqw + cc * 16 + word, mask=mk, other=0)
        w_hi = tl.load(q_ptr + r * nqw + cc * 16 + 8 + word, mask=mk, other=0)
    else:  # nibbles: byte i of a chunk holds weights i and 32 + i (split by _qmv_sums)
        w_lo = tl.load(q_ptr + r * nqw + cc * 8 + word, mask=mk, other=0)
        w_hi = w_lo
    if KIND == 3 or KIND == 4 or KIND == 6:  # a fifth bit, a word per 32 weights
        h_lo = tl.load(qh_ptr + r * ng + cc * 2, mask=mk, other=0)
        h_hi = tl.load(qh_ptr + r * ng + cc * 2 + 1, mask=mk, other=0)
    if KIND == 7:  # Q6_K: two more bits, a word per 16 weights
        h_lo = tl.load(qh_ptr + r * (2 * ng) + cc * 4 + sub, mask=mk, other=0)
        h_hi = tl.load(qh_ptr + r * (2 * ng) + cc * 4 + 2 + sub, mask=mk, other=0)
    # per-group scales, (BN, CH, 1) or, per sixteen (Q6_K), (BN, CH, 2)
    a_lo, a_hi, b_lo, b_hi, dd, dmin = _scale_loads(
        s_ptr, m_ptr, d_ptr, dm_ptr, rows.to(tl.int64)[:, None, None], c[None, :, None],
        tl.arange(0, 2)[None, None, :], rmask[:, None, None] & cmask[None, :, None], ng,
        nsup, KIND)
    return w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin


@triton.jit
def _qmv_sums(w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin, x0_lo, x0_hi, xd0,
              xq_ptr, xd_ptr, c0, c_end, KW, M: tl.constexpr, MP: tl.constexpr,
              KIND: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr, INTERP: tl.constexpr):
    """x @ W.T's sums over the chunks of one ``_qmv_loads`` step: (BN, MP). Per 16
    weights of a row (a quarter chunk: 4 words of u bytes), integer dot products with
    dp4a; then per group xd * (scale * sum(u q) + offset * sum(q)), or, for the types
    whose offset is a whole number of units (``_centred``), xd * scale * sum((u - units)
    q): no sums of the activations, which are the loop's layout conversions. A single
    token's activations come loaded (x0_lo, x0_hi, xd0: ``_qmv_x``); more tokens' are
    loaded here."""
    sub = tl.arange(0, 2)[None, None, :, None]
    jj = tl.arange(0, 4)[None, None, None, :]
    word = sub * 4 + jj
    if KIND != 0:
        w_lo = w_lo & 0x0F0F0F0F
        w_hi = (w_hi >> 4) & 0x0F0F0F0F
    if KIND == 3 or KIND == 4 or KIND == 6:
        w_lo = w_lo | _spread_bits(h_lo >> (4 * word), 1)
        w_hi = w_hi | _spread_bits(h_hi >> (4 * word), 1)
    if KIND == 7:
        w_lo = w_lo | _spread_bits(h_lo >> (8 * jj), 2)
        w_hi = w_hi | _spread_bits(h_hi >> (8 * jj), 2)
    CENTRED: tl.constexpr = KIND == 0 or KIND == 1 or KIND == 3 or KIND == 7
    if CENTRED:
        w_lo = _centred(w_lo, KIND)
        w_hi = _centred(w_hi, KIND)
    s_lo, s_hi, o_lo, o_hi = _scales_of(a_lo, a_hi, b_lo, b_hi, dd, dmin, KIND)
    zero = tl.zeros((BN, CH, 2, 4), tl.int32)
    mcol = tl.arange(0, MP)
    acc = tl.zeros((BN, MP), dtype=tl.float32)
    for m in tl.static_range(M):
        if M == 1:
            x_lo, x_hi, xd = x0_lo, x0_hi, xd0
        else:
            x_lo, x_hi, xd = _qmv_x(xq_ptr, xd_ptr, m, c0, c_end, KW, CH)
        i_lo = tl.sum(_dp4a(w_lo, tl.broadcast_to(x_lo[None], (BN, CH, 2, 4)), zero,
                            INTERP, CENTRED), axis=3).to(tl.float32)  # (BN, CH, 2)
        i_hi = tl.sum(_dp4a(w_hi, tl.broadcast_to(x_hi[None], (BN, CH, 2, 4)), zero,
                            INTERP, CENTRED), axis=3).to(tl.float32)
        xd_lo, xd_hi = tl.split(xd)
        if CENTRED:
            part = xd_lo[None, :, None] * (s_lo * i_lo) + xd_hi[None, :, None] * (s_hi * i_hi)
        else:
            ones = tl.full((1, CH, 2, 4), 0x01010101, tl.int32)  # dp4a with it: sums of q
            zero_x = tl.zeros((1, CH, 2, 4), tl.int32)
            q_lo = tl.sum(_dp4a(ones, x_lo[None], zero_x, INTERP), axis=3).to(tl.float32)
            q_hi = tl.sum(_dp4a(ones, x_hi[None], zero_x, INTERP), axis=3).to(tl.float32)
            part = (xd_lo[None, :, None] * (s_lo * i_lo + o_lo * q_lo)
                    + xd_hi[None, :, None] * (s_hi * i_hi + o_hi * q_hi))
        part = tl.sum(tl.sum(part, axis=2), axis=1)  # (BN,)
        acc += tl.where(mcol[None, :] == m, part[:, None], 0.0)
    return acc


@triton.jit
def _qmv_x(xq_ptr, xd_ptr, m, c0, c_end, KW, CH: tl.constexpr):
    """Token m's activations over chunks c0.. (CH, up to c_end): words (CH, 2, 4) of each
    chunk's low and high 32 values, and their two scales (CH, 2)."""
    c = c0 + tl.arange(0, CH)
    cmask = c < c_end
    xc = (xq_ptr + m * KW + c[:, None, None] * 16 + tl.arange(0, 2)[None, :, None] * 4
          + tl.arange(0, 4)[None, None, :])  # (CH, 2, 4)
    x_lo = tl.load(xc, mask=cmask[:, None, None], other=0)
    x_hi = tl.load(xc + 8, mask=cmask[:, None, None], other=0)
    xd = tl.load(xd_ptr + m * (KW // 8) + c[:, None] * 2 + tl.arange(0, 2)[None, :],
                 mask=cmask[:, None], other=0.0)
    return x_lo, x_hi, xd


@triton.jit
def _qmv_x1(xq_ptr, xd_ptr, c0, c_end, KW, M: tl.constexpr, CH: tl.constexpr):
    """A lone token's ``_qmv_x`` (decode: loaded with the weights, a step ahead); with more
    tokens 0s (``_qmv_sums`` loads theirs)."""
    if M == 1:
        return _qmv_x(xq_ptr, xd_ptr, 0, c0, c_end, KW, CH)
    else:
        return 0, 0, 0


@triton.jit
def _qmv_rows(xq_ptr, xd_ptr, q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask, c_start,
              c_end, KW, nqw, ng, nsup, M: tl.constexpr, MP: tl.constexpr,
              KIND: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr, INTERP: tl.constexpr,
              PIPELINE: tl.constexpr):
    """x @ W.T's sums over chunks c_start..c_end of rows (BN,): (BN, MP), CH chunks a step.
    PIPELINE: each step's loads (``_qmv_loads``, and ``_qmv_x1``) are issued before the
    step before is summed, so a program waits for memory about once, not once a step (a
    step's reductions synchronize the program's warps, and loads issued after them wait
    for them); the last step's loads past c_end are masked off (no memory is read).
    Else the loads of a step, then its sums (``matvec_pipeline``)."""
    acc = tl.zeros((BN, MP), dtype=tl.float32)
    if PIPELINE:
        w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin = _qmv_loads(
            q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask, c_start, c_end, nqw, ng,
            nsup, KIND, CH)
        x_lo, x_hi, xd = _qmv_x1(xq_ptr, xd_ptr, c_start, c_end, KW, M, CH)
        for c0 in range(c_start, c_end, CH):
            n_w_lo, n_w_hi, n_h_lo, n_h_hi, n_a_lo, n_a_hi, n_b_lo, n_b_hi, n_dd, n_dmin = (
                _qmv_loads(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask, c0 + CH,
                           c_end, nqw, ng, nsup, KIND, CH))
            n_x_lo, n_x_hi, n_xd = _qmv_x1(xq_ptr, xd_ptr, c0 + CH, c_end, KW, M, CH)
            acc += _qmv_sums(w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin, x_lo,
                             x_hi, xd, xq_ptr, xd_ptr, c0, c_end, KW, M, MP, KIND, BN, CH,
                             INTERP)
            w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin = (
                n_w_lo, n_w_hi, n_h_lo, n_h_hi, n_a_lo, n_a_hi, n_b_lo, n_b_hi, n_dd, n_dmin)
            x_lo, x_hi, xd = n_x_lo, n_x_hi, n_xd
    else:
        for c0 in range(c_start, c_end, CH):
            w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin = _qmv_loads(
                q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask, c0, c_end, nqw, ng,
                nsup, KIND, CH)
            x_lo, x_hi, xd = _qmv_x1(xq_ptr, xd_ptr, c0, c_end, KW, M, CH)
            acc += _qmv_sums(w_lo, w_hi, h_lo, h_hi, a_lo, a_hi, b_lo, b_hi, dd, dmin, x_lo,
                             x_hi, xd, xq_ptr, xd_ptr, c0, c_end, KW, M, MP, KIND, BN, CH,
                             INTERP)
    return acc


@triton.jit
def _prefetch_l2(addr, ok):
    """Ask L2 for the 128-byte line at each address where ok (``prefetch.global.L2``): no
    register waits for it, and the result is a dummy."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_span(ptr, rows, rmask, stride, e0, e1):
    """Elements e0..e1 of each of rows (BN,) (stride elements apart) of ptr into L2, a line
    per element of (BN, 8) tiles; the last address of each row's span is e1 - 1 (clamped:
    a span that starts mid-line ends in one more line)."""
    EPL: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth  # per 128 bytes
    k = tl.arange(0, 8) * EPL
    base = ptr + rows.to(tl.int64)[:, None] * stride
    for l0 in range(e0, e1, 8 * EPL):
        at = l0 + k
        ok = rmask[:, None] & (at < e1 + EPL - 1)[None, :]
        _prefetch_l2(base + tl.minimum(at, e1 - 1)[None, :], ok)


@triton.jit
def _prefetch_weights(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask, c0, c1, nqw,
                      ng, nsup, KIND: tl.constexpr):
    """Chunks c0..c1 of rows (BN,) of every plane a mat-vec reads (``_qmv_loads``'
    indexing) into L2: issued before ``_await_inputs`` (PDL 2), while the launch before
    still runs, the weights (which no launch writes) are on their way."""
    _prefetch_span(q_ptr, rows, rmask, nqw, c0 * (16 if KIND == 0 else 8),
                   c1 * (16 if KIND == 0 else 8))
    if KIND == 7:
        _prefetch_span(qh_ptr, rows, rmask, 2 * ng, c0 * 4, c1 * 4)
        _prefetch_span(s_ptr, rows, rmask, 2 * ng, c0 * 4, c1 * 4)
    else:
        if KIND == 3 or KIND == 4 or KIND == 6:
            _prefetch_span(qh_ptr, rows, rmask, ng, c0 * 2, c1 * 2)
        _prefetch_span(s_ptr, rows, rmask, ng, c0 * 2, c1 * 2)
        if KIND == 2 or KIND == 4 or KIND == 5 or KIND == 6:
            _prefetch_span(m_ptr, rows, rmask, ng, c0 * 2, c1 * 2)
    if KIND >= 5:
        _prefetch_span(d_ptr, rows, rmask, nsup, c0 // 4, tl.cdiv(c1, 4))
        if KIND != 7:
            _prefetch_span(dm_ptr, rows, rmask, nsup, c0 // 4, tl.cdiv(c1, 4))


@triton.jit
def _rope_order(t, n_rot, HALF: tl.constexpr, ROPE: tl.constexpr):
    """The rows that a mat-vec's tile positions t (BN,) take where its epilogue rotates the
    first n_rot rows (heads of 2 HALF rows: Q's and K's) as RoPE pairs (``_rotated``):
    positions 2i and 2i + 1 take a pair, a head's rows j and j + HALF (ROPE 1: NEOX) or 2j
    and 2j + 1 (ROPE 2: the rows as they are); past n_rot, and without ROPE, the rows as
    they are."""
    if ROPE == 1:
        pair = t // 2
        rows = (pair // HALF) * (2 * HALF) + pair % HALF + (t % 2) * HALF
        return tl.where(t < n_rot, rows, t)
    else:
        return t


@triton.jit
def _pair_angles(cos_ptr, sin_ptr, rows, n_rot, M, HALF: tl.constexpr, ROPE: tl.constexpr,
                 BN: tl.constexpr, MP: tl.constexpr):
    """cos and sin (BN / 2, MP) of the pair at each two positions of ``rows`` (as
    ``_rope_order`` gives them) for each token: its angle of cos/sin (M, HALF) (1 and 0
    past n_rot)."""
    first, _ = tl.split(tl.reshape(rows, (BN // 2, 2)))  # (BN / 2,) each pair's first row
    j = first % (2 * HALF)
    if ROPE == 2:
        j = j // 2
    m = tl.arange(0, MP)
    at = m[None, :] * HALF + j[:, None]
    ok = (first < n_rot)[:, None] & (m < M)[None, :]
    return (tl.load(cos_ptr + at, mask=ok, other=1.0),
            tl.load(sin_ptr + at, mask=ok, other=0.0))


@triton.jit
def _rotated(acc, rows, n_rot, cos, sin, BN: tl.constexpr, MP: tl.constexpr):
    """acc (BN, MP) with its rows in RoPE pairs at positions 2i, 2i + 1 (``_rope_order``):
    each pair (a, b) of rows below n_rot rotated (``_rotate``) by ``_pair_angles``' cos and
    sin (BN / 2, MP); the rest as it is."""
    a, b = tl.split(tl.permute(tl.reshape(acc, (BN // 2, 2, MP)), (0, 2, 1)))
    first, _ = tl.split(tl.reshape(rows, (BN // 2, 2)))
    turn = (first < n_rot)[:, None]
    a_turned, b_turned = _rotate(a, b, cos, sin)
    a2 = tl.where(turn, a_turned, a)
    b2 = tl.where(turn, b_turned, b)
    return tl.reshape(tl.permute(tl.join(a2, b2), (0, 2, 1)), (BN, MP))


@triton.jit
def _qmv_kernel(xq_ptr, xd_ptr, out_ptr, part_ptr, count_ptr, bias_ptr, q_ptr, qh_ptr, s_ptr,
                m_ptr, d_ptr, dm_ptr, cos_ptr, sin_ptr, N, KW, nqw, ng, nsup, n_chunks, cps,
                n_splits, n_rot, M: tl.constexpr, MP: tl.constexpr, KIND: tl.constexpr,
                BN: tl.constexpr, CH: tl.constexpr, HAS_BIAS: tl.constexpr,
                SPLIT_K: tl.constexpr, SPLITS: tl.constexpr, ROPE: tl.constexpr,
                HALF: tl.constexpr, LOOP: tl.constexpr, INTERP: tl.constexpr,
                PIPELINE: tl.constexpr, PDL: tl.constexpr):
    """out (M, N) = x @ W.T with x as int8 blocks: xq (M, KW) int32 words of 4 int8 values,
    xd (M, KW / 8) f32 the scale of each 32 values, CH chunks a step (``_qmv_rows``).
    Program (i, j) takes rows i * BN.. and chunks j * cps.. (a
    split of K when rows alone give too few programs): its partial sums go to part[j], and
    the last split of a row block to finish (a counter per block) adds them up in split
    order, so the result does not depend on which finished first (SPLITS: a power of two
    of at least n_splits, the combine's unrolled loads). ROPE (unsplit; 1: NEOX, 2: adjacent
    pairs): the first n_rot rows, Q's and K's heads of 2 HALF, rotated by the angles of
    cos/sin (M, HALF) (as ``rope_qk`` rotates them, the bias added first), each program
    taking whole pairs (``_rope_order``). LOOP (unsplit, fewer programs than row blocks):
    program i takes row blocks i, i + programs, ..., asking L2 for the next one's weights
    before it sums one (``_qmv_block``)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    c_end = tl.minimum(split * cps + cps, n_chunks)
    if PDL == 2:
        _prefetch_block(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, pid, N, split * cps,
                        c_end, nqw, ng, nsup, n_rot, KIND, BN, ROPE, HALF)
    _await_inputs(PDL)
    if LOOP:
        programs = tl.num_programs(0)
        for blk in range(pid, tl.cdiv(N, BN), programs):
            if not INTERP:  # (an L2 hint: no interpreter stand-in)
                _prefetch_block(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, blk + programs, N,
                                0, n_chunks, nqw, ng, nsup, n_rot, KIND, BN, ROPE, HALF)
            _qmv_block(blk, 0, xq_ptr, xd_ptr, out_ptr, part_ptr, count_ptr, bias_ptr, q_ptr,
                       qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cos_ptr, sin_ptr, N, KW, nqw, ng,
                       nsup, 0, n_chunks, n_splits, n_rot, M, MP, KIND, BN, CH, HAS_BIAS,
                       False, SPLITS, ROPE, HALF, INTERP, PIPELINE)
    else:
        _qmv_block(pid, split, xq_ptr, xd_ptr, out_ptr, part_ptr, count_ptr, bias_ptr, q_ptr,
                   qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cos_ptr, sin_ptr, N, KW, nqw, ng, nsup,
                   split * cps, c_end, n_splits, n_rot, M, MP, KIND, BN, CH, HAS_BIAS,
                   SPLIT_K, SPLITS, ROPE, HALF, INTERP, PIPELINE)


@triton.jit
def _block_rows(blk, N, n_rot, BN: tl.constexpr, ROPE: tl.constexpr, HALF: tl.constexpr):
    """Row block blk's rows (BN,) in the order its sums are kept (``_rope_order``), and
    which of them are rows of the matrix."""
    t = blk * BN + tl.arange(0, BN)  # (BN,) the tile's positions
    return _rope_order(t, n_rot, HALF, ROPE), t < N


@triton.jit
def _prefetch_block(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, blk, N, c0, c1, nqw, ng, nsup,
                    n_rot, KIND: tl.constexpr, BN: tl.constexpr, ROPE: tl.constexpr,
                    HALF: tl.constexpr):
    """Row block blk's weights, chunks c0..c1, into L2 (``_prefetch_weights``; nothing for
    a block past the last)."""
    rows, rmask = _block_rows(blk, N, n_rot, BN, ROPE, HALF)
    _prefetch_weights(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask, c0, c1, nqw,
                      ng, nsup, KIND)


@triton.jit
def _qmv_block(blk, split, xq_ptr, xd_ptr, out_ptr, part_ptr, count_ptr, bias_ptr, q_ptr,
               qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, cos_ptr, sin_ptr, N, KW, nqw, ng, nsup,
               c_start, c_end, n_splits, n_rot, M: tl.constexpr, MP: tl.constexpr,
               KIND: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr,
               HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SPLITS: tl.constexpr,
               ROPE: tl.constexpr, HALF: tl.constexpr, INTERP: tl.constexpr,
               PIPELINE: tl.constexpr):
    """``_qmv_kernel``'s work on row block blk, chunks c_start..c_end (its split)."""
    rows, rmask = _block_rows(blk, N, n_rot, BN, ROPE, HALF)
    if HAS_BIAS:  # (loaded before the loop: after its sums' reductions, a wait of its own)
        bias = tl.load(bias_ptr + rows, mask=rmask, other=0.0)
    if ROPE:  # (the angles too)
        cos, sin = _pair_angles(cos_ptr, sin_ptr, rows, n_rot, M, HALF, ROPE, BN, MP)
    acc = _qmv_rows(xq_ptr, xd_ptr, q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask,
                    c_start, c_end, KW, nqw, ng, nsup, M, MP, KIND, BN, CH, INTERP, PIPELINE)
    mcol = tl.arange(0, MP)
    if HAS_BIAS:
        acc += tl.where(split == 0, bias, 0.0)[:, None]  # once, by the first split
    if ROPE:
        acc = _rotated(acc, rows, n_rot, cos, sin, BN, MP)
    omask = rmask[:, None] & (mcol[None, :] < M)
    at = mcol[None, :] * N + rows[:, None]  # (BN, MP) in the (M, N) output
    if SPLIT_K:
        tl.store(part_ptr + split * (M * N) + at, acc, mask=omask)
        tl.debug_barrier()  # every thread's partial written before the count is released
        finished = tl.atomic_add(count_ptr + blk, 1)  # acq_rel: sees the others' partials
        if finished == n_splits - 1:
            total = tl.zeros((BN, MP), dtype=tl.float32)
            # (unrolled: every split's partials load at once, not a few at a time as a
            # loop's; added in split order, then the exact zeros of those past the last)
            for j in tl.static_range(SPLITS):
                live = omask & (tl.zeros_like(at) + j < n_splits)  # (BN, MP)
                total += tl.load(part_ptr + j * (M * N) + at, mask=live, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + at, total, mask=omask)
            tl.atomic_xchg(count_ptr + blk, 0)  # ready for the next launch
    else:
        tl.store(out_ptr + at, acc, mask=omask)


@triton.jit
def _qmv_joined_kernel(xq_ptr, xd_ptr, out_ptr, bias_ptr, qa_ptr, qha_ptr, sa_ptr, ma_ptr,
                       da_ptr, dma_ptr, qb_ptr, qhb_ptr, sb_ptr, mb_ptr, db_ptr, dmb_ptr,
                       cos_ptr, sin_ptr, NA, NB, KW, nqwa, nga, nsupa, nqwb, ngb, nsupb,
                       n_chunks, n_rot, M: tl.constexpr, MP: tl.constexpr,
                       KIND_A: tl.constexpr, KIND_B: tl.constexpr, BN: tl.constexpr,
                       CH: tl.constexpr, HAS_BIAS: tl.constexpr, ROPE: tl.constexpr,
                       HALF: tl.constexpr, INTERP: tl.constexpr, PIPELINE: tl.constexpr,
                       PDL: tl.constexpr):
    """out (M, NA + NB) = x @ [A; B].T for two matrices of one width but different block
    types (Qwen's Q+K in Q4_K and V in Q6_K) in one launch: programs 0.. take A's row
    blocks as ``_qmv_kernel`` does (unsplit), the rest B's, whose rows go to out's columns
    NA..; each row's sums are those of its own matrix's mat-vec in this tile. ROPE: A's
    first n_rot rows rotated as ``_qmv_kernel`` rotates them."""
    pid = tl.program_id(0)
    blocks_a = tl.cdiv(NA, BN)
    in_a = pid < blocks_a
    t = tl.where(in_a, pid, pid - blocks_a) * BN + tl.arange(0, BN)  # (BN,) positions
    n_rot = tl.where(in_a, n_rot, 0)  # (none of B's rows)
    local = _rope_order(t, n_rot, HALF, ROPE)  # (BN,) its own matrix's rows
    rmask = t < tl.where(in_a, NA, NB)
    if PDL == 2:
        if in_a:
            _prefetch_weights(qa_ptr, qha_ptr, sa_ptr, ma_ptr, da_ptr, dma_ptr, local, rmask,
                              0, n_chunks, nqwa, nga, nsupa, KIND_A)
        else:
            _prefetch_weights(qb_ptr, qhb_ptr, sb_ptr, mb_ptr, db_ptr, dmb_ptr, local, rmask,
                              0, n_chunks, nqwb, ngb, nsupb, KIND_B)
    _await_inputs(PDL)
    rows = local + tl.where(in_a, 0, NA)  # (BN,) out's columns
    if HAS_BIAS:  # (loaded before the loop, as _qmv_kernel's)
        bias = tl.load(bias_ptr + rows, mask=rmask, other=0.0)
    if ROPE:
        cos, sin = _pair_angles(cos_ptr, sin_ptr, local, n_rot, M, HALF, ROPE, BN, MP)
    if in_a:
        acc = _qmv_rows(xq_ptr, xd_ptr, qa_ptr, qha_ptr, sa_ptr, ma_ptr, da_ptr, dma_ptr,
                        local, rmask, 0, n_chunks, KW, nqwa, nga, nsupa, M, MP, KIND_A, BN,
                        CH, INTERP, PIPELINE)
    else:
        acc = _qmv_rows(xq_ptr, xd_ptr, qb_ptr, qhb_ptr, sb_ptr, mb_ptr, db_ptr, dmb_ptr,
                        local, rmask, 0, n_chunks, KW, nqwb, ngb, nsupb, M, MP, KIND_B, BN,
                        CH, INTERP, PIPELINE)
    if HAS_BIAS:
        acc += bias[:, None]
    if ROPE:
        acc = _rotated(acc, local, n_rot, cos, sin, BN, MP)
    mcol = tl.arange(0, MP)
    omask = rmask[:, None] & (mcol[None, :] < M)
    tl.store(out_ptr + mcol[None, :] * (NA + NB) + rows[:, None], acc, mask=omask)


@triton.jit
def _qmv_glu_kernel(xq_ptr, xd_ptr, out_ptr, count_ptr, q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr,
                    dm_ptr, F, KW, nqw, ng, nsup, n_chunks, KP, q32_ptr, d32_ptr, q256_ptr,
                    d256_ptr, M: tl.constexpr, MP: tl.constexpr, KIND: tl.constexpr,
                    BN: tl.constexpr, CH: tl.constexpr, GELU: tl.constexpr,
                    K256: tl.constexpr, LOOP: tl.constexpr, INTERP: tl.constexpr,
                    PIPELINE: tl.constexpr, PDL: tl.constexpr):
    """out (M, F) = act(x @ G.T) * (x @ U.T) for gate and up stacked as one matrix (rows
    0..F and F..2F), and out's 8-bit blocks for the down projection: the mat-vec, the GLU
    and its quantization (``then_quantize``'s) in one launch. A program takes gate rows
    i * BN.. and the same up rows, all of K, as one tile of 2 BN rows (gate row j, up row
    j, ...: one load a step for both, ``_qmv_rows``); the last program of each 256 outputs
    to finish (a counter each, as the split-K mat-vec) quantizes them. LOOP (fewer
    programs than row blocks): program i takes blocks i, i + programs, ..., asking L2 for
    the next one's weights before it sums one."""
    pid = tl.program_id(0)
    if PDL == 2:
        _prefetch_glu_block(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, pid, F, n_chunks, nqw,
                            ng, nsup, KIND, BN)
    _await_inputs(PDL)
    if LOOP:
        programs = tl.num_programs(0)
        for blk in range(pid, tl.cdiv(F, BN), programs):
            if not INTERP:  # (an L2 hint: no interpreter stand-in)
                _prefetch_glu_block(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, blk + programs,
                                    F, n_chunks, nqw, ng, nsup, KIND, BN)
            _qmv_glu_block(blk, xq_ptr, xd_ptr, out_ptr, count_ptr, q_ptr, qh_ptr, s_ptr,
                           m_ptr, d_ptr, dm_ptr, F, KW, nqw, ng, nsup, n_chunks, KP, q32_ptr,
                           d32_ptr, q256_ptr, d256_ptr, M, MP, KIND, BN, CH, GELU, K256,
                           INTERP, PIPELINE)
    else:
        _qmv_glu_block(pid, xq_ptr, xd_ptr, out_ptr, count_ptr, q_ptr, qh_ptr, s_ptr, m_ptr,
                       d_ptr, dm_ptr, F, KW, nqw, ng, nsup, n_chunks, KP, q32_ptr, d32_ptr,
                       q256_ptr, d256_ptr, M, MP, KIND, BN, CH, GELU, K256, INTERP, PIPELINE)


@triton.jit
def _glu_block_rows(blk, F, BN: tl.constexpr):
    """GLU row block blk's rows of the stacked gate+up matrix (2 BN,) (gate row j, up row
    j, ...) and which of them are rows of it."""
    pair = tl.arange(0, 2 * BN)
    both = blk * BN + pair // 2 + (pair % 2) * F
    return both, blk * BN + pair // 2 < F


@triton.jit
def _prefetch_glu_block(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, blk, F, n_chunks, nqw, ng,
                        nsup, KIND: tl.constexpr, BN: tl.constexpr):
    """GLU row block blk's gate and up weights into L2 (nothing for a block past the
    last)."""
    both, bmask = _glu_block_rows(blk, F, BN)
    _prefetch_weights(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, both, bmask, 0, n_chunks,
                      nqw, ng, nsup, KIND)


@triton.jit
def _qmv_glu_block(blk, xq_ptr, xd_ptr, out_ptr, count_ptr, q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr,
                   dm_ptr, F, KW, nqw, ng, nsup, n_chunks, KP, q32_ptr, d32_ptr, q256_ptr,
                   d256_ptr, M: tl.constexpr, MP: tl.constexpr, KIND: tl.constexpr,
                   BN: tl.constexpr, CH: tl.constexpr, GELU: tl.constexpr,
                   K256: tl.constexpr, INTERP: tl.constexpr, PIPELINE: tl.constexpr):
    """``_qmv_glu_kernel``'s work on row block blk."""
    rows = blk * BN + tl.arange(0, BN)
    rmask = rows < F
    both, bmask = _glu_block_rows(blk, F, BN)
    sums = _qmv_rows(xq_ptr, xd_ptr, q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, both, bmask,
                     0, n_chunks, KW, nqw, ng, nsup, M, MP, KIND, 2 * BN, CH, INTERP,
                     PIPELINE)
    # (2 BN, MP) -> gate (BN, MP), up (BN, MP)
    gate, up = tl.split(tl.permute(tl.reshape(sums, (BN, 2, MP)), (0, 2, 1)))
    mcol = tl.arange(0, MP)
    at = mcol[None, :].to(tl.int64) * F + rows[:, None]  # (BN, MP) in the (M, F) output
    tl.store(out_ptr + at, _glu_act(gate, GELU) * up, mask=rmask[:, None] & (mcol < M)[None, :])
    block = blk * BN // 256  # the 256 outputs this block's rows are in
    j0 = block * 256
    tl.debug_barrier()  # every thread's outputs written before the count is released
    if tl.atomic_add(count_ptr + block, 1) == tl.cdiv(tl.minimum(F - j0, 256), BN) - 1:
        for m in tl.static_range(M):  # acq_rel: the others' outputs are seen
            _chunk_q8_blocks(out_ptr, m, j0, F, KP, q32_ptr, d32_ptr, q256_ptr, d256_ptr,
                             K256)
        tl.atomic_xchg(count_ptr + block, 0)  # ready for the next launch


@triton.jit
def _block_q8(x, j, BLOCK: tl.constexpr, K_QUANT: tl.constexpr):
    """Blocks of activations x (R, BLOCK), a block a row, as llama.cpp's CPU rounds them:
    (q (R, BLOCK) as f32 integers, d (R,)); j is arange(BLOCK) as (1, BLOCK). Q8_K (per
    256): iscale = -127/peak (the first largest |x|, signed), q = min(127, rint(x * iscale)),
    d = 1/iscale; x86 Q8_0 (per 32): q = rint(x * 127/amax), d = f16(amax/127)."""
    ax = tl.abs(x)
    amax = tl.max(ax, axis=1)  # (R,)
    if K_QUANT:
        first = tl.min(tl.where(ax == amax[:, None], j, BLOCK), axis=1)  # the peak's index
        peak = tl.sum(tl.where(j == first[:, None], x, 0.0), axis=1)
        safe = tl.where(peak == 0.0, 1.0, peak)
        iscale = tl.math.div_rn(-127.0, safe)
        q = tl.minimum(((x * iscale[:, None]) + _MAGIC) - _MAGIC, 127.0)
        d = tl.where(peak == 0.0, 0.0, tl.math.div_rn(1.0, iscale))
    else:
        safe = tl.where(amax == 0.0, 1.0, amax)
        q = ((x * tl.math.div_rn(127.0, safe)[:, None]) + _MAGIC) - _MAGIC
        d = tl.where(amax == 0.0, 0.0, tl.math.div_rn(safe, 127.0))
        d = d.to(tl.float16).to(tl.float32)
    return q, d


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, d_ptr, K, KP, BLOCK: tl.constexpr, K_QUANT: tl.constexpr,
                     PDL: tl.constexpr):
    """One block of one row of x (n, K) f32 as int8 q (n, KP) and its scale, repeated per
    32 values in d (n, KP / 32): the numbers _round_kernel rounds to (q * d), kept apart
    for integer dot products. Blocks past K (the weights' padding to 64) are zeros."""
    _await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    j = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK): one block
    ok = blk * BLOCK + j < K
    x = tl.load(x_ptr + row * K + blk * BLOCK + j, mask=ok, other=0.0)
    q, d = _block_q8(x, j, BLOCK, K_QUANT)
    tl.store(q_ptr + row * KP + blk * BLOCK + j, q.to(tl.int8), mask=blk * BLOCK + j < KP)
    g = blk * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
    tl.store(d_ptr + row * (KP // 32) + g, tl.zeros_like(g.to(tl.float32)) + tl.sum(d, axis=0),
             mask=g < KP // 32)


@triton.jit
def _then_q8_kernel(a_ptr, b_ptr, out_ptr, q32_ptr, d32_ptr, q256_ptr, d256_ptr, K, KP, eps,
                    OP: tl.constexpr, ROW: tl.constexpr, K256: tl.constexpr, PDL: tl.constexpr):
    """A row op (OP 0: RMS norm of a times weights b; 1: silu(a) * b; 2: gelu_tanh(a) * b)
    over 256 values of a row, written to out as rms_norm/glu write it, and the same values
    as 8-bit blocks for the mat-vec that follows, both ways quantize_activations makes them:
    per 32 (q32 (n, KP) int8, d32 (n, KP / 32)) and, when K is a multiple of 256, per 256
    (q256, d256). One launch instead of two (a program per row and 256 values)."""
    _await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * 256 + tl.arange(0, 256)
    ok = j < K
    a = tl.load(a_ptr + row * K + j, mask=ok, other=0.0)
    if OP == 0:  # the mean square over the whole row, as _rms_norm_kernel sums it
        jr = tl.arange(0, ROW)
        xr = tl.load(a_ptr + row * K + jr, mask=jr < K, other=0.0)
        ms = tl.sum(xr * xr, axis=0) / K
        w = tl.load(b_ptr + j, mask=ok, other=0.0)
        y = a / tl.sqrt_rn(ms + eps) * w
    else:
        u = tl.load(b_ptr + row * K + j, mask=ok, other=0.0)
        y = _glu_act(a, OP == 2) * u
    tl.store(out_ptr + row * K + j, y, mask=ok)
    _store_q8_blocks(y, row, tl.program_id(1) * 256, KP, q32_ptr, d32_ptr, q256_ptr, d256_ptr,
                     K256)


@triton.jit
def _store_q8_blocks(y, row, j0, KP, q32_ptr, d32_ptr, q256_ptr, d256_ptr,
                     K256: tl.constexpr):
    """The 256 values y at columns j0.. (j0 a multiple of 256) of a row as a mat-vec's 8-bit
    blocks, both ways quantize_activations makes them: per 32 (q32 (n, KP) int8, d32 (n, KP /
    32)) and (K256) per 256, Q8_K (q256, d256: its scale in each of its 8 slots)."""
    j = j0 + tl.arange(0, 256)
    inside = j < KP
    q32, d32 = _block_q8(tl.reshape(y, (8, 32)), tl.arange(0, 32)[None, :], 32, False)
    tl.store(q32_ptr + row * KP + j, tl.reshape(q32, (256,)).to(tl.int8), mask=inside)
    g = j0 // 32 + tl.arange(0, 8)  # d32's slots: the blocks of 32
    tl.store(d32_ptr + row * (KP // 32) + g, d32, mask=g < KP // 32)
    if K256:  # Q8_K per 256
        q, d = _block_q8(tl.reshape(y, (1, 256)), tl.arange(0, 256)[None, :], 256, True)
        tl.store(q256_ptr + row * KP + j, tl.reshape(q, (256,)).to(tl.int8), mask=inside)
        tl.store(d256_ptr + row * (KP // 32) + g,
                 tl.zeros_like(g.to(tl.float32)) + tl.sum(d, axis=0), mask=g < KP // 32)


@triton.jit
def _dequant_kernel(out_ptr, ids_ptr, q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr,
                    N, K, nq, ng, nsup, n_chunks,
                    KIND: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr,
                    GATHER: tl.constexpr, PDL: tl.constexpr):
    _await_inputs(PDL)
    pid_n = tl.program_id(0)
    pid_c = tl.program_id(1)
    out_rows = pid_n * BN + tl.arange(0, BN)
    rmask = out_rows < N
    if GATHER:  # embedding lookups: row ids from a tensor
        rows = tl.load(ids_ptr + out_rows, mask=rmask, other=0).to(tl.int64)
    else:
        rows = out_rows.to(tl.int64)
    c = pid_c * CH + tl.arange(0, CH)
    cmask = c < n_chunks
    w_lo, w_hi = _weights_tile(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows, rmask, c,
                               cmask, nq, ng, nsup, KIND)
    k = c[None, :, None] * 64 + tl.arange(0, 32)[None, None, :]
    ptr = out_ptr + out_rows.to(tl.int64)[:, None, None] * K + k
    ok = rmask[:, None, None] & cmask[None, :, None]
    tl.store(ptr, w_lo.to(out_ptr.dtype.element_ty), mask=ok & (k < K))
    tl.store(ptr + 32, w_hi.to(out_ptr.dtype.element_ty), mask=ok & (k + 32 < K))


@triton.jit
def _dq_gemm_kernel(x_ptr, out_ptr, bias_ptr, q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr,
                    M, N, K, nq, ng, nsup, n_chunks,
                    KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    CH: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """out (M, N) f32 = x (M, K) f16 @ W.T (+ bias), W's tiles dequantized to f16 in
    registers (no dequantized copy of W in memory, one launch). A sum over k may take k in
    any order: each step multiplies the chunks' low 32 weights with the activations at
    64c + i, then the high 32 with those at 64c + 32 + i, each as one (BM, CH * 32) x
    (CH * 32, BN) dot; x is zero past K, which cancels the pad weights."""
    _await_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    rows = pid_n * BN + tl.arange(0, BN)
    mmask = m < M
    nmask = rows < N
    i = tl.arange(0, 32)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for c0 in range(0, n_chunks, CH):
        c = c0 + tl.arange(0, CH)
        cmask = c < n_chunks
        w_lo, w_hi = _weights_tile(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr,
                                   rows.to(tl.int64), nmask, c, cmask, nq, ng, nsup, KIND)
        k = c[None, :, None] * 64 + i[None, None, :]  # (1, CH, 32): the low halves' k
        ptr = x_ptr + m.to(tl.int64)[:, None, None] * K + k
        ok = mmask[:, None, None] & cmask[None, :, None]
        x_lo = tl.load(ptr, mask=ok & (k < K), other=0.0)  # (BM, CH, 32)
        x_hi = tl.load(ptr + 32, mask=ok & (k + 32 < K), other=0.0)
        acc = tl.dot(tl.reshape(x_lo, (BM, CH * 32)),
                     tl.trans(tl.reshape(w_lo.to(tl.float16), (BN, CH * 32))), acc)
        acc = tl.dot(tl.reshape(x_hi, (BM, CH * 32)),
                     tl.trans(tl.reshape(w_hi.to(tl.float16), (BN, CH * 32))), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=nmask, other=0.0)[None, :]
    out = out_ptr + m.to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out, acc, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, K, BLOCK: tl.constexpr, K_QUANT: tl.constexpr,
                  ROWS: tl.constexpr, PDL: tl.constexpr):
    """One block of ROWS rows of x (n, K) rounded (``_block_q8``): q * d in f32, stored in
    out's dtype."""
    _await_inputs(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # (ROWS, 1)
    blk = tl.program_id(1)
    j = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK): one block
    at = rows * K + blk * BLOCK + j  # (ROWS, BLOCK)
    ok = rows < n  # (ROWS, 1)
    x = tl.load(x_ptr + at, mask=ok, other=0.0)
    q, d = _block_q8(x, j, BLOCK, K_QUANT)
    tl.store(out_ptr + at, (q * d[:, None]).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    _await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ok = j < D
    x = tl.load(x_ptr + row * D + j, mask=ok, other=0.0)
    ms = tl.sum(x * x, axis=0) / D
    w = tl.load(w_ptr + j, mask=ok, other=0.0)
    tl.store(out_ptr + row * D + j, x / tl.sqrt_rn(ms + eps) * w, mask=ok)


@triton.jit
def _rope_pairs(HALF: tl.constexpr, NEOX: tl.constexpr):
    """The element indices (ia, ib) of a head's rotated pairs: its halves (NEOX) or adjacent
    elements (ggml's NORM mode)."""
    p = tl.arange(0, HALF)
    if NEOX:
        ia = p
        ib = p + HALF
    else:
        ia = 2 * p
        ib = 2 * p + 1
    return ia, ib


@triton.jit
def _rotate(a, b, cos, sin):
    """RoPE's rotation of the pairs (a, b) by their angles: (a cos - b sin, a sin + b cos)
    (every kernel that rotates: the same arithmetic, so the same bits)."""
    return a * cos - b * sin, a * sin + b * cos


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, HD: tl.constexpr, HALF: tl.constexpr,
                 NEOX: tl.constexpr, PDL: tl.constexpr):
    """x (n, H, HD) rotated by the angles of its token: cos/sin (n, HD/2)."""
    _await_inputs(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + tok * HALF + p)
    sin = tl.load(sin_ptr + tok * HALF + p)
    base = (tok * H + head) * HD
    ia, ib = _rope_pairs(HALF, NEOX)
    a = tl.load(x_ptr + base + ia)
    b = tl.load(x_ptr + base + ib)
    a, b = _rotate(a, b, cos, sin)
    tl.store(out_ptr + base + ia, a)
    tl.store(out_ptr + base + ib, b)


@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, H, KVH,
                    eps, HD: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr,
                    NORM: tl.constexpr, PDL: tl.constexpr):
    """One head of q (n, H, HD) or k (n, KVH, HD) (programs (n, H + KVH)): RMS-normalised
    by its weights first (NORM: as _rms_norm_kernel over the head), then rotated as
    _rope_kernel rotates it; the same arithmetic, so the same bits as the two launches."""
    _await_inputs(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < H:
        src = q_ptr + (tok * H + head) * HD
        dst = qo_ptr + (tok * H + head) * HD
        w_ptr = qw_ptr
    else:
        src = k_ptr + (tok * KVH + head - H) * HD
        dst = ko_ptr + (tok * KVH + head - H) * HD
        w_ptr = kw_ptr
    p = tl.arange(0, HALF)
    ia, ib = _rope_pairs(HALF, NEOX)
    # (every load before the norm's reduction, which the loads after it would wait behind)
    a = tl.load(src + ia)
    b = tl.load(src + ib)
    cos = tl.load(cos_ptr + tok * HALF + p)
    sin = tl.load(sin_ptr + tok * HALF + p)
    if NORM:
        x = tl.load(src + tl.arange(0, HD))
        wa, wb = tl.load(w_ptr + ia), tl.load(w_ptr + ib)
        r = tl.sqrt_rn(tl.sum(x * x, axis=0) / HD + eps)
        a = a / r * wa
        b = b / r * wb
    a, b = _rotate(a, b, cos, sin)
    tl.store(dst + ia, a)
    tl.store(dst + ib, b)


@triton.jit
def _residual_kernel(x_ptr, h_ptr, hw_ptr, w_ptr, sum_ptr, out_ptr, q32_ptr, d32_ptr,
                     q256_ptr, d256_ptr, K, KP, eps, POST: tl.constexpr, NORM: tl.constexpr,
                     QUANT: tl.constexpr, ROW: tl.constexpr, K256: tl.constexpr,
                     PDL: tl.constexpr):
    """x + h (h RMS-normalised by hw first: POST) over 256 values of a row, and (NORM) the
    sum RMS-normalised by w, and (QUANT) its 8-bit blocks as _then_q8_kernel writes them.
    Each mean square is summed over the whole row as _rms_norm_kernel sums it (same bits as
    the separate launches)."""
    _await_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * 256 + tl.arange(0, 256)
    ok = j < K
    jr = tl.arange(0, ROW)
    okr = jr < K
    # (every load first: one placed after a reduction, or after the sum's store, which
    # the compiler keeps loads of x behind, not knowing the two apart, waits for memory a
    # second time)
    x = tl.load(x_ptr + row * K + j, mask=ok, other=0.0)
    h = tl.load(h_ptr + row * K + j, mask=ok, other=0.0)
    if POST or NORM:
        hr = tl.load(h_ptr + row * K + jr, mask=okr, other=0.0)
    if POST:
        hw = tl.load(hw_ptr + j, mask=ok, other=0.0)
        if NORM:
            hwr = tl.load(hw_ptr + jr, mask=okr, other=0.0)
    if NORM:
        xr = tl.load(x_ptr + row * K + jr, mask=okr, other=0.0)
        w = tl.load(w_ptr + j, mask=ok, other=0.0)
    if POST:
        rh = tl.sqrt_rn(tl.sum(hr * hr, axis=0) / K + eps)
        h = h / rh * hw
    s = x + h
    tl.store(sum_ptr + row * K + j, s, mask=ok)
    if NORM:
        if POST:
            hr = hr / rh * hwr
        sr = xr + hr
        y = s / tl.sqrt_rn(tl.sum(sr * sr, axis=0) / K + eps) * w
        tl.store(out_ptr + row * K + j, y, mask=ok)
        if QUANT:
            _store_q8_blocks(y, row, tl.program_id(1) * 256, KP, q32_ptr, d32_ptr, q256_ptr,
                             d256_ptr, K256)


@triton.jit
def _glu_kernel(g_ptr, u_ptr, out_ptr, n, GELU: tl.constexpr, BLOCK: tl.constexpr,
                PDL: tl.constexpr):
    _await_inputs(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, _glu_act(g, GELU) * u, mask=ok)


@triton.jit
def _glu_act(g, GELU: tl.constexpr):
    """gelu_tanh(g) or silu(g)."""
    if GELU:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # tanh, saturating at both ends
        act = 0.5 * g * (1.0 + t)
    else:
        act = g / (1.0 + tl.exp(-g))
    return act


@triton.jit
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr, out_ptr,
                       count_ptr, T, H, KVH, scale, softcap, n_rows, q32_ptr,
                       d32_ptr, q256_ptr, d256_ptr, KP, kn_ptr, vn_ptr, slots_ptr, span_ptr,
                       koff_ptr, voff_ptr,
                       G: tl.constexpr, HD: tl.constexpr, BT: tl.constexpr,
                       SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr,
                       SOFTCAP: tl.constexpr, NS: tl.constexpr,
                       SB: tl.constexpr, QUANT: tl.constexpr, K256: tl.constexpr,
                       WRITE: tl.constexpr, SPAN: tl.constexpr, APART: tl.constexpr,
                       PDL: tl.constexpr):
    """Attention of one token's query head over SPLIT key slots: the running max, sum of
    exponentials and weighted sum of values (flash-decoding's partial results), in f32
    from the cache's f16 (or f32) keys and values. A program per (token, head, split):
    enough of them at one token to fill a GPU. The last split of a (token, head) to finish
    (a counter each, as the split-K mat-vec) combines the partial results into the output:
    no second launch. QUANT: the token's output row (H * HD) also goes out as the 8-bit
    blocks of the output projection's mat-vec, each 256 columns written by the last of
    their heads to be combined (``_head_q8_chunks``): no quantize launch.
    WRITE (> 0: the step's token count): the step's new keys and values kn, vn (WRITE, KVH,
    HD) f32 go to cache slots ``slots`` in this launch, the KV write's: the first split of
    a group's first head stores its token's row, and every program reads a new row from
    kn/vn (rounded to the cache's dtype, as stored) instead of the slot it is replacing,
    so no program depends on another's store.
    The splits cover the first ``used`` slots: T, or (SPAN) the count at span_ptr, past
    which the mask hides every slot (a graph's storage, of which a step has used a few):
    splits of the smallest power of two of at least BT slots that makes at most
    MAX_SPLITS of them (``_split_slots``), so the same slots used split alike over any
    storage; the grid's programs past them return at once. SPLIT: that size where it is
    the same for every count up to T (a constant, as compiled before the span), else 0.
    APART: each token is another sequence's, over its own cache: its keys and values at
    koff_ptr[tok] and voff_ptr[tok] elements from k_ptr and v_ptr (int64: the distance
    between two tensors' memory, either way), its own count at span_ptr[tok], and its write
    (WRITE) its own row alone."""
    _await_inputs(PDL)
    tok = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    if APART:  # this token's own cache, count and new row (``offsets``: whole 64 bytes
        # apart, so the loads keep the alignment, and vector width, of a cache's own)
        k_ptr += tl.multiple_of(tl.load(koff_ptr + tok), OFFSET_ALIGN)
        v_ptr += tl.multiple_of(tl.load(voff_ptr + tok), OFFSET_ALIGN)
        span_ptr += tok
    used = tl.load(span_ptr).to(tl.int32) if SPAN else T
    split = SPLIT if SPLIT else _split_slots(used, BT, MAX_SPLITS)
    first = sp * split
    last = first + split
    n_splits = tl.cdiv(used, split)
    if sp >= n_splits:
        return
    kvh = h // G
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (tok * H + h).to(tl.int64) * HD + d) * scale  # (HD,)
    if WRITE:
        if (h % G == 0) & (sp == 0):
            _store_new_kv(k_ptr, v_ptr, kn_ptr, vn_ptr, slots_ptr, tok, kvh, KVH, HD)
    m_i = tl.full((1,), float("-inf"), tl.float32)
    l_i = tl.zeros((1,), tl.float32)
    acc = tl.zeros((HD,), tl.float32)
    for t0 in range(first, last, BT):
        t = t0 + tl.arange(0, BT)
        valid = tl.load(mask_ptr + tok.to(tl.int64) * T + t, mask=t < T, other=0) != 0
        if tl.max(valid.to(tl.int32), axis=0) > 0:  # a tile the mask hides costs nothing
            kv = (t.to(tl.int64) * KVH + kvh) * HD
            # (the values are loaded with the keys: loaded where they are used, after the
            # scores' reductions and their barriers, they were a second wait for memory)
            k = tl.load(k_ptr + kv[:, None] + d[None, :], mask=valid[:, None],
                        other=0.0)  # (BT, HD) in the cache's dtype
            v = tl.load(v_ptr + kv[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            if WRITE:
                if (WRITE == 1) or APART:  # (the token's own new row alone: decode's)
                    # (loaded before either row is put in: a put's layout conversion
                    # passes a barrier, which loads after it would wait behind)
                    own = (tok * KVH + kvh) * HD + d
                    slot = tl.load(slots_ptr + tok)
                    k_row, v_row = tl.load(kn_ptr + own), tl.load(vn_ptr + own)
                    k, v = _with_row(k, t, slot, k_row), _with_row(v, t, slot, v_row)
                else:
                    k = _new_rows(k, t, kn_ptr, slots_ptr, kvh, KVH, HD, WRITE)
                    v = _new_rows(v, t, vn_ptr, slots_ptr, kvh, KVH, HD, WRITE)
            s = tl.sum(k.to(tl.float32) * q[None, :], axis=1)  # (BT,)
            if SOFTCAP:
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # tanh
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))  # (1,)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe)  # (BT,)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
            m_i = m_new
    row = tok * H + h
    # (a row's partials at the grid's split count apart: APART rows split their own counts
    # of slots, and strides of their own would overlap another row's, which GPU programs
    # write at the same time)
    stride = tl.num_programs(2)
    part = row * stride + sp
    one = tl.arange(0, 1)
    tl.store(m_ptr + part + one, m_i)
    tl.store(l_ptr + part + one, l_i)
    if tl.max(m_i, axis=0) != float("-inf"):  # a split the mask hides stores no values
        tl.store(acc_ptr + part.to(tl.int64) * HD + d, acc)
    tl.debug_barrier()  # every thread's partial written before the count is released
    if tl.atomic_add(count_ptr + row, 1) == n_splits - 1:  # acq_rel: sees the others'
        _attn_combine(m_ptr, l_ptr, acc_ptr, out_ptr, row, n_splits, stride, HD, NS, SB)
        tl.atomic_xchg(count_ptr + row, 0)  # ready for the next launch
        if QUANT:
            tl.debug_barrier()  # the head's output written before its chunks' counts
            _head_q8_chunks(out_ptr, count_ptr + n_rows, tok, h, H * HD, KP, q32_ptr,
                            d32_ptr, q256_ptr, d256_ptr, HD, K256)


@triton.jit
def _split_slots(used, BT: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Slots per split of attention over ``used`` slots: the smallest power of two of at
    least BT that makes at most MAX_SPLITS splits (``split_slots``, on the device)."""
    split = BT
    while split * MAX_SPLITS < used:
        split *= 2
    return split


@triton.jit
def _store_new_kv(k_ptr, v_ptr, kn_ptr, vn_ptr, slots_ptr, tok, kvh, KVH, HD: tl.constexpr):
    """Token tok's new key and value of KV head kvh into its cache slot, in the cache's
    dtype (as ``_store_kv_kernel`` stores them)."""
    d = tl.arange(0, HD)
    src = (tok.to(tl.int64) * KVH + kvh) * HD + d
    dst = (tl.load(slots_ptr + tok) * KVH + kvh) * HD + d
    tl.store(k_ptr + dst, tl.load(kn_ptr + src).to(k_ptr.dtype.element_ty))
    tl.store(v_ptr + dst, tl.load(vn_ptr + src).to(v_ptr.dtype.element_ty))


@triton.jit
def _new_rows(x, t, new_ptr, slots_ptr, kvh, KVH, HD: tl.constexpr, N: tl.constexpr):
    """x (BT, HD) in the cache's dtype: cache rows t, with each row that one of the step's N
    tokens writes (at slots_ptr[i]) taken from that token's new row in new_ptr (N, KVH, HD)
    instead."""
    d = tl.arange(0, HD)
    for i in tl.static_range(N):
        x = _with_row(x, t, tl.load(slots_ptr + i), tl.load(new_ptr + (i * KVH + kvh) * HD + d))
    return x


@triton.jit
def _with_row(x, t, slot, row):
    """x (BT, HD) of slots t, its row at ``slot`` (if one) replaced by ``row`` (HD,) f32,
    rounded to x's dtype as the cache's store rounds it."""
    return tl.where((t == slot)[:, None], row.to(x.dtype)[None, :], x)


@triton.jit
def _head_q8_chunks(x_ptr, count_ptr, tok, h, K, KP, q32_ptr, d32_ptr, q256_ptr, d256_ptr,
                    HD: tl.constexpr, K256: tl.constexpr):
    """After head h of token tok wrote its HD outputs of the token's row x (n, K): each
    256-column chunk of the row that the head's columns touch is quantized by the last of
    the chunk's heads to finish (a counter per (token, chunk), after the heads' own), as
    ``_chunk_q8_blocks``. A chunk waits for its own heads (256 / HD of them, or one), not
    the token's every head, and the token's chunks are quantized in parallel."""
    n_chunks = tl.cdiv(K, 256)
    for c0 in range(h * HD // 256 * 256, h * HD + HD, 256):
        heads = (tl.minimum(c0 + 256, K) - 1) // HD - c0 // HD + 1  # the chunk's heads
        count = count_ptr + tok * n_chunks + c0 // 256
        if tl.atomic_add(count, 1) == heads - 1:  # acq_rel: the other heads' outputs seen
            _chunk_q8_blocks(x_ptr, tok.to(tl.int64), c0, K, KP, q32_ptr, d32_ptr, q256_ptr,
                             d256_ptr, K256)
            tl.atomic_xchg(count, 0)  # ready for the next launch


@triton.jit
def _chunk_q8_blocks(x_ptr, row, j0, K, KP, q32_ptr, d32_ptr, q256_ptr, d256_ptr,
                     K256: tl.constexpr):
    """Columns j0..j0 + 256 of row ``row`` of x (n, K) f32, which other programs wrote
    (read past L1), as a mat-vec's 8-bit blocks (``_store_q8_blocks``; zeros past K)."""
    j = j0 + tl.arange(0, 256)
    y = tl.load(x_ptr + row * K + j, mask=j < K, other=0.0, cache_modifier=".cg")
    _store_q8_blocks(y, row, j0, KP, q32_ptr, d32_ptr, q256_ptr, d256_ptr, K256)


@triton.jit
def _attn_combine(m_ptr, l_ptr, acc_ptr, out_ptr, row, n_splits, stride, HD: tl.constexpr,
                  NS: tl.constexpr, SB: tl.constexpr):
    """One query head's output (row = token * H + head) from its n_splits partial results
    at row * stride (read past L1: other programs wrote them): the splits' top maximum at
    once (NS of them), then their sums and weighted values SB splits at a time, adding
    only those of the splits that saw a key (the rest stored no values). A (NS, HD) tile at
    once would take NS * HD / threads registers: at 4096 slots (128 splits) ptxas gave it
    255 and spilt. SB is the same for every split count, so the sums' order is too: more
    splits that the mask hides (a graph's whole storage against an eager step's slots used)
    add exact zeros in whole blocks of their own, never regroup the others' sum (a (4, HD)
    tile and a (16, HD) one pair their rows differently on a GPU: three splits' values
    then differed by an ulp)."""
    s = tl.arange(0, NS)
    d = tl.arange(0, HD)
    # (each block's loads go out before the block before is summed, the first block's with
    # the maximums': the combine waits for memory about once, not twice a block)
    m_b, l_b, a = _split_partials(m_ptr, l_ptr, acc_ptr, row, stride, 0, n_splits, HD, SB)
    m = tl.load(m_ptr + row * stride + s, mask=s < n_splits, other=float("-inf"),
                cache_modifier=".cg")
    top = tl.max(m, axis=0)  # (exact in any order)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((1,), tl.float32)
    acc = tl.zeros((HD,), tl.float32)
    for s0 in range(0, n_splits, SB):
        m_n, l_n, a_n = _split_partials(m_ptr, l_ptr, acc_ptr, row, stride, s0 + SB,
                                        n_splits, HD, SB)  # (none past the last split)
        seen = m_b != float("-inf")  # (SB,) splits that stored values
        if tl.max(seen.to(tl.int32), axis=0) > 0:  # a block the mask hides adds nothing
            w = tl.exp(m_b - top)  # (SB,) 0 where unseen
            total += tl.sum(tl.where(seen, l_b, 0.0) * w, axis=0)
            # (an unseen split's values are another launch's, or never written: not NaN-safe)
            acc += tl.sum(tl.where(seen[:, None], a, 0.0) * w[:, None], axis=0)
        m_b, l_b, a = m_n, l_n, a_n
    tl.store(out_ptr + row.to(tl.int64) * HD + d, acc / total)


@triton.jit
def _split_partials(m_ptr, l_ptr, acc_ptr, row, stride, s0, n_splits, HD: tl.constexpr,
                    SB: tl.constexpr):
    """Splits s0..s0 + SB of a head's partial results (``_attn_combine``): maximums (SB,)
    (-inf past n_splits), sums (SB,) and weighted values (SB, HD) as stored (those of a
    split that saw no key: whatever its place held), read past L1."""
    sb = s0 + tl.arange(0, SB)
    part = row * stride + sb
    split = sb < n_splits
    m_b = tl.load(m_ptr + part, mask=split, other=float("-inf"), cache_modifier=".cg")
    l_b = tl.load(l_ptr + part, mask=split, other=0.0, cache_modifier=".cg")
    a = tl.load(acc_ptr + part.to(tl.int64)[:, None] * HD + tl.arange(0, HD)[None, :],
                mask=split[:, None], other=0.0, cache_modifier=".cg")
    return m_b, l_b, a


@triton.jit
def _f16_parts(x):
    """f32 x as hi + lo in f16 (hi = f16(x), lo = f16(x - hi)): two f16 tensor-core products
    with f32 sums give x's product within ~2^-21 of its size where the other factor is f16
    exactly (the f16 cache's keys and values)."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _flash_prompt_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, n, T, H, KVH, scale,
                         G: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, PDL: tl.constexpr):
    """A prompt's attention (flash attention, forward), a program per BM query rows of one
    KV head: its G query heads stacked as one sequence of G * n rows (row g * n + t: token
    t of head kvh * G + g), so GQA reads each key tile once for the group. Products on
    tensor cores from f16 parts of the f32 queries and probabilities against the f16 cache
    (``_f16_parts``), softmax and sums in f32; a key tile the mask hides from every row of
    the program is skipped (the causal half, a window's far side)."""
    _await_inputs(PDL)
    kvh = tl.program_id(1)
    r = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = r < n * G
    tok = (r % n).to(tl.int64)
    head = kvh * G + r // n
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + ((tok * H + head) * HD)[:, None] + d[None, :], mask=rmask[:, None],
                other=0.0) * scale  # (BM, HD) f32
    q_hi, q_lo = _f16_parts(q)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, HD), tl.float32)
    for t0 in range(0, T, BN):
        t = t0 + tl.arange(0, BN)
        tmask = t < T
        vis = tl.load(mask_ptr + tok[:, None] * T + t[None, :],
                      mask=rmask[:, None] & tmask[None, :], other=0) != 0  # (BM, BN)
        if tl.max(tl.max(vis.to(tl.int32), axis=1), axis=0) > 0:
            kv = (t.to(tl.int64) * KVH + kvh) * HD
            k = tl.load(k_ptr + kv[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            kt = tl.trans(k)  # (HD, BN) f16
            s = tl.dot(q_hi, kt) + tl.dot(q_lo, kt)  # (BM, BN) f32 sums
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])  # (BM, BN); 0 where hidden
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv[:, None] + d[None, :], mask=tmask[:, None], other=0.0)
            p_hi, p_lo = _f16_parts(p)
            acc = acc * alpha[:, None] + tl.dot(p_hi, v) + tl.dot(p_lo, v)
            m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # (a row that sees nothing: 0)
    tl.store(out_ptr + ((tok * H + head) * HD)[:, None] + d[None, :], out,
             mask=rmask[:, None])


@triton.jit
def _store_kv_kernel(keys_ptr, values_ptr, slots_ptr, k_ptr, v_ptr, ROW: tl.constexpr,
                     RP: tl.constexpr, PDL: tl.constexpr):
    """Token i's keys and values (KVH * hd f32) into cache slot slots[i], converted to
    the cache's dtype: one launch for what index_copy_ and two casts do in four."""
    _await_inputs(PDL)
    i = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, RP)
    ok = j < ROW
    slot = tl.load(slots_ptr + i)
    k = tl.load(k_ptr + i * ROW + j, mask=ok)
    v = tl.load(v_ptr + i * ROW + j, mask=ok)
    tl.store(keys_ptr + slot * ROW + j, k.to(keys_ptr.dtype.element_ty), mask=ok)
    tl.store(values_ptr + slot * ROW + j, v.to(values_ptr.dtype.element_ty), mask=ok)


# -- launchers ----------------------------------------------------------------------------
def _plane_args(p: Planes, q=None) -> tuple:
    q = p.q if q is None else q
    dummy = q  # absent planes are never read (their KIND branch is compiled out)
    return (q, dummy if p.qh is None else p.qh, p.s, dummy if p.m is None else p.m,
            dummy if p.d is None else p.d, dummy if p.dm is None else p.dm)


def _geometry(p: Planes) -> tuple[int, int, int, int]:
    """Bytes of q per row, groups of 32 per row, super-blocks per row, chunks per row."""
    nsup = p.d.shape[1] if p.d is not None else 1
    return p.q.shape[1], p.padded // 32, nsup, p.padded // CHUNK


#: triton reads TRITON_INTERPRET when it is first imported, as this module imports it
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
#: Rows a program takes in the interpreter (mat-vec, dequantize, rounding). It runs programs
#: one after another, each op a numpy call whose cost hardly depends on the tile's size, so
#: fewer, larger programs make the suite's kernel and model tests several times faster. A
#: row's sums are the same in any tile (the tests of every GPU tile check that).
INTERPRETER_ROWS = 64


#: Mat-vec tiles (rows per program, chunks per step, warps) and K splits, from a sweep of the
#: 1.5B's and 0.5B's matrices on an H100 (benchmarks/torch_matvec.py --tiles: cold weights,
#: launches replayed from a CUDA graph): up to K = 4096 rows alone fill the GPU best (a
#: split costs more than it gains), small tiles for few rows; longer rows (the down
#: projections) split K until ~PROGRAMS_PER_SM programs run per multiprocessor. These are
#: the defaults; on a GPU each shape's tile is timed among ``matvec_candidates`` at its
#: first use (``tuning.py``).
SPLIT_MIN_CHUNKS = 64
PROGRAMS_PER_SM = 8
#: a tile per block type that overrides ``matvec_tile`` and the tuning (sweeps, tests):
#: (rows, chunks, warps), aiming at PROGRAMS_PER_SM where K splits, or all four as a tuning
#: file keeps them
MATVEC_TILES: dict[int, tuple[int, ...]] = {}


def matvec_tile(rows: int, n_chunks: int) -> tuple[int, int, int]:
    """The mat-vec tile for a matrix of ``rows`` rows of ``n_chunks`` 64-weight chunks (the
    interpreter's: INTERPRETER_ROWS rows a program)."""
    if _INTERPRETING:
        return INTERPRETER_ROWS, 8, 4
    if n_chunks >= SPLIT_MIN_CHUNKS or rows >= 4096:
        return 16, 8, 4
    return (4, 8, 4) if rows > 512 else (2, 8, 4)


#: matrices of this many rows or more (short ones) are also timed with looping programs
LOOP_MIN_ROWS = 4096


@functools.cache
def matvec_candidates(n_chunks: int,
                      loops: bool = False) -> tuple[tuple[int, int, int, int], ...]:
    """Tiles (rows per program, chunks per step, warps, programs per multiprocessor aimed
    at: ``matvec_grid``) a GPU times for rows of ``n_chunks`` chunks. Short rows: 2-32
    rows a program, K in steps of 8 or 16 chunks or in one pass (small matrices are
    latency-bound: fewer dependent loads), a program a row block; with ``loops`` (many
    rows: gate+up, the output projection) also 2 or 4 programs a multiprocessor that
    loop over the row blocks, each asking L2 for its next block's weights while it sums
    one (no tail of a last, partly full wave of programs; untimed until a GPU's tuner
    times them). Long rows: larger tiles, split K or not."""
    if n_chunks >= SPLIT_MIN_CHUNKS:
        return tuple((bn, ch, 4, per_sm) for bn, ch in ((8, 8), (16, 8), (16, 16), (32, 8))
                     for per_sm in (0, 8, 16))
    steps = sorted({min(ch, triton.next_power_of_2(n_chunks)) for ch in (8, 16, 32)})
    # (4 warps: 2-4 such programs fit a multiprocessor, where 8 warps' may not fit twice)
    looping = tuple((bn, ch, 4, per_sm) for bn in (8, 16) for ch in steps[:2]
                    if bn * ch <= 128 for per_sm in (2, 4)) if loops else ()
    return tuple((bn, ch, 4 if bn * ch <= 128 else 8, 0) for bn in (2, 4, 8, 16, 32)
                 for ch in steps) + looping


def _matvec_tile(op: str, parts: tuple[Planes, ...], device,
                 run) -> tuple[int, int, int, int]:
    """The tile for ``op`` ("matvec", "matvec_glu", "matvec_joined") over the matrices
    ``parts`` (one launch): MATVEC_TILES' or ``matvec_tile``'s, or on a GPU the fastest of
    ``matvec_candidates`` (``run(tile)`` launches one; timed once per shape, at the first
    token count met, usually decode's one: a tile per count would compile every candidate
    for each of 1..8 tokens)."""
    n_chunks = parts[0].padded // CHUNK
    rows = sum(p.rows for p in parts)
    fixed = next((MATVEC_TILES[p.kind] for p in parts if p.kind in MATVEC_TILES), None)
    if fixed and len(fixed) == 4:  # (a whole tile, as a tuning file keeps it)
        return fixed
    bn, ch, warps = fixed or matvec_tile(rows, n_chunks)
    tile = bn, ch, warps, (PROGRAMS_PER_SM if n_chunks >= SPLIT_MIN_CHUNKS else 0)
    if fixed:  # (a sweep's or a test's: not timed)
        return tile
    shape = tuple(x for p in parts for x in (p.kind, p.rows))
    key = (op, *shape, n_chunks) + (() if matvec_pipeline(1) else ("unpipelined",))
    loopable = op != "matvec_joined" and rows >= LOOP_MIN_ROWS
    if loopable and not _env_on("EDGELLM_MATVEC_LOOPS"):  # (an A/B: kept apart)
        key, loopable = key + ("unlooped",), False
    return tuning.choose(device, key, matvec_candidates(n_chunks, loopable), run, tile)


def matvec_pipeline(tokens: int) -> bool:
    """Does a mat-vec over ``tokens`` tokens load each step a step ahead (``_qmv_rows``)?
    A lone token's does (decode), unless EDGELLM_MATVEC_PIPELINE=0 (an A/B on a GPU: the
    same sums in the same order either way); 2-8 tokens' do not (carrying the weights
    would take the stacked gate+up from 138 registers to 181 at 8 tokens)."""
    return _env_on("EDGELLM_MATVEC_PIPELINE") and tokens == 1


def _env_on(var: str) -> bool:
    """Is the environment variable ``var`` unset or other than "0"? Read at its first use
    and kept in ``_env_flags`` (every launch asks: 1.4 us a read of the environment; clear
    it to read again). EDGELLM_MATVEC_PIPELINE (``matvec_pipeline``) and
    EDGELLM_MATVEC_LOOPS=0 (no looping tiles timed, an A/B: ``_matvec_tile``)."""
    on = _env_flags.get(var)
    if on is None:
        on = _env_flags[var] = os.environ.get(var, "1") != "0"
    return on


_sm_counts: dict = {}
_pdl_devices: dict = {}  # device -> launch with PDL there (``_pdl``)
_env_flags: dict = {}  # variable -> it is unset or not "0" (``_env_on``)
_split_counters: dict = {}  # device -> int32 counters (split-K mat-vec, attention; self-resetting)


def _counters(device, n: int):
    """Zeroed int32 counters, one per row block of a split-K mat-vec or per (token, head) of
    attention; each launch's last programs set theirs back to zero, so one buffer serves
    every launch (and CUDA graphs) on the stream."""
    import torch

    buf = _split_counters.get(device)
    if buf is None or buf.numel() < n:
        buf = _split_counters[device] = torch.zeros(max(n, 8192), dtype=torch.int32,
                                                    device=device)
    return buf


def _multiprocessors(device) -> int:
    """The GPU's multiprocessor count (4 in the interpreter, so that tests split K too)."""
    if device.type != "cuda":
        return 4
    if device not in _sm_counts:
        import torch

        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[device]


def _pdl(device) -> int:
    """How kernels launch on this device: 0 as usual; 1 as programmatic dependent launches
    (``_await_inputs``); 2 also with the mat-vecs' weights asked of L2 before they wait
    (``_prefetch_weights``): 2 by default on a CUDA GPU of compute capability 9.0 or later
    (Hopper) with a triton that has grid dependency control, and 0 elsewhere; EDGELLM_PDL=0
    or 1 chooses those. On an H200 mode 2 decoded the 1.5B 9% and Gemma 3 14% faster than
    plain launches, mode 1 10% and 8% (docs/architecture.md)."""
    if device not in _pdl_devices:
        import torch

        mode = {"0": 0, "1": 1}.get(os.environ.get("EDGELLM_PDL", "2"), 2)
        _pdl_devices[device] = mode if (
            device.type == "cuda" and gdc_wait is not None
            and torch.cuda.get_device_capability(device)[0] >= 9) else 0
    return _pdl_devices[device]


def _launch(kernel, grid, *args, **meta) -> None:
    """kernel[grid](*args, **meta) with its PDL mode (``_pdl`` for the device of args[0]:
    every kernel's first argument is a tensor), launched as a programmatic dependent
    launch where it is on."""
    mode = _pdl(args[0].device)
    if mode:
        kernel[grid](*args, PDL=mode, launch_pdl=True, **meta)
    else:
        kernel[grid](*args, PDL=0, **meta)


def _words(p: Planes):
    """p.q as int32 words (a view of the same memory), made at the first mat-vec and kept:
    not a tensor op per matmul and token."""
    import torch

    if p.words is None:
        p.words = p.q.view(torch.int32)
    return p.words


def quantize_activations(x, block: int, padded: int):
    """x (n, K) f32 as 8-bit blocks for the mat-vec: (xq (n, padded / 4) int32 words of
    four int8 values, xd (n, padded / 32) f32 scale per 32 values), zeros past K; q * d
    equals ``round_activations(x, block)``."""
    import torch

    n, K = x.shape
    q = torch.empty((n, padded), dtype=torch.int8, device=x.device)
    d = torch.empty((n, padded // 32), dtype=torch.float32, device=x.device)
    _launch(_quantize_kernel, (n, triton.cdiv(padded, block)),
        x, q, d, K, padded, BLOCK=block, K_QUANT=block == 256,
        num_warps=1 if block == 32 else 2)
    return q.view(torch.int32), d


def qmatvec(xq, xd, p: Planes, bias=None, rope: tuple | None = None):
    """x @ W.T (+ bias) -> (n, N) f32 for n <= 8 tokens, x as ``quantize_activations``
    gives it (blocks of the size the weight type is multiplied with). On a GPU the tile is
    the fastest of ``matvec_candidates`` for this matrix shape (timed once). ``rope`` =
    (cos, sin (n, hd / 2) f32, n_rot, neox): the first n_rot outputs (Q's and K's heads of
    hd) rotated as ``rope_qk`` rotates them, in the same launch (K unsplit)."""
    # (timed without the bias and RoPE: the same speed, and no compile of each candidate
    # twice)
    tile = _matvec_tile("matvec", (p,), xq.device, lambda t: _qmatvec(xq, xd, p, None, t))
    return _qmatvec(xq, xd, p, bias, tile, rope)


def _rope_args(rope: tuple | None, unused) -> tuple[tuple, dict]:
    """A mat-vec kernel's RoPE arguments (cos, sin, n_rot) and constexprs (ROPE, HALF) for
    ``qmatvec``'s ``rope``; ``unused`` stands in for cos and sin without it."""
    if rope is None:
        return (unused, unused, 0), {"ROPE": 0, "HALF": 1}
    cos, sin, n_rot, neox = rope
    return (cos, sin, n_rot), {"ROPE": 1 if neox else 2, "HALF": cos.shape[1]}


def matvec_programs(blocks: int, per_sm: int, device) -> int:
    """Programs of a mat-vec launch over ``blocks`` row blocks that aims at ``per_sm``
    programs a multiprocessor (0: a program a block): a program a block, or where there
    are more blocks than that aim, that many programs, each looping over blocks."""
    return min(blocks, per_sm * _multiprocessors(device)) if per_sm else blocks


def matvec_grid(rows: int, n_chunks: int, tile: tuple[int, int, int, int],
                device) -> tuple[int, int, int]:
    """(programs, K splits, chunks per split) of ``qmatvec``'s launch of ``tile`` over
    ``rows`` rows of ``n_chunks`` chunks, aiming at about tile[3] programs a multiprocessor
    (0: a program a row block, K whole): fewer row blocks than that split K, in whole steps
    of tile[1] chunks; more are looped over (``matvec_programs``), K whole."""
    bn, ch, _, per_sm = tile
    blocks = triton.cdiv(rows, bn)
    programs = matvec_programs(blocks, per_sm, device)
    if programs < blocks:
        return programs, 1, triton.cdiv(n_chunks, ch) * ch
    wanted = triton.cdiv(per_sm * _multiprocessors(device), programs)
    splits = max(1, min(triton.cdiv(n_chunks, ch), wanted))
    cps = triton.cdiv(triton.cdiv(n_chunks, splits), ch) * ch  # chunks per split
    return programs, triton.cdiv(n_chunks, cps), cps


def _qmatvec(xq, xd, p: Planes, bias, tile: tuple[int, int, int, int], rope=None):
    import torch

    n = xq.shape[0]
    nq, ng, nsup, n_chunks = _geometry(p)
    bn, ch, warps, _ = tile
    programs, splits, cps = matvec_grid(p.rows, n_chunks, tile, xq.device)
    assert rope is None or (splits == 1 and bn % 2 == 0), (splits, bn)  # (whole pairs)
    (cos, sin, n_rot), rope_meta = _rope_args(rope, xd)
    out = torch.empty((n, p.rows), dtype=torch.float32, device=xq.device)
    part, counts = out, xq  # (unused without a split)
    if splits > 1:
        part = torch.empty((splits, n, p.rows), dtype=torch.float32, device=xq.device)
        counts = _counters(xq.device, programs)
    _launch(_qmv_kernel, (programs, splits),
        xq, xd, out, part, counts, bias if bias is not None else xd,
        *_plane_args(p, _words(p)), cos, sin, p.rows, xq.shape[1], nq // 4, ng, nsup,
        n_chunks, cps, splits, n_rot, M=n, MP=triton.next_power_of_2(n), KIND=p.kind, BN=bn,
        CH=ch, HAS_BIAS=bias is not None, SPLIT_K=splits > 1,
        SPLITS=triton.next_power_of_2(splits), **rope_meta,
        LOOP=programs < triton.cdiv(p.rows, bn), INTERP=_INTERPRETING,
        PIPELINE=matvec_pipeline(n), num_warps=warps)
    return out


def joinable(a: Planes, b: Planes) -> bool:
    """Can ``qmatvec_joined`` take a and b in one launch? (The same width, so one input's
    blocks serve both, and rows too short for a split of K: the joined launch has none.)"""
    return a.padded == b.padded and a.padded // CHUNK < SPLIT_MIN_CHUNKS


def qmatvec_joined(xq, xd, a: Planes, b: Planes, bias=None, rope: tuple | None = None):
    """x @ [A; B].T (+ bias (NA + NB,)) -> (n, NA + NB) f32 for n <= 8 tokens: ``qmatvec``
    of two ``joinable`` matrices of different block types in one launch (the rows of each
    as its own mat-vec sums them in the same tile; ``rope``: A's first n_rot rotated, as
    ``qmatvec`` rotates them). The tile is timed like the mat-vec's, among its unsplit
    candidates, for the pair."""
    import torch

    assert joinable(a, b)
    n = xq.shape[0]
    out = torch.empty((n, a.rows + b.rows), dtype=torch.float32, device=xq.device)
    (nqa, nga, nsupa, n_chunks), (nqb, ngb, nsupb, _) = _geometry(a), _geometry(b)

    def run(tile, bias=None, rope=None):
        bn, ch, warps, _ = tile
        assert rope is None or bn % 2 == 0, bn  # (whole pairs)
        (cos, sin, n_rot), rope_meta = _rope_args(rope, xd)
        _launch(_qmv_joined_kernel, (triton.cdiv(a.rows, bn) + triton.cdiv(b.rows, bn),),
            xq, xd, out, bias if bias is not None else xd, *_plane_args(a, _words(a)),
            *_plane_args(b, _words(b)), cos, sin, a.rows, b.rows, xq.shape[1], nqa // 4,
            nga, nsupa, nqb // 4, ngb, nsupb, n_chunks, n_rot, M=n,
            MP=triton.next_power_of_2(n), KIND_A=a.kind, KIND_B=b.kind, BN=bn, CH=ch,
            HAS_BIAS=bias is not None, **rope_meta, INTERP=_INTERPRETING,
            PIPELINE=matvec_pipeline(n), num_warps=warps)

    # (timed without the bias and RoPE, as qmatvec's)
    run(_matvec_tile("matvec_joined", (a, b), xq.device, run), bias, rope)
    return out


def qmatvec_glu(xq, xd, p: Planes, gelu: bool):
    """act(x @ G.T) * (x @ U.T) -> (n, F) f32 for n <= 8 tokens, with gate and up stacked
    in ``p`` (rows 0..F, F..2F: ``stack_rows``), and its 8-bit blocks for the down
    projection as ``then_quantize`` gives them: (out, blocks). One launch; rows of fewer
    than SPLIT_MIN_CHUNKS chunks only (K is not split). The tile is timed like the
    mat-vec's, among its unsplit candidates."""
    import torch

    n = xq.shape[0]
    F = p.rows // 2
    nq, ng, nsup, n_chunks = _geometry(p)
    assert n_chunks < SPLIT_MIN_CHUNKS and p.rows % 2 == 0
    padded, blocks = _q8_outputs(n, F, xq.device)
    out = torch.empty((n, F), dtype=torch.float32, device=xq.device)

    def run(tile):
        bn, ch, warps, _ = tile
        programs = matvec_programs(triton.cdiv(F, bn), tile[3], xq.device)
        _launch(_qmv_glu_kernel, (programs,),
            xq, xd, out, _counters(xq.device, triton.cdiv(F, 256)),
            *_plane_args(p, _words(p)), F, xq.shape[1], nq // 4, ng, nsup, n_chunks, padded,
            *_q8_args(blocks, out), M=n, MP=triton.next_power_of_2(n), KIND=p.kind, BN=bn,
            CH=ch, GELU=gelu, K256=256 in blocks, LOOP=programs < triton.cdiv(F, bn),
            INTERP=_INTERPRETING, PIPELINE=matvec_pipeline(n), num_warps=warps)

    run(_matvec_tile("matvec_glu", (p,), xq.device, run))
    return out, _as_matvec_blocks(blocks)


def dequantize(p: Planes, dtype, ids=None):
    """W (N, K) as ``dtype``, or only its rows ``ids`` (n,) int64 (embedding lookups)."""
    import torch

    n = p.rows if ids is None else ids.shape[0]
    out = torch.empty((n, p.cols), dtype=dtype, device=p.q.device)
    nq, ng, nsup, n_chunks = _geometry(p)
    bn, ch = (INTERPRETER_ROWS, 8) if _INTERPRETING else (16, 4)
    grid = (triton.cdiv(n, bn), triton.cdiv(n_chunks, ch))
    _launch(_dequant_kernel, grid, out, ids if ids is not None else p.q, *_plane_args(p), n,
            p.cols, nq, ng, nsup, n_chunks, KIND=p.kind, BN=bn, CH=ch, GATHER=ids is not None,
            num_warps=4)
    return out


#: the fused dequantize-GEMM's tile: tokens, weight rows, 64-weight chunks per step, warps
DQ_GEMM_TILE = (64, 64, 2, 4)
#: what a GPU times for a prompt's GEMM: dequantize + cuBLAS, or the fused kernel's tiles
GEMM_CANDIDATES = ("cublas", DQ_GEMM_TILE, (128, 64, 2, 8), (64, 128, 2, 4), (128, 128, 1, 8))


def prompt_matmul(x, p: Planes, bias=None, fused: bool | None = None,
                  f32_out: bool = False):
    """x (M, K) @ W.T (+ bias) -> (M, N) f32 for a prompt (x rounded to 8-bit blocks, in
    the GEMM's dtype: f16 on a GPU). ``fused`` True: ``dequantized_matmul``; False: W
    dequantized to x's dtype for torch's GEMM (``f32_out``: cuBLAS writes the f32 sums, no
    cast after it); None: on a GPU the faster of these (and the fused kernel's tiles) for
    this shape, timed once; elsewhere the GEMM."""
    def run(choice, bias=bias):
        if choice == "cublas":
            return _dequantize_mm(x, p, bias, f32_out)
        return dequantized_matmul(x, p, bias, choice)

    if fused is not None:
        return run(DQ_GEMM_TILE if fused else "cublas")
    key = ("gemm", p.kind, p.rows, p.cols, triton.next_power_of_2(x.shape[0]))
    # (timed without the bias, as the mat-vec's tiles are)
    return run(tuning.choose(x.device, key, GEMM_CANDIDATES, lambda c: run(c, None),
                             "cublas"))


def _dequantize_mm(x, p: Planes, bias, f32_out: bool):
    import torch

    dense = dequantize(p, x.dtype)  # (rows, cols)
    if f32_out:  # (n, rows) f32 from f32 sums: no rounding to x's dtype, no cast
        out = torch.mm(x, dense.T, out_dtype=torch.float32)
    else:
        out = (x @ dense.T).float()
    return out + bias if bias is not None else out


def dequantized_matmul(x, p: Planes, bias=None, tile: tuple | None = None):
    """x (M, K) @ W.T (+ bias) -> (M, N) f32 (x's values as f16): the prompt's GEMM with
    W's tiles dequantized inside it (``_dq_gemm_kernel``) rather than by ``dequantize``
    first; ``tile`` (tokens, rows, chunks per step, warps) defaults to DQ_GEMM_TILE."""
    import torch

    x = x.to(torch.float16).contiguous()
    M = x.shape[0]
    nq, ng, nsup, n_chunks = _geometry(p)
    bm, bn, ch, warps = tile or DQ_GEMM_TILE
    out = torch.empty((M, p.rows), dtype=torch.float32, device=x.device)
    _launch(_dq_gemm_kernel, (triton.cdiv(M, bm), triton.cdiv(p.rows, bn)),
        x, out, bias if bias is not None else out, *_plane_args(p), M, p.rows, p.cols, nq,
        ng, nsup, n_chunks, KIND=p.kind, BM=bm, BN=bn, CH=ch, HAS_BIAS=bias is not None,
        num_warps=warps)
    return out


def round_activations(x, block: int = 32, dtype=None):
    """x (n, K) f32 with K % block == 0, rounded to 8-bit blocks as llama.cpp rounds
    activations: Q8_0 per 32, or Q8_K per 256 (``block=256``); ``dtype`` (default f32): f16
    hands a GEMM its input without a separate cast."""
    import torch

    n, K = x.shape
    out = torch.empty_like(x, dtype=dtype or x.dtype)
    rows = INTERPRETER_ROWS if _INTERPRETING else 1
    _launch(_round_kernel, (triton.cdiv(n, rows), K // block), x, out, n, K, BLOCK=block,
            K_QUANT=block == 256, ROWS=rows, num_warps=1 if block == 32 else 2)
    return out


def rms_norm(x, w, eps: float):
    """x (..., D) f32 contiguous, w (D,) -> x / rms(x) * w."""
    import torch

    D = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // D
    _launch(_rms_norm_kernel, (rows,), x, w, out, D, eps, BLOCK=triton.next_power_of_2(D),
            num_warps=4 if D >= 1024 else 1)
    return out


def then_quantize(op: str, a, b, eps: float = 0.0):
    """``rms_norm(a, b, eps)`` (op "norm") or ``glu(a, b, gelu)`` (op "silu", "gelu") of a
    (n, K) f32, and its 8-bit blocks for a mat-vec, in one launch: (out, {32: (xq, xd),
    256: (xq, xd)}) with xq, xd as ``quantize_activations(out, block, padded)`` gives them
    (padded: K rounded up to 64; 256 only when K is a multiple of 256)."""
    import torch

    n, K = a.shape
    padded, blocks = _q8_outputs(n, K, a.device)
    out = torch.empty_like(a)
    _launch(_then_q8_kernel, (n, triton.cdiv(padded, 256)),
        a, b, out, *_q8_args(blocks, out), K, padded, eps,
        OP={"norm": 0, "silu": 1, "gelu": 2}[op], ROW=triton.next_power_of_2(K),
        K256=256 in blocks,
        num_warps=4 if K >= 1024 or op != "norm" else 1)  # rms_norm's: the same sum, bits
    return out, _as_matvec_blocks(blocks)


def _q8_outputs(n: int, K: int, device) -> tuple[int, dict]:
    """K padded as the weights' rows are (to CHUNK), and empty 8-bit blocks of n rows of it
    for the kernels that quantize their output: {32: (q int8 (n, padded), d f32 (n, padded
    / 32))}, and 256 the same way where K is a multiple of 256."""
    import torch

    padded = triton.cdiv(K, CHUNK) * CHUNK
    return padded, {block: (torch.empty((n, padded), dtype=torch.int8, device=device),
                            torch.empty((n, padded // 32), dtype=torch.float32, device=device))
                    for block in ((32, 256) if K % 256 == 0 else (32,))}


def _q8_args(blocks: dict, unused) -> tuple:
    """A quantizing kernel's four block tensors (q32, d32, q256, d256) from ``_q8_outputs``'
    blocks; ``unused`` stands in for those it does not write (its QUANT or K256 off)."""
    q32, d32 = blocks.get(32, (unused, unused))
    return (q32, d32, *blocks.get(256, (q32, d32)))


def _as_matvec_blocks(blocks: dict) -> dict:
    """The blocks as the mat-vec takes them: the int8 values read four to an int32."""
    import torch

    return {block: (q.view(torch.int32), d) for block, (q, d) in blocks.items()}


def rope(x, cos, sin, neox: bool):
    """x (n, H, hd) f32 contiguous rotated by cos/sin (n, hd/2) f32."""
    import torch

    n, H, hd = x.shape
    out = torch.empty_like(x)
    _launch(_rope_kernel, (n, H), x, cos, sin, out, H, HD=hd, HALF=hd // 2, NEOX=neox,
            num_warps=1)
    return out


def rope_qk(q, k, cos, sin, neox: bool, norms: tuple | None = None):
    """q (n, H, hd), k (n, KVH, hd) f32 contiguous, each head RMS-normalised first where
    ``norms`` = (q weight, k weight, eps), rotated by cos/sin (n, hd/2): one launch."""
    import torch

    n, H, hd = q.shape
    kvh = k.shape[1]
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    qw, kw, eps = norms if norms is not None else (q, k, 0.0)  # (unread without NORM)
    _launch(_rope_qk_kernel, (n, H + kvh), q, k, qw, kw, cos, sin, qo, ko, H, kvh, eps, HD=hd,
            HALF=hd // 2, NEOX=neox, NORM=norms is not None, num_warps=1)
    return qo, ko


def residual(x, h, eps: float, h_norm=None, out_norm=None, quantize: bool = False):
    """x + h (h RMS-normalised by h_norm first, where given) of (n, K) f32 contiguous
    tensors, and the sum RMS-normalised by out_norm (where given), with its 8-bit blocks as
    ``then_quantize`` gives them (``quantize``), in one launch: (sum, normed or None,
    blocks or None)."""
    import torch

    n, K = x.shape
    total = torch.empty_like(x)
    out = torch.empty_like(x) if out_norm is not None else total
    quantize = quantize and out_norm is not None
    padded, blocks = _q8_outputs(n, K, x.device) if quantize else (
        triton.cdiv(K, CHUNK) * CHUNK, {})
    # the row's width as the norms' own launches sum it (same reduction, same bits)
    _launch(_residual_kernel, (n, triton.cdiv(padded if quantize else K, 256)),
        x, h, h if h_norm is None else h_norm, x if out_norm is None else out_norm, total,
        out, *_q8_args(blocks, total), K, padded, eps, POST=h_norm is not None,
        NORM=out_norm is not None, QUANT=quantize, ROW=triton.next_power_of_2(K),
        K256=256 in blocks, num_warps=4 if K >= 1024 else 1)
    normed = out if out_norm is not None else None
    return total, normed, _as_matvec_blocks(blocks) if quantize else None


def glu(gate, up, gelu: bool):
    """silu(gate) * up or gelu_tanh(gate) * up, elementwise over contiguous f32 tensors."""
    import torch

    out = torch.empty_like(gate)
    n = gate.numel()
    block = 1024
    _launch(_glu_kernel, (triton.cdiv(n, block),), gate, up, out, n, GELU=gelu, BLOCK=block,
            num_warps=4)
    return out


#: queries up to which attention runs the split kernels (above: the caller's SDPA)
ATTENTION_MAX_QUERIES = 8
#: splits whose values a head's combine loads at a time ((SB, hd) f32 in registers), at
#: every split count (``_attn_combine``: the same order of sums over fewer or more splits)
COMBINE_SPLITS = 16


#: the most splits attention's slots take (``split_slots``)
MAX_ATTENTION_SPLITS = 256
#: slots of a split's tile (and the fewest a split takes)
ATTENTION_TILE = 32


def split_slots(used: int) -> int:
    """Slots per split of decode attention over ``used`` slots: the smallest power of two of
    at least ATTENTION_TILE that makes at most MAX_ATTENTION_SPLITS splits."""
    return max(ATTENTION_TILE, triton.next_power_of_2(triton.cdiv(used, MAX_ATTENTION_SPLITS)))


def attention(q, k, v, mask, scale: float, softcap: float = 0.0, quantize: bool = False,
              write: tuple | None = None, span=None, apart: tuple | None = None):
    """q (n, H, hd) f32 contiguous; k, v (T, KVH, hd) f16 or f32 contiguous; mask (n, T)
    bool -> (n, H, hd) f32. Split over the key slots (flash-decoding: enough programs for a
    GPU at one token), combined by each head's last split to finish, in one launch. hd must
    be a power of two. ``quantize``: also the output's rows (n, H * hd) as 8-bit blocks, as
    ``then_quantize`` returns them: (out, blocks). ``write`` = (slots (n,) int64, kn, vn (n,
    KVH, hd) f32 contiguous): store the step's keys and values at those slots of k and v's
    memory first, in the same launch (what ``store_kv`` then attention do); a slot may lie
    past T (graphs' spare row: stored, never read). ``span``: a (1,) int64 tensor on the
    device, the count of leading slots outside which the mask hides every one: the splits
    cover those only, and the bits equal attention over k[:span], v[:span] and the mask's
    first span columns (a graph's step over its whole storage then works, and rounds, as an
    eager step over the slots used so far). ``apart`` = (k offsets, v offsets (n,) int64
    on the device, in elements): each token is another sequence's, over its own cache at
    those offsets from k's and v's memory (the same shape and dtype as k, v: ``offsets``),
    with its own count (``span`` (n,)) and its own new row (``write``); the bits each row
    gets alone.

    Compiled without multiply-add contraction: the combine's sums over the splits then
    give the same bits for any number of trailing splits the mask hides, so attention over
    a graph's whole storage equals eager attention over the slots used so far (the split
    count was what differed when graph and eager decode parted by 0.13 logit on an H200;
    docs/architecture.md)."""
    import torch

    n, H, hd = q.shape
    T, kvh = k.shape[0], k.shape[1]
    bt = ATTENTION_TILE
    # programs for the most splits any count of slots used up to T takes (the kernel splits
    # the slots used, and those past them return)
    n_splits = (min(MAX_ATTENTION_SPLITS, triton.cdiv(T, bt)) if span is not None
                else triton.cdiv(T, split_slots(T)))
    ns = max(triton.next_power_of_2(n_splits), 2)
    # (a constant split where no count of slots used up to T splits otherwise)
    fixed = split_slots(T) if span is None or split_slots(T) == bt else 0
    dev = q.device
    m = torch.empty((n, H, n_splits), dtype=torch.float32, device=dev)
    l_s = torch.empty_like(m)
    acc = torch.empty((n, H, n_splits, hd), dtype=torch.float32, device=dev)
    out = torch.empty((n, H, hd), dtype=torch.float32, device=dev)
    padded, blocks = _q8_outputs(n, H * hd, dev) if quantize else (0, {})
    slots, kn, vn = write if write is not None else (out, out, out)  # (unread without)
    _launch(_attn_split_kernel, (n, H, n_splits),
        q, k, v, mask.view(torch.uint8), m, l_s, acc, out,
        _counters(dev, n * H + n * triton.cdiv(H * hd, 256)), T, H,
        kvh, scale, softcap or 1.0, n * H, *_q8_args(blocks, out), padded, kn, vn,
        slots, span if span is not None else slots, *(apart or (slots, slots)), G=H // kvh,
        HD=hd, BT=bt, SPLIT=fixed, MAX_SPLITS=MAX_ATTENTION_SPLITS, SOFTCAP=bool(softcap),
        NS=ns, SB=COMBINE_SPLITS, QUANT=quantize, K256=256 in blocks,
        WRITE=n if write is not None else 0, SPAN=span is not None, APART=apart is not None,
        num_warps=2 if hd <= 128 else 4, enable_fp_fusion=False)
    return (out, _as_matvec_blocks(blocks)) if quantize else out


#: the prompt attention's tiles a GPU times against SDPA: query rows, key slots, warps
FLASH_TILES = ((64, 32, 4), (64, 64, 4), (128, 32, 8), (32, 32, 4), (128, 64, 8))
#: and for heads of 256 (Gemma 3), where all of those but (32, 32, 4) spill 296-456 bytes a
#: thread to local memory (compiled for sm_90 offline: tests/offline_sm90.py), these too,
#: which spill none
WIDE_HEAD_FLASH_TILES = ((32, 32, 8), (32, 64, 8), (16, 32, 4), (16, 64, 4))


def flash_tiles(hd: int) -> tuple[tuple[int, int, int], ...]:
    """The tiles a GPU times for a prompt's attention over heads of ``hd``."""
    return FLASH_TILES + (WIDE_HEAD_FLASH_TILES if hd >= 256 else ())


def flash_prompt_attention(q, k, v, mask, scale: float, tile: tuple | None = None):
    """q (n, H, hd) f32 contiguous; k, v (T, KVH, hd) f16 contiguous; mask (n, T) bool ->
    (n, H, hd) f32: ``_flash_prompt_kernel``, tile (query rows, key slots, warps) from
    FLASH_TILES. hd must be a power of two of at least 16."""
    import torch

    n, H, hd = q.shape
    T, kvh = k.shape[0], k.shape[1]
    bm, bn, warps = tile or FLASH_TILES[0]
    out = torch.empty_like(q)
    _launch(_flash_prompt_kernel, (triton.cdiv(n * (H // kvh), bm), kvh),
        q, k, v, mask.view(torch.uint8), out, n, T, H, kvh, scale, G=H // kvh, HD=hd, BM=bm,
        BN=bn, num_warps=warps)
    return out


def offsets(tensors: list, base):
    """Each tensor's memory's distance from base's, in elements (int64 (n,) on base's
    device): ``attention``'s ``apart``."""
    import torch

    return torch.tensor(offset_elements(tensors, base.data_ptr(), base.dtype,
                                        base.element_size()),
                        dtype=torch.int64, device=base.device)


def offset_elements(tensors: list, base_ptr: int, dtype, element_size: int) -> list[int]:
    """Each tensor's memory's distance from address ``base_ptr``, in elements of
    ``element_size`` bytes. The tensors are of ``dtype`` and, as allocations are, 64-byte
    aligned (the kernel takes the distances as whole multiples of OFFSET_ALIGN elements,
    64 bytes of f32), else ValueError."""
    gaps = [t.data_ptr() - base_ptr for t in tensors]
    if any(t.dtype != dtype for t in tensors) or any(g % 64 for g in gaps):
        raise ValueError("attention apart takes caches of one dtype, 64-byte aligned")
    return [g // element_size for g in gaps]


def store_kv(keys, values, slots, k, v) -> None:
    """keys[slots] = k and values[slots] = v (k, v: (n, KVH, hd) f32 contiguous; slots: (n,)
    int64 on the device), converted to the storage's dtype, in one launch."""
    row = k.shape[1] * k.shape[2]
    _launch(_store_kv_kernel, (k.shape[0],), keys, values, slots, k, v, ROW=row,
            RP=triton.next_power_of_2(row), num_warps=1)
