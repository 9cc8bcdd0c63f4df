"""The Apple MLX backend: the op set in MLX, weights kept in the file's quantized blocks.

Weights are mapped at load from the GGUF blocks onto MLX's affine quantization
(``converters/mlx_layout.py``): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K exactly (the same
f32 values as the numpy oracle), Q6_K re-quantized to 8 bits (no exact form exists in groups
of 32; see there). Matmuls are ``mx.quantized_matmul``; norms, RoPE and attention are
``mx.fast`` kernels; the KV cache is MLX arrays (``zeros``), written in place.

Everything is lazy: a forward pass builds one graph and ``to_numpy(logits)`` evaluates it (one
``mx.eval`` per step, the cache's writes included, since attention reads them).

Activations are float32: the K-quants' scales must be f32 to be exact, and on the CPU
(``mlx[cpu]`` on Linux, where parity is tested) MLX's float16 kernels are ~40x slower than
its float32 ones. They are multiplied as they are, as llama.cpp's Metal kernels multiply
them; ``round_activations=True`` (or ``EDGELLM_MLX_ROUND_ACTIVATIONS=1``) first rounds each
quantized matmul's input to 8-bit blocks as llama.cpp's CPU backend does (Q8_0 per 32, Q8_K per
256 against K-quants), which the reference outputs were made with. Float is the default on
every device, so the parity tested on Linux is the arithmetic a Mac runs; the rounding costs a
fused kernel per matmul input and, measured against the references, trades one model's
shortfall for another's (docs/architecture.md).

Every matmul, decode and prompt alike, is ``mx.quantized_matmul`` (on the CPU, dequantizing
and running MLX's f32 GEMM measured slower still).

The embedding table is read where it lies, in the file's mapping: a lookup dequantizes the
few rows it needs on the host (numpy, exact) and hands them to MLX, so an untied table takes
no device memory (as llama.cpp keeps ``token_embd`` on the host); a tied one is also the
output matrix, which lives on the device as every other weight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from edgellm.converters.gguf_reader import QTensor
from edgellm.converters.mlx_layout import AffineWeight, to_affine
from edgellm.quants import Q, dequantize

from ..base import Backend
from ..numpy_backend import K_QUANTS

_DTYPES = {"float32": mx.float32, "float16": mx.float16}


@dataclass
class MlxQuantWeight:
    """A (rows, cols) weight in MLX's affine layout, on the device."""

    packed: mx.array  # (rows, cols * bits / 32) uint32
    scales: mx.array  # (rows, cols / group) f16 (legacy types) or f32 (K-quants)
    biases: mx.array
    bits: int
    group_size: int
    exact: bool  # the file's values, bit for bit (False: Q6_K & co. re-quantized)
    act_block: int = 32  # llama.cpp's activation block against the file's type (256: K-quants)

    @classmethod
    def from_affine(cls, a: AffineWeight, qtype: Q) -> MlxQuantWeight:
        return cls(mx.array(a.packed), mx.array(a.scales), mx.array(a.biases), a.bits,
                   a.group_size, a.exact, 256 if qtype in K_QUANTS else 32)

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes + self.scales.nbytes + self.biases.nbytes)

    def dequantized(self) -> mx.array:
        """The weight as f32 (rows, cols), lazily (f16 scales widened first: exact)."""
        return mx.dequantize(self.packed, self.scales.astype(mx.float32),
                             self.biases.astype(mx.float32), group_size=self.group_size,
                             bits=self.bits)


@dataclass
class HostTable:
    """An embedding table left in the file's mapping; rows dequantized on lookup."""

    tensor: QTensor

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return dequantize(np.asarray(self.tensor.data[ids]), self.tensor.qtype)  # (n, d)


@mx.compile
def _silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    return gate * mx.sigmoid(gate) * up


@mx.compile
def _gelu_tanh_mul(gate: mx.array, up: mx.array) -> mx.array:
    c = float(np.sqrt(2.0 / np.pi))
    return 0.5 * gate * (1.0 + mx.tanh(c * (gate + 0.044715 * gate * gate * gate))) * up


