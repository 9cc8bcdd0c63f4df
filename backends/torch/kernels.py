"""Triton kernels of the torch backend, over the planes of ``packing.py``.

- ``qmatvec``: x (n <= 8, K) @ W.T for decode and speculative checks: each program takes
  ``BN`` rows of W and walks K a few 64-weight chunks at a time; the weights are expanded
  once per tile and used by every token.
- ``dequantize``: W (or some of its rows: embedding lookups) to f16/f32, for prefill GEMMs.
- ``round_activations``: x rounded to 8-bit blocks as llama.cpp rounds activations (Q8_0 per
  32, Q8_K per 256), so that logits follow llama.cpp's where 8-bit blocks matter.
- ``rms_norm``, ``rope``, ``glu``: one launch each instead of a handful of torch ops (in
  decode, launches rather than bytes set the pace).

They run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .packing import CHUNK, Planes

#: tokens up to which a matmul runs the mat-vec kernel (above: dequantize + GEMM)
MATVEC_MAX_TOKENS = 8
_MAGIC = 12582912.0  # 1.5 * 2**23: (v + M) - M rounds |v| < 2**22 to the nearest even int


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
    if KIND <= 4:  # d (and m) per 32
        s_lo = tl.load(s_ptr + r * ng + cc * 2, mask=mk, other=0).to(tl.float32)
        s_hi = tl.load(s_ptr + r * ng + cc * 2 + 1, mask=mk, other=0).to(tl.float32)
        if KIND == 2 or KIND == 4:
            o_lo = tl.load(m_ptr + r * ng + cc * 2, mask=mk, other=0).to(tl.float32)
            o_hi = tl.load(m_ptr + r * ng + cc * 2 + 1, mask=mk, other=0).to(tl.float32)
        else:
            unit = -128.0 if KIND == 0 else (-8.0 if KIND == 1 else -16.0)
            o_lo = s_lo * unit
            o_hi = s_hi * unit
    elif KIND == 5 or KIND == 6:  # Q4_K / Q5_K: d * sc, -dmin * m
        dd = tl.load(d_ptr + r * nsup + cc // 4, mask=mk, other=0).to(tl.float32)
        dmin = tl.load(dm_ptr + r * nsup + cc // 4, mask=mk, other=0).to(tl.float32)
        s_lo = dd * tl.load(s_ptr + r * ng + cc * 2, mask=mk, other=0).to(tl.float32)
        s_hi = dd * tl.load(s_ptr + r * ng + cc * 2 + 1, mask=mk, other=0).to(tl.float32)
        o_lo = -(dmin * tl.load(m_ptr + r * ng + cc * 2, mask=mk, other=0).to(tl.float32))
        o_hi = -(dmin * tl.load(m_ptr + r * ng + cc * 2 + 1, mask=mk, other=0).to(tl.float32))
    else:  # Q6_K: d * sc per 16 weights, offset -32 units
        dd = tl.load(d_ptr + r * nsup + cc // 4, mask=mk, other=0).to(tl.float32)
        s_lo = dd * tl.load(s_ptr + r * (2 * ng) + cc * 4 + ii // 16, mask=mk,
                            other=0).to(tl.float32)
        s_hi = dd * tl.load(s_ptr + r * (2 * ng) + cc * 4 + 2 + ii // 16, mask=mk,
                            other=0).to(tl.float32)
        o_lo = s_lo * -32.0
        o_hi = s_hi * -32.0
    w_lo = u_lo.to(tl.float32) * s_lo + o_lo
    w_hi = u_hi.to(tl.float32) * s_hi + o_hi
    return w_lo, w_hi


@triton.jit
def _qmatvec_kernel(x_ptr, out_ptr, bias_ptr, q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr,
                    N, K, nq, ng, nsup, n_chunks,
                    M: tl.constexpr, MP: tl.constexpr, KIND: tl.constexpr, BN: tl.constexpr,
                    CH: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BN + tl.arange(0, BN)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    i = tl.arange(0, 32)
    mcol = tl.arange(0, MP)
    acc = tl.zeros((BN, MP), dtype=tl.float32)
    for c0 in range(0, n_chunks, CH):
        c = c0 + tl.arange(0, CH)
        cmask = c < n_chunks
        w_lo, w_hi = _weights_tile(q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, rows64, rmask,
                                   c, cmask, nq, ng, nsup, KIND)
        k_lo = c[:, None] * 64 + i[None, :]  # (CH, 32)
        for m in tl.static_range(M):
            x_lo = tl.load(x_ptr + m * K + k_lo, mask=k_lo < K, other=0.0)
            x_hi = tl.load(x_ptr + m * K + k_lo + 32, mask=k_lo + 32 < K, other=0.0)
            part = tl.sum(tl.sum(w_lo * x_lo[None, :, :] + w_hi * x_hi[None, :, :], axis=2),
                          axis=1)  # (BN,)
            acc += tl.where(mcol[None, :] == m, part[:, None], 0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=rmask, other=0.0)[:, None]
    tl.store(out_ptr + mcol[None, :] * N + rows[:, None], acc,
             mask=rmask[:, None] & (mcol[None, :] < M))


@triton.jit
def _dequant_kernel(out_ptr, ids_ptr, q_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr,
                    N, K, nq, ng, nsup, n_chunks,
                    KIND: tl.constexpr, BN: tl.constexpr, CH: tl.constexpr,
                    GATHER: tl.constexpr):
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
def _round_kernel(x_ptr, out_ptr, K, BLOCK: tl.constexpr, K_QUANT: tl.constexpr):
    """One block of one row: Q8_K (per 256: iscale = -127/peak, q = min(127, rint(x*iscale)),
    d = 1/iscale) or x86 Q8_0 (per 32: q = rint(x * 127/amax), d = f16(amax/127))."""
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * K + blk * BLOCK + j)
    ax = tl.abs(x)
    amax = tl.max(ax, axis=0)
    if K_QUANT:
        first = tl.min(tl.where(ax == amax, j, BLOCK), axis=0)  # first index of the peak
        peak = tl.sum(tl.where(j == first, x, 0.0), axis=0)
        safe = tl.where(peak == 0.0, 1.0, peak)
        iscale = tl.math.div_rn(-127.0, safe)
        q = tl.minimum(((x * iscale) + _MAGIC) - _MAGIC, 127.0)
        d = tl.where(peak == 0.0, 0.0, tl.math.div_rn(1.0, iscale))
    else:
        safe = tl.where(amax == 0.0, 1.0, amax)
        q = ((x * tl.math.div_rn(127.0, safe)) + _MAGIC) - _MAGIC
        d = tl.where(amax == 0.0, 0.0, tl.math.div_rn(safe, 127.0))
        d = d.to(tl.float16).to(tl.float32)
    tl.store(out_ptr + row * K + blk * BLOCK + j, q * d)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ok = j < D
    x = tl.load(x_ptr + row * D + j, mask=ok, other=0.0)
    ms = tl.sum(x * x, axis=0) / D
    w = tl.load(w_ptr + j, mask=ok, other=0.0)
    tl.store(out_ptr + row * D + j, x / tl.sqrt_rn(ms + eps) * w, mask=ok)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, HD: tl.constexpr, HALF: tl.constexpr,
                 NEOX: tl.constexpr):
    """x (n, H, HD) rotated by the angles of its token: cos/sin (n, HD/2)."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    p = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + tok * HALF + p)
    sin = tl.load(sin_ptr + tok * HALF + p)
    base = (tok * H + head) * HD
    if NEOX:
        ia = p
        ib = p + HALF
    else:
        ia = 2 * p
        ib = 2 * p + 1
    a = tl.load(x_ptr + base + ia)
    b = tl.load(x_ptr + base + ib)
    tl.store(out_ptr + base + ia, a * cos - b * sin)
    tl.store(out_ptr + base + ib, a * sin + b * cos)


