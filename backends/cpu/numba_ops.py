"""Numba kernels for the small f32 ops of a forward pass (norms, attention, activations)."""

from __future__ import annotations

import numba as nb
import numpy as np

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
