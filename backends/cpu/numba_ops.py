"""Numba kernels for the small f32 ops of a forward pass (norms, attention, activations)."""

from __future__ import annotations

import numba as nb
import numpy as np
from numba.extending import overload

_JIT = dict(cache=True, fastmath=True, boundscheck=False, error_model="numpy")


@nb.njit(**_JIT)
def _rms_norm_rows(x, w, eps, out):
    """x, out (rows, d); w (d,)."""
    d = x.shape[1]
    for r in range(x.shape[0]):
        ss = np.float32(0.0)
        for i in range(d):
            ss += x[r, i] * x[r, i]
        inv = np.float32(1.0) / np.sqrt(ss / np.float32(d) + eps)
        for i in range(d):
            out[r, i] = x[r, i] * inv * w[i]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """RMS-normalise the last axis of x (..., d) and scale by weight (d,)."""
    flat = x.reshape(-1, x.shape[-1])
    out = np.empty_like(flat)
    _rms_norm_rows(flat, np.asarray(weight, dtype=np.float32), eps, out)
    return out.reshape(x.shape)


@nb.njit(**_JIT)
def _rope(x, cos, sin, neox, out):
    """x, out (n, heads, hd); cos, sin (n, hd/2) f32: each pair turned by its angle."""
    n, heads, hd = x.shape
    half = hd // 2
    for t in range(n):
        for h in range(heads):
            for i in range(half):
                c, s = cos[t, i], sin[t, i]
                if neox:
                    a, b = x[t, h, i], x[t, h, i + half]
                    out[t, h, i] = a * c - b * s
                    out[t, h, i + half] = a * s + b * c
                else:
                    a, b = x[t, h, 2 * i], x[t, h, 2 * i + 1]
                    out[t, h, 2 * i] = a * c - b * s
                    out[t, h, 2 * i + 1] = a * s + b * c


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """Rotary embedding of x (n, heads, hd) by cos/sin (n, hd/2) tables; see Backend.rope."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    _rope(x, cos, sin, bool(neox), out)
    return out


def _load(a, t, h, i, tab):
    """a[t, h, i] as f32: a is f32, or f16 bit patterns (uint16) decoded through tab."""


@overload(_load, inline="always")
def _load_impl(a, t, h, i, tab):
    if a.dtype == nb.types.uint16:
        return lambda a, t, h, i, tab: tab[a[t, h, i]]
    return lambda a, t, h, i, tab: np.float32(a[t, h, i])


@nb.njit(**_JIT)
def _visible_span(mask):
    """[lo, hi): the keys some query of mask (n, T) sees (lo = hi when none)."""
    n, T = mask.shape
    lo, hi = T, 0
    for t in range(n):
        for j in range(T):
            if mask[t, j]:
                lo, hi = min(lo, j), max(hi, j + 1)
    return lo, min(max(hi, lo), T)


@nb.njit(**_JIT)
def _attention(q, k, v, mask, scale, softcap, tab, out):
    """q (n, H, hd); k, v (T, KVH, hd); mask (n, T) bool -> out (n, H, hd).

    Each KV head's visible keys and values are decoded to f32 once, for all of its query
    heads and tokens (a table lookup per f16 element was the whole cost: per query head, the
    0.5B's decode spent 3.1 ms a token here); every (token, head) then sums in the order it
    did before, so the result is unchanged."""
    n, n_heads, hd = q.shape
    T, n_kv = k.shape[0], k.shape[1]
    group = n_heads // n_kv
    lo, hi = _visible_span(mask)
    scores = np.empty(T, dtype=np.float32)
    acc = np.empty(hd, dtype=np.float32)
    kf = np.empty((T, hd), dtype=np.float32)  # (T, hd): one KV head's keys, then values
    vf = np.empty((T, hd), dtype=np.float32)
    if lo == hi:  # no query sees a key: the old loops' 0 / 0
        out[:] = np.nan
        return
    for kh in range(n_kv):
        for j in range(lo, hi):
            for i in range(hd):
                kf[j, i] = _load(k, j, kh, i, tab)
                vf[j, i] = _load(v, j, kh, i, tab)
        for t in range(n):
            for h in range(kh * group, (kh + 1) * group):
                best = np.float32(-np.inf)
                for j in range(lo, hi):
                    if not mask[t, j]:
                        continue
                    s = np.float32(0.0)
                    for i in range(hd):
                        s += q[t, h, i] * kf[j, i]
                    s *= scale
                    if softcap > 0:
                        s = softcap * np.tanh(s / softcap)
                    scores[j] = s
                    best = max(best, s)
                total = np.float32(0.0)
                acc[:] = 0.0
                for j in range(lo, hi):
                    if mask[t, j]:
                        p = np.exp(scores[j] - best)
                        total += p
                        for i in range(hd):
                            acc[i] += p * vf[j, i]
                for i in range(hd):
                    out[t, h, i] = acc[i] / total


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float,
              softcap: float, f16_table: np.ndarray) -> np.ndarray:
    """Softmax attention with grouped KV heads over an f32 or f16 cache; see Backend."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    if k.dtype == np.float16:
        k, v = k.view(np.uint16), v.view(np.uint16)
    else:
        k, v = np.asarray(k, dtype=np.float32), np.asarray(v, dtype=np.float32)
    out = np.empty_like(q)
    _attention(q, k, v, np.ascontiguousarray(mask), np.float32(scale), np.float32(softcap),
               f16_table, out)
    return out


@nb.njit(**_JIT)
def _silu_mul_rows(gate, up, out):
    """gate, up, out (rows, d): out = silu(gate) * up, one pass. On the calling thread: a
    fork-join region per layer waited ~4 ms whenever one of two cores was busy elsewhere
    (110 ms a token on the 0.5B), and a prompt's share is small beside its matmuls."""
    for r in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[r, i]
            # clamped: with fastmath, exp overflowing to inf would turn -g/inf into nan
            e = np.exp(-max(g, np.float32(-88.0)))
            out[r, i] = g / (np.float32(1.0) + e) * up[r, i]


def _glu(rows_kernel, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """rows_kernel(gate, up, out) over (..., d) f32 arrays viewed as rows."""
    g = np.ascontiguousarray(gate, dtype=np.float32).reshape(-1, gate.shape[-1])
    u = np.ascontiguousarray(up, dtype=np.float32).reshape(g.shape)
    out = np.empty_like(g)
    rows_kernel(g, u, out)
    return out.reshape(gate.shape)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU's silu(gate) * up for (..., d) f32 arrays, without numpy's temporaries."""
    return _glu(_silu_mul_rows, gate, up)


@nb.njit(**_JIT)
def _gelu_tanh_mul_rows(gate, up, out):
    """gate, up, out (rows, d): out = gelu_tanh(gate) * up, one pass on the calling thread."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    for r in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[r, i]
            # 0.5 * (1 + tanh(y)) = 1 / (1 + exp(-2y)): no cancellation where tanh is near -1;
            # y clamped so exp stays finite (fastmath assumes no inf)
            y = min(max(c * (g + np.float32(0.044715) * g * g * g), np.float32(-40.0)),
                    np.float32(40.0))
            out[r, i] = g / (np.float32(1.0) + np.exp(np.float32(-2.0) * y)) * up[r, i]


def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """GeGLU's gelu_tanh(gate) * up for (..., d) f32 arrays, without numpy's temporaries."""
    return _glu(_gelu_tanh_mul_rows, gate, up)
