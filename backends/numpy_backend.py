"""The numpy reference backend: plain f32 math, written to be read. It is the oracle.

Weights are dequantized to f32 once at ``prepare`` (memory-hungry: 4 bytes a parameter) so
every op is one obvious numpy expression; the embedding table stays quantized and rows are
dequantized on demand, since a lookup touches only a few of them.

``ggml_activations=True`` (backend name "numpy-ggml") rounds each matmul's activations the
way llama.cpp's CPU dot products do before multiplying: to 8 bits per 256-value block (Q8_K)
against K-quant weights, per 32-value block (Q8_0) against the other block types. That is
the one place where llama.cpp's numerics differ from f32 by more than rounding noise: on the
first token of a sequence, Qwen2.5-1.5B has activations in the thousands, and 8-bit blocks
flatten everything next to them, so llama.cpp's first-position logits are not an f32 model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgellm.converters.gguf_reader import QTensor
from edgellm.quants import Q, dequantize

from .base import Backend


@dataclass
class QuantizedTable:
    """An embedding table kept in its file encoding; rows dequantized on lookup."""

    tensor: QTensor

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return dequantize(np.asarray(self.tensor.data[ids]), self.tensor.qtype)


@dataclass
class DenseWeight:
    """A weight dequantized to f32 (out, in), remembering the block type it came from."""

    values: np.ndarray
    qtype: Q


K_QUANTS = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})


def round_activations_like_ggml(x: np.ndarray, qtype: Q) -> np.ndarray:
    """x (n, in) as llama.cpp quantizes it for a dot product with a ``qtype`` weight."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return x
    block = 256 if qtype in K_QUANTS else 32
    n, d = x.shape
    xb = x.reshape(n, d // block, block)
    # the signed value of largest magnitude in each block: (n, blocks, 1)
    peak = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
    safe = np.where(peak == 0, 1.0, peak)
    if block == 256:  # Q8_K: q = min(127, round(-127/peak * x)), f32 scale
        q = np.minimum(127.0, np.rint(-127.0 / safe * xb))
        scale = np.where(peak == 0, 0.0, -safe / 127.0)
    else:  # Q8_0: q = round(x / d), d = |peak| / 127 stored as f16
        d32 = np.abs(peak) / 127.0
        q = np.rint(xb / np.where(d32 == 0, 1.0, d32))
        scale = d32.astype(np.float16).astype(np.float32)
    return (q * scale).reshape(n, d).astype(np.float32)


def rope_angles(positions: np.ndarray, hd: int, theta: float,
                freq_factors: np.ndarray | None,
                freq_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (n, hd/2) for positions (n,): pair i turns at theta^(-2i/hd)."""
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd) * freq_scale
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class NumpyBackend(Backend):
    """Reference backend: f32 numpy, no tricks."""

    name = "numpy"

    def __init__(self, threads: int | None = None, ggml_activations: bool = False):
        super().__init__(threads)
        self.ggml_activations = ggml_activations
        if ggml_activations:
            self.name = "numpy-ggml"

    def prepare(self, tensor: QTensor) -> DenseWeight:
        return DenseWeight(np.ascontiguousarray(tensor.dequantize(), dtype=np.float32),
                           tensor.qtype)

    def prepare_embedding(self, tensor: QTensor) -> QuantizedTable:
        return QuantizedTable(tensor)

    def asarray(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, dtype=np.float32)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def embed(self, table, ids: np.ndarray) -> np.ndarray:
        if isinstance(table, QuantizedTable):
            return table.rows(np.asarray(ids))
        return np.asarray(table[np.asarray(ids)], dtype=np.float32)

    def matmul(self, x: np.ndarray, weight: DenseWeight, bias=None) -> np.ndarray:
        if self.ggml_activations:
            x = round_activations_like_ggml(x, weight.qtype)
        out = x @ weight.values.T
        return out + bias if bias is not None else out

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
        return (x / np.sqrt(ms + eps)) * weight

    def rope(self, x, positions, theta, neox, freq_factors=None, freq_scale=1.0):
        hd = x.shape[-1]
        cos, sin = rope_angles(positions, hd, theta, freq_factors, freq_scale)
        cos, sin = cos[:, None, :], sin[:, None, :]  # (n, 1, hd/2), broadcast over heads
        if neox:
            a, b = x[..., : hd // 2], x[..., hd // 2:]
            return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def attention(self, q, k, v, mask, scale, softcap=0.0):
        n, n_heads, hd = q.shape
        n_kv = k.shape[1]
        group = n_heads // n_kv
        # (KVH, group, n, hd) x (KVH, hd, T) -> (KVH, group, n, T)
        qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)
        kt = np.asarray(k, dtype=np.float32).transpose(1, 2, 0)
        scores = (qg @ kt[:, None]) * scale
        if softcap:
            scores = np.tanh(scores / softcap) * softcap
        scores = np.where(mask[None, None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        vt = np.asarray(v, dtype=np.float32).transpose(1, 0, 2)  # (KVH, T, hd)
        out = probs @ vt[:, None]  # (KVH, group, n, hd)
        return out.transpose(2, 0, 1, 3).reshape(n, n_heads, hd)

    def silu_mul(self, gate, up):
        return gate / (1.0 + np.exp(-gate)) * up

    def gelu_tanh_mul(self, gate, up):
        c = np.float32(np.sqrt(2.0 / np.pi))
        return 0.5 * gate * (1.0 + np.tanh(c * (gate + 0.044715 * gate ** 3))) * up

    def softcap(self, x, cap):
        return np.tanh(x / cap) * cap