@triton.jit
def _glu_kernel(g_ptr, u_ptr, out_ptr, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0)
    if GELU:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)  # tanh, saturating at both ends
        act = 0.5 * g * (1.0 + t)
    else:
        act = g / (1.0 + tl.exp(-g))
    tl.store(out_ptr + offs, act * u, mask=ok)


# -- launchers ----------------------------------------------------------------------------
def _plane_args(p: Planes) -> tuple:
    q = p.q
    dummy = q  # absent planes are never read (their KIND branch is compiled out)
    return (q, dummy if p.qh is None else p.qh, p.s, dummy if p.m is None else p.m,
            dummy if p.d is None else p.d, dummy if p.dm is None else p.dm)


def _geometry(p: Planes) -> tuple[int, int, int, int]:
    """Bytes of q per row, groups of 32 per row, super-blocks per row, chunks per row."""
    nsup = p.d.shape[1] if p.d is not None else 1
    return p.q.shape[1], p.padded // 32, nsup, p.padded // CHUNK


#: (rows per program, chunks per step, warps) of the mat-vec kernel, per block type
MATVEC_TILES: dict[int, tuple[int, int, int]] = {}
DEFAULT_TILE = (8, 4, 4)


def qmatvec(x, p: Planes, bias=None, out=None):
    """x (n <= 8, K) f32 contiguous @ W.T (+ bias) -> (n, N) f32."""
    import torch

    n, K = x.shape
    if out is None:
        out = torch.empty((n, p.rows), dtype=torch.float32, device=x.device)
    bn, ch, warps = MATVEC_TILES.get(p.kind, DEFAULT_TILE)
    nq, ng, nsup, n_chunks = _geometry(p)
    grid = (triton.cdiv(p.rows, bn),)
    _qmatvec_kernel[grid](x, out, bias if bias is not None else x, *_plane_args(p),
                          p.rows, K, nq, ng, nsup, n_chunks, M=n,
                          MP=triton.next_power_of_2(n), KIND=p.kind, BN=bn, CH=ch,
                          HAS_BIAS=bias is not None, num_warps=warps)
    return out