@mx.compile
def _round_q8_0(x: mx.array) -> mx.array:
    """x (n, in) as llama.cpp's x86 ``quantize_row_q8_0`` rounds it (per 32: q =
    round-half-even(x * (127/amax)), d = f16(amax/127)), back as f32 q * d."""
    n, k = x.shape
    xb = x.reshape(n, k // 32, 32)
    amax = mx.max(mx.abs(xb), axis=-1, keepdims=True)  # (n, k/32, 1)
    empty = amax == 0
    safe = mx.where(empty, 1.0, amax)
    q = mx.round(xb * (127.0 / safe))
    d = mx.where(empty, 0.0, safe / 127.0).astype(mx.float16).astype(mx.float32)
    return (q * d).reshape(n, k)


@mx.compile
def _round_q8_k(x: mx.array) -> mx.array:
    """x (n, in) as ggml's ``quantize_row_q8_K`` rounds it (per 256: iscale = -127/peak, the
    signed value of largest magnitude; q = min(127, round-half-even(iscale * x)); d =
    1/iscale), back as f32 q * d."""
    n, k = x.shape
    xb = x.reshape(n, k // 256, 256)
    peak = mx.take_along_axis(xb, mx.argmax(mx.abs(xb), axis=-1, keepdims=True), axis=-1)
    empty = peak == 0
    iscale = -127.0 / mx.where(empty, 1.0, peak)
    q = mx.minimum(mx.round(iscale * xb), 127.0)
    d = mx.where(empty, 0.0, 1.0 / iscale)
    return (q * d).reshape(n, k)


def round_activations(x: mx.array, block: int) -> mx.array:
    """x (n, in) f32 rounded to 8-bit blocks of ``block`` (32 or 256) as llama.cpp's CPU
    backend rounds a matmul's input (the arithmetic of ``numpy-ggml``)."""
    return _round_q8_k(x) if block == 256 else _round_q8_0(x)


def _consecutive(positions: np.ndarray) -> bool:
    return len(positions) > 0 and bool(np.all(np.diff(positions) == 1))


def rope_tables(positions: np.ndarray, hd: int, theta: float, freq_factors, freq_scale: float):
    """cos and sin (n, hd/2) f32 of each position's angles, computed in f64 (numpy)."""
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd) * freq_scale
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class MlxBackend(Backend):
    """MLX ops over weights in MLX's affine layout; ``device`` is "auto" (MLX's default: the
    GPU on Apple Silicon), "gpu" or "cpu"."""

    name = "mlx"
    ggml_numerics = False

    def __init__(self, threads: int | None = None, device: str | None = None,
                 round_activations: bool | None = None):
        super().__init__(threads)
        device = device or os.environ.get("EDGELLM_MLX_DEVICE", "auto")
        if device not in ("auto", "cpu", "gpu"):
            raise ValueError(f"MLX device must be auto, cpu or gpu, not {device!r}")
        if device == "gpu" and not mx.metal.is_available():
            raise RuntimeError("MLX has no GPU here (Metal is macOS only): use device cpu")
        if device != "auto":
            mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
        self.on_gpu = mx.default_device() == mx.gpu
        self.threads = threads or os.cpu_count() or 1
        if round_activations is None:
            round_activations = os.environ.get("EDGELLM_MLX_ROUND_ACTIVATIONS", "0") != "0"
        #: each quantized matmul's input rounded to 8-bit blocks first, as llama.cpp's CPU
        #: backend rounds it (off by default: float activations, as llama.cpp's Metal)
        self.round_activations = round_activations

    # -- what and where ----------------------------------------------------------------------
    def device_name(self) -> str:
        """E.g. 'mlx gpu (Apple M4)' or 'mlx cpu (AMD EPYC, 2 cores)'."""
        info = mx.device_info()
        name = info.get("device_name") or info.get("architecture") or "?"
        if self.on_gpu:
            return f"mlx gpu ({name})"
        return f"mlx cpu ({name}, {os.cpu_count()} cores)"

    def device_memory(self) -> dict[str, int]:
        """MLX's own figures in bytes: arrays alive now (``active``), the high-water mark
        (``peak``) and freed buffers kept for reuse (``cache``)."""
        return {"active": int(mx.get_active_memory()), "peak": int(mx.get_peak_memory()),
                "cache": int(mx.get_cache_memory())}

    # -- weights -------------------------------------------------------------------------
    def prepare(self, tensor: QTensor):
        rows, cols = int(np.prod(tensor.shape[:-1])), int(tensor.shape[-1])
        affine = to_affine(tensor.data, tensor.qtype, rows, cols)
        if affine is None:  # F32/F16/BF16: dense f32
            return mx.array(np.asarray(tensor.dequantize(), np.float32).reshape(rows, cols))
        return MlxQuantWeight.from_affine(affine, tensor.qtype)

    def prepare_embedding(self, tensor: QTensor) -> HostTable:
        return HostTable(tensor)

    def prepare_vector(self, tensor: QTensor) -> mx.array:
        return mx.array(np.array(tensor.dequantize(), dtype=np.float32))

    # -- data movement -------------------------------------------------------------------
    def asarray(self, values) -> mx.array:
        if isinstance(values, mx.array):
            return values
        values = np.asarray(values)
        if values.dtype not in (np.float16, np.float32):
            values = values.astype(np.float32)
        return mx.array(values)

    def to_numpy(self, x) -> np.ndarray:
        if not isinstance(x, mx.array):
            return np.asarray(x, dtype=np.float32)
        if x.dtype != mx.float32:
            x = x.astype(mx.float32)
        return np.array(x)  # evaluates the graph behind x: the step's one mx.eval

    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> mx.array:
        return mx.zeros(shape, dtype=_DTYPES[dtype])

    def index(self, idx: np.ndarray) -> mx.array:
        return mx.array(np.asarray(idx, dtype=np.int32))

    # -- ops -----------------------------------------------------------------------------
    def embed(self, table, ids: np.ndarray) -> mx.array:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if isinstance(table, HostTable):
            return mx.array(table.rows(ids))
        if isinstance(table, MlxQuantWeight):  # (a table prepared as a matrix): its rows only
            rows = self.index(ids)
            return mx.dequantize(table.packed[rows], table.scales[rows].astype(mx.float32),
                                 table.biases[rows].astype(mx.float32),
                                 group_size=table.group_size, bits=table.bits)
        return table[self.index(ids)]

    def matmul(self, x, weight, bias=None) -> mx.array:
        return self.matmuls(x, (weight,), (bias,))[0]

    def matmuls(self, x, weights: tuple, biases: tuple | None = None) -> list:
        """x (n, in) times each weight; with ``round_activations``, x is rounded once per
        activation block size the weights need (q/k/v and gate/up share one rounding)."""
        x = self.asarray(x)  # (n, in)
        biases = biases or (None,) * len(weights)
        rounded: dict[int, mx.array] = {}
        out = []
        for w, b in zip(weights, biases, strict=True):
            xw = x
            if isinstance(w, MlxQuantWeight) and self.round_activations:
                if w.act_block not in rounded:
                    rounded[w.act_block] = round_activations(x, w.act_block)
                xw = rounded[w.act_block]
            out.append(self._multiply(xw, w, b))
        return out

    @staticmethod
    def _multiply(x: mx.array, weight, bias) -> mx.array:
        """x (n, in) @ weight.T [+ bias]: MLX's quantized matmul, or a dense one."""
        if not isinstance(weight, MlxQuantWeight):
            out = x @ weight.T
        else:
            out = mx.quantized_matmul(x, weight.packed, weight.scales, weight.biases,
                                      transpose=True, group_size=weight.group_size,
                                      bits=weight.bits)
        return out if bias is None else out + bias

    def rms_norm(self, x, weight, eps: float) -> mx.array:
        return mx.fast.rms_norm(self.asarray(x), self.asarray(weight), float(eps))

    def rope(self, x, positions, theta, neox, freq_factors=None, freq_scale=1.0) -> mx.array:
        x = self.asarray(x)  # (n, heads, hd)
        positions = np.asarray(positions)
        hd = x.shape[-1]
        if not _consecutive(positions):  # e.g. sink keys re-based all to one position
            return self._rope_by_table(x, positions, theta, neox, freq_factors, freq_scale)
        freqs = None
        if freq_factors is not None:  # mx.fast.rope takes periods: theta^(2i/hd) * factor
            freqs = mx.array((theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
                              * np.asarray(freq_factors, np.float64)).astype(np.float32))
        out = mx.fast.rope(x.transpose(1, 0, 2), hd, traditional=not neox,
                           base=None if freqs is not None else float(theta),
                           scale=float(freq_scale), offset=int(positions[0]), freqs=freqs)
        return out.transpose(1, 0, 2)  # (heads, n, hd) -> (n, heads, hd)

    def _rope_by_table(self, x, positions, theta, neox, freq_factors, freq_scale) -> mx.array:
        hd = x.shape[-1]
        cos, sin = rope_tables(positions, hd, theta, freq_factors, freq_scale)
        cos, sin = mx.array(cos)[:, None, :], mx.array(sin)[:, None, :]  # (n, 1, hd/2)
        if neox:
            a, b = x[..., : hd // 2], x[..., hd // 2:]
            return mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
        pairs = x.reshape(*x.shape[:-1], hd // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)

    def attention(self, q, k, v, mask, scale, softcap=0.0) -> mx.array:
        """q (n, H, hd), k/v (T, KVH, hd), mask (n, T) numpy bool -> (n, H, hd).

        Only the span of slots the mask reaches is read (decode early in a 4096-slot cache
        touches a few rows), and rows that see nothing give zeros, as the reference."""
        q = self.asarray(q)
        mask = np.asarray(mask, dtype=bool)
        seen = np.flatnonzero(mask.any(axis=0))
        if len(seen) == 0:
            return mx.zeros(q.shape, dtype=mx.float32)
        lo, hi = int(seen[0]), int(seen[-1]) + 1
        mask = mask[:, lo:hi]
        k = self.asarray(k)[lo:hi].astype(mx.float32).transpose(1, 0, 2)[None]  # (1,KVH,T,hd)
        v = self.asarray(v)[lo:hi].astype(mx.float32).transpose(1, 0, 2)[None]
        qh = q.transpose(1, 0, 2)[None]  # (1, H, n, hd)
        if softcap:
            out = self._attention_softcapped(qh, k, v, mx.array(mask), scale, softcap)
        elif mask.all():
            out = mx.fast.scaled_dot_product_attention(qh, k, v, scale=float(scale))
        else:
            out = mx.fast.scaled_dot_product_attention(qh, k, v, scale=float(scale),
                                                       mask=mx.array(mask))
        out = out[0].transpose(1, 0, 2)  # (n, H, hd)
        blind = ~mask.any(axis=1)
        if blind.any():
            out = mx.where(mx.array(blind)[:, None, None], 0.0, out)
        return out

    @staticmethod
    def _attention_softcapped(q, k, v, mask, scale, softcap) -> mx.array:
        """Scores capped by cap * tanh(s / cap) before the softmax (no fused kernel takes
        it): q (1, H, n, hd), k/v (1, KVH, T, hd), mask (n, T) -> (1, H, n, hd)."""
        _, n_heads, n, hd = q.shape
        n_kv = k.shape[1]
        qg = q.reshape(n_kv, n_heads // n_kv, n, hd)  # (KVH, group, n, hd)
        scores = (qg @ k[0][:, None].swapaxes(-1, -2)) * scale  # (KVH, group, n, T)
        scores = mx.tanh(scores / softcap) * softcap
        scores = mx.where(mask, scores, -np.inf)
        probs = mx.softmax(scores, axis=-1, precise=True)
        out = probs @ v[0][:, None]  # (KVH, group, n, hd)
        return out.reshape(1, n_heads, n, hd)

    def silu_mul(self, gate, up) -> mx.array:
        return _silu_mul(self.asarray(gate), self.asarray(up))

    def gelu_tanh_mul(self, gate, up) -> mx.array:
        return _gelu_tanh_mul(self.asarray(gate), self.asarray(up))

    def scale(self, x, factor: float) -> mx.array:
        return self.asarray(x) * float(factor)

    def softcap(self, x, cap: float) -> mx.array:
        return mx.tanh(self.asarray(x) / cap) * cap
