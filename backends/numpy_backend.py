"""The numpy reference backend: plain f32 math, written to be read. It is the oracle.

Weights are dequantized to f32 once at ``prepare`` (memory-hungry: 4 bytes a parameter) so
every op is one obvious numpy expression; the embedding table stays quantized and rows are
dequantized on demand, since a lookup touches only a few of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgellm.converters.gguf_reader import QTensor
from edgellm.quants import dequantize

from .base import Backend


@dataclass
class QuantizedTable:
    """An embedding table kept in its file encoding; rows dequantized on lookup."""

    tensor: QTensor

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return dequantize(np.asarray(self.tensor.data[ids]), self.tensor.qtype)


def rope_angles(positions: np.ndarray, hd: int, theta: float,
                freq_factors: np.ndarray | None, freq_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (n, hd/2) for positions (n,): pair i turns at theta^(-2i/hd)."""
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd) * freq_scale
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class NumpyBackend(Backend):
    """Reference backend: f32 numpy, no tricks."""

    name = "numpy"

    def prepare(self, tensor: QTensor) -> np.ndarray:
        # (out, in) f32
        return np.ascontiguousarray(tensor.dequantize(), dtype=np.float32)

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

    def matmul(self, x: np.ndarray, weight, bias=None) -> np.ndarray:
        if isinstance(weight, QuantizedTable):  # tied output over a quantized table
            weight = self.prepare(weight.tensor)
        out = x @ weight.T
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