def dequantize(p: Planes, dtype, ids=None):
    """W (N, K) as ``dtype``, or only its rows ``ids`` (n,) int64 (embedding lookups)."""
    import torch

    n = p.rows if ids is None else ids.shape[0]
    out = torch.empty((n, p.cols), dtype=dtype, device=p.q.device)
    nq, ng, nsup, n_chunks = _geometry(p)
    bn, ch = 16, 4
    grid = (triton.cdiv(n, bn), triton.cdiv(n_chunks, ch))
    _dequant_kernel[grid](out, ids if ids is not None else p.q, *_plane_args(p), n, p.cols,
                          nq, ng, nsup, n_chunks, KIND=p.kind, BN=bn, CH=ch,
                          GATHER=ids is not None, num_warps=4)
    return out


def round_activations(x, block: int = 32):
    """x (n, K) f32 with K % block == 0, rounded to 8-bit blocks as llama.cpp rounds
    activations: Q8_0 per 32, or Q8_K per 256 (``block=256``)."""
    import torch

    n, K = x.shape
    out = torch.empty_like(x)
    _round_kernel[(n, K // block)](x, out, K, BLOCK=block, K_QUANT=block == 256,
                                   num_warps=1 if block == 32 else 2)
    return out


def rms_norm(x, w, eps: float):
    """x (..., D) f32 contiguous, w (D,) -> x / rms(x) * w."""
    import torch

    D = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // D
    _rms_norm_kernel[(rows,)](x, w, out, D, eps, BLOCK=triton.next_power_of_2(D),
                              num_warps=4 if D >= 1024 else 1)
    return out


def rope(x, cos, sin, neox: bool):
    """x (n, H, hd) f32 contiguous rotated by cos/sin (n, hd/2) f32."""
    import torch

    n, H, hd = x.shape
    out = torch.empty_like(x)
    _rope_kernel[(n, H)](x, cos, sin, out, H, HD=hd, HALF=hd // 2, NEOX=neox, num_warps=1)
    return out


def glu(gate, up, gelu: bool):
    """silu(gate) * up or gelu_tanh(gate) * up, elementwise over contiguous f32 tensors."""
    import torch

    out = torch.empty_like(gate)
    n = gate.numel()
    block = 1024
    _glu_kernel[(triton.cdiv(n, block),)](gate, up, out, n, GELU=gelu, BLOCK=block,
                                          num_warps=4)
    return out
