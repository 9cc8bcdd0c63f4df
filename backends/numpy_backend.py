"""The numpy reference backend: plain f32 math, written to be read. It is the oracle.

Weights are dequantized to f32 once at ``prepare`` (memory-hungry: 4 bytes a parameter) so
every op is one obvious numpy expression; the embedding table stays quantized and rows are
dequantized on demand, since a lookup touches only a few of them.

``ggml_numerics=True`` (backend name "numpy-ggml") does the arithmetic the way llama.cpp's CPU
backend does it (ggml-cpu, flash attention off, f16 KV cache), so that its outputs can be
compared with llama.cpp's position by position:

- each matmul's activations are rounded to 8 bits before multiplying: per 256 values (Q8_K)
  against K-quant weights, per 32 (Q8_0, f16 scale) against the other block types;
- attention over an f16 cache rounds the queries and the softmax probabilities to f16 (ggml's
  f16 x f16 matmuls), and the GeGLU's GELU is ggml's f16 lookup table;
- RMS norm and RoPE follow ggml's order of f32 operations.

The 8-bit rounding is the one place where llama.cpp's numerics differ from f32 by more than
rounding noise: on the first token of a sequence, Qwen2.5-1.5B has activations in the
thousands, and 8-bit blocks flatten everything next to them. The rest is rounding noise, but
Gemma 3 amplifies noise: each 8-bit rounding is a step function, so a last-bit difference
upstream moves whole quantization steps downstream, and llama.cpp itself agrees with its own
flash-attention variant at only ~95% of argmaxes over 2048 tokens of text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgellm.converters.gguf_reader import QTensor
from edgellm.quants import Q, dequantize

from . import anon
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
    """x (n, in) as llama.cpp quantizes it for a dot product with a ``qtype`` weight.

    Q8_K is ggml's ``quantize_row_q8_K_ref``: iscale = -127/peak (peak: the signed value of
    largest magnitude), q = min(127, round-half-even(iscale * x)), d = 1/iscale. Q8_0 is the
    x86 ``quantize_row_q8_0`` (AVX2/AVX-512 builds): q = round-half-even(x * (127/amax)), d =
    amax/127 stored as f16. Multiplying by 127/amax sometimes rounds differently from
    dividing by amax/127: on Gemma 3's first layer that moved an int8 step in 136 of 512
    tokens, q/k/v off by up to 0.2% (after: 1e-7, summation order only).
    """
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return x
    block = 256 if qtype in K_QUANTS else 32
    x = np.asarray(x, dtype=np.float32)
    n, d = x.shape
    xb = x.reshape(n, d // block, block)
    # the signed value of largest magnitude in each block: (n, blocks, 1)
    peak = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)
    empty = peak == 0
    safe = np.where(empty, np.float32(1.0), peak)
    if block == 256:  # Q8_K
        iscale = np.float32(-127.0) / safe
        q = np.minimum(np.float32(127.0), np.rint(iscale * xb))
        scale = np.where(empty, np.float32(0.0), np.float32(1.0) / iscale)
    else:  # Q8_0
        amax = np.abs(safe)
        q = np.rint(xb * (np.float32(127.0) / amax))
        scale = np.where(empty, np.float32(0.0), amax / np.float32(127.0))
        scale = scale.astype(np.float16).astype(np.float32)
    return (q * scale).reshape(n, d).astype(np.float32)


def f16_round(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest f16 (ties to even, as F16C's vcvtps2ph), back as f32."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """f32 fused multiply-add a * b + c, rounded once (the f32 product is exact in f64; the
    f64 sum's second rounding to f32 differs from a true FMA only in rare double-rounding
    cases).

    ggml-cpu is compiled with FMA and GCC's default -ffp-contract=fast, so C expressions like
    ``x0*cos - x1*sin`` become fused multiply-adds; emulating them makes our f32 results equal
    llama.cpp's bit for bit instead of 1 ulp apart.
    """
    wide = np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)
    return wide.astype(np.float32)


# ggml's GELU (tanh approximation) constants, as f32 (ggml-cpu/vec.h)
GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)
_GELU_F16_TABLE: np.ndarray | None = None


def gelu_f16_table() -> np.ndarray:
    """ggml's ``ggml_table_gelu_f16`` as f32 (65536,): GELU of every f16 value, rounded to f16.

    ggml-cpu defines GGML_GELU_FP16, so ``ggml_vec_gelu_f32`` and ``ggml_vec_geglu_f32`` look
    GELU up in this table (indexed by the input's f16 bits) instead of evaluating tanh. The
    table is filled by ``ggml_gelu_f32``, 0.5f*x*(1 + tanhf(SQRT_2_OVER_PI*x*(1 + A*x*x))),
    whose ``1 + A*x*x`` an FMA build contracts to fma(A*x, x, 1): with that, every entry the
    Gemma 3 dump looks up equals llama.cpp's (without it, 1 in 5000 is an f16 ulp off).
    """
    global _GELU_F16_TABLE
    if _GELU_F16_TABLE is None:
        h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
        h = h.astype(np.float32)
        with np.errstate(all="ignore"):  # inf and nan entries, never looked up
            inner = SQRT_2_OVER_PI * h * fma32(GELU_COEF_A * h, h, np.float32(1.0))
            tanh = np.tanh(inner.astype(np.float64)).astype(np.float32)  # ~ tanhf
            gelu = np.float32(0.5) * h * (np.float32(1.0) + tanh)
        _GELU_F16_TABLE = f16_round(gelu)
    return _GELU_F16_TABLE


def geglu_like_ggml(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """GELU(gate) * up as ``ggml_vec_geglu_f32``: the f16 table for |gate| < 10, gate itself
    above 10, 0 below -10, then an f32 product with up."""
    gate = np.asarray(gate, dtype=np.float32)
    bits = gate.astype(np.float16).view(np.uint16)
    gelu = gelu_f16_table()[bits]
    gelu = np.where(gate >= 10.0, gate, np.where(gate <= -10.0, np.float32(0.0), gelu))
    return gelu * np.asarray(up, dtype=np.float32)


def rms_norm_like_ggml(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """``ggml_compute_forward_rms_norm_f32`` then ``ggml_mul``: the sum of f32 squares in
    double, mean and scale = 1/sqrtf(mean + eps) in f32, x * scale * weight."""
    x = np.asarray(x, dtype=np.float32)
    mean = (np.square(x).sum(axis=-1, keepdims=True, dtype=np.float64)
            / x.shape[-1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    return x * scale * weight


def rope_tables_like_ggml(positions: np.ndarray, hd: int, theta: float,
                          freq_factors: np.ndarray | None,
                          freq_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n, hd/2) as ``ggml_rope_cache_init`` makes them: the angle of pair i is
    p * theta_scale^i accumulated by repeated f32 multiplication (theta_scale =
    powf(base, -2/hd)), divided by the pair's freq factor, times freq_scale, then cosf/sinf.
    The f32 accumulation is off from the exact angle by up to ~1e-4 rad at position 2048."""
    pos = np.asarray(positions, dtype=np.float32)
    theta_scale = np.float32(np.float32(theta) ** np.float32(-2.0 / hd))
    ff = (np.ones(hd // 2, np.float32) if freq_factors is None
          else np.asarray(freq_factors, dtype=np.float32))
    angles = np.empty((len(pos), hd // 2), dtype=np.float32)
    t = pos.copy()
    for i in range(hd // 2):
        angles[:, i] = np.float32(freq_scale) * (t / ff[i])
        t = t * theta_scale
    a64 = angles.astype(np.float64)  # correctly rounded f32 cos/sin, as glibc's cosf/sinf
    return np.cos(a64).astype(np.float32), np.sin(a64).astype(np.float32)


def rope_like_ggml(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """ggml's ``rotate_pairs`` as compiled with FMA: x0*cos - x1*sin -> fma(x0, cos, -(x1*sin))
    and x0*sin + x1*cos -> fma(x0, sin, x1*cos) (99% of Gemma 3's roped values equal
    llama.cpp's this way, 77% with separate roundings). cos, sin broadcast against the pairs.
    """
    x = np.asarray(x, dtype=np.float32)
    hd = x.shape[-1]
    a, b = (x[..., : hd // 2], x[..., hd // 2:]) if neox else (x[..., 0::2], x[..., 1::2])
    first = fma32(a, cos, -(b * sin))
    second = fma32(a, sin, b * cos)
    if neox:
        return np.concatenate([first, second], axis=-1)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = first, second
    return out


def attention_like_ggml(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray,
                        scale: float, softcap: float = 0.0) -> np.ndarray:
    """llama.cpp's attention without flash attention (``build_attn_mha``, ggml-cpu).

    KQ is ``ggml_mul_mat(k, q)``: against an f16 cache, ggml converts q to k's vec_dot_type
    (f16) first, so the products are of f16 values, summed in f32. ``ggml_soft_max_ext`` runs
    in f32 (exp sums in double, then a multiply by the f32 reciprocal), and KQV is
    ``ggml_mul_mat(v, kq)``: the probabilities are converted to f16 for it too. With an f32
    cache (``-ctk f32 -ctv f32``) nothing is rounded. Shapes as ``Backend.attention``.
    (llama.cpp scales Gemma's queries before the f16 conversion, we scale the scores after:
    the same numbers for a power-of-two scale such as Gemma 3's 1/16.)
    """
    n, n_heads, hd = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    f16 = np.asarray(k).dtype == np.float16
    q = f16_round(q) if f16 else np.asarray(q, dtype=np.float32)
    qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)  # (KVH, group, n, hd)
    kt = np.asarray(k, dtype=np.float32).transpose(1, 2, 0)  # (KVH, hd, T)
    scores = (qg @ kt[:, None]) * np.float32(scale)
    if softcap:
        scores = np.tanh(scores / np.float32(softcap)) * np.float32(softcap)
    scores = np.where(mask[None, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    inv = (1.0 / probs.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    probs = probs * inv
    if f16:
        probs = f16_round(probs)
    vt = np.asarray(v, dtype=np.float32).transpose(1, 0, 2)  # (KVH, T, hd)
    out = probs @ vt[:, None]  # (KVH, group, n, hd)
    return out.transpose(2, 0, 1, 3).reshape(n, n_heads, hd)


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
    """Reference backend: f32 numpy, no tricks; or llama.cpp's CPU arithmetic with
    ``ggml_numerics`` (see the module docstring)."""

    name = "numpy"
    ggml_numerics = False

    def __init__(self, threads: int | None = None, ggml_numerics: bool = False):
        super().__init__(threads)
        self.ggml_numerics = ggml_numerics
        if ggml_numerics:
            self.name = "numpy-ggml"

    def prepare(self, tensor: QTensor) -> DenseWeight:
        return DenseWeight(np.ascontiguousarray(tensor.dequantize(), dtype=np.float32),
                           tensor.qtype)

    def prepare_embedding(self, tensor: QTensor) -> QuantizedTable:
        return QuantizedTable(tensor)

    def asarray(self, values: np.ndarray) -> np.ndarray:
        """f32, except that f16 (a KV cache's storage) stays f16, as torch's does."""
        if isinstance(values, np.ndarray) and values.dtype == np.float16:
            return values
        return np.asarray(values, dtype=np.float32)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, dtype=np.float32)

    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> np.ndarray:
        # KV caches: large and freed whole, so in mappings of their own (anon.py says why)
        return anon.zeros(shape, dtype)

    def embed(self, table, ids: np.ndarray) -> np.ndarray:
        if isinstance(table, QuantizedTable):
            return table.rows(np.asarray(ids))
        return np.asarray(table[np.asarray(ids)], dtype=np.float32)

    def matmul(self, x: np.ndarray, weight: DenseWeight, bias=None) -> np.ndarray:
        if self.ggml_numerics:
            x = round_activations_like_ggml(x, weight.qtype)
        out = x @ weight.values.T
        return out + bias if bias is not None else out

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        if self.ggml_numerics:
            return rms_norm_like_ggml(x, weight, eps)
        ms = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
        return (x / np.sqrt(ms + eps)) * weight

    def rope(self, x, positions, theta, neox, freq_factors=None, freq_scale=1.0):
        hd = x.shape[-1]
        tables = rope_tables_like_ggml if self.ggml_numerics else rope_angles
        cos, sin = tables(positions, hd, theta, freq_factors, freq_scale)
        cos, sin = cos[:, None, :], sin[:, None, :]  # (n, 1, hd/2), broadcast over heads
        if self.ggml_numerics:
            return rope_like_ggml(x, cos, sin, neox)
        if neox:
            a, b = x[..., : hd // 2], x[..., hd // 2:]
            return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out

    def attention(self, q, k, v, mask, scale, softcap=0.0):
        if self.ggml_numerics:
            return attention_like_ggml(q, k, v, mask, scale, softcap)
        n, n_heads, hd = q.shape
        n_kv = k.shape[1]
        group = n_heads // n_kv
        # (KVH, group, n, hd) x (KVH, hd, T) -> (KVH, group, n, T)
        qg = q.reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3)
        kt = np.asarray(k, dtype=np.float32).transpose(1, 2, 0)
        scores = qg @ kt[:, None]
        scores *= scale
        if softcap:
            scores = np.tanh(scores / softcap) * softcap
        scores[:, :, ~mask] = -np.inf  # in place: prefill calls this per block of queries
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores, out=scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        vt = np.asarray(v, dtype=np.float32).transpose(1, 0, 2)  # (KVH, T, hd)
        out = probs @ vt[:, None]  # (KVH, group, n, hd)
        return out.transpose(2, 0, 1, 3).reshape(n, n_heads, hd)

    def silu_mul(self, gate, up):
        return gate / (1.0 + np.exp(-gate)) * up

    def gelu_tanh_mul(self, gate, up):
        if self.ggml_numerics:
            return geglu_like_ggml(gate, up)
        c = np.float32(np.sqrt(2.0 / np.pi))
        return 0.5 * gate * (1.0 + np.tanh(c * (gate + 0.044715 * gate ** 3))) * up

    def softcap(self, x, cap):
        return np.tanh(x / cap) * cap
