"""The op interface every backend implements.

Model code is written once against these ops. Arrays that flow between ops are the
backend's own (numpy arrays, torch tensors, mlx arrays); model code only reshapes them,
slices them and adds them with ``+``, which all three support. Weights go through
``prepare`` once at load, so a backend may repack, dequantize or upload them as it likes.

Shapes: ``n`` new tokens, ``d`` model width, ``H``/``KVH`` query/key-value heads, ``hd`` head
dim, ``T`` cached positions visible to the new tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgellm.converters.gguf_reader import QTensor

Array = Any  # the backend's own array type


@dataclass(frozen=True)
class BlockShape:
    """What a whole-block decode op needs to know of a model besides its weights."""

    d: int  # model width
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int  # MLP hidden width
    eps: float  # RMSNorm epsilon
    scale: float  # attention's query scale
    softcap: float  # attention logit soft-cap (0: none)
    neox: bool  # RoPE on halves (else adjacent pairs)
    activation: str  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)


class Backend(ABC):
    """A small set of ops; everything a transformer forward pass needs."""

    name: str = "abstract"

    def __init__(self, threads: int | None = None):
        self.threads = threads

    # -- weights -------------------------------------------------------------------------
    @abstractmethod
    def prepare(self, tensor: QTensor) -> Any:
        """A weight matrix (out, in) in whatever form ``matmul`` wants."""

    @abstractmethod
    def prepare_embedding(self, tensor: QTensor) -> Any:
        """A (vocab, d) table that ``embed`` can gather rows from."""

    def prepare_vector(self, tensor: QTensor) -> Array:
        """A small f32 tensor (norm weights, biases), as a backend array."""
        return self.asarray(tensor.dequantize())

    # -- data movement -------------------------------------------------------------------
    @abstractmethod
    def asarray(self, values: np.ndarray) -> Array:
        """A numpy array as a backend array (f32 stays f32)."""

    @abstractmethod
    def to_numpy(self, x: Array) -> np.ndarray:
        """A backend array as a float32 numpy array."""

    @abstractmethod
    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> Array:
        """A zero-filled array: the KV cache's storage (dtype "float32" or "float16")."""

    def kv_storage(self, owner: Any, layout: list[tuple[Any, tuple[int, int, int]]],
                   dtype: str) -> list[tuple[Array, Array]] | None:
        """Keys and values for a new float cache of ``owner`` (a model): one (keys, values)
        pair per layer, each of the layout's shape ``(slots, KVH, hd)`` and zero-filled; or
        None, for each layer to take ``zeros``. A backend whose graphs keep a cache's storage
        past its life (torch's) hands it to the next cache of that layout here, so no cache
        is ever held twice."""
        return None

    def index(self, idx: np.ndarray) -> Any:
        """Integer indices (n,) as this backend's arrays take them in ``a[idx]`` and
        ``a[idx] = b`` (the KV cache's slot writes): numpy's own here; MLX wants its own."""
        return idx

    def device_memory(self) -> dict[str, int] | None:
        """Bytes the backend's device holds (``active``: arrays alive now; ``peak``), where
        the backend can tell; None for host-memory backends (see RSS instead)."""
        return None

    # -- ops -----------------------------------------------------------------------------
    @abstractmethod
    def embed(self, table: Any, ids: np.ndarray) -> Array:
        """Rows ``ids`` (n,) of the embedding table -> (n, d) f32."""

    @abstractmethod
    def matmul(self, x: Array, weight: Any, bias: Array | None = None) -> Array:
        """x (n, in) @ weight.T (in, out) [+ bias] -> (n, out)."""

    def matmuls(self, x: Array, weights: tuple, biases: tuple | None = None) -> list[Array]:
        """``[matmul(x, w, b) for w, b in zip(weights, biases)]``: several projections of the
        same input (Q/K/V, gate/up), which a backend may run as one job."""
        biases = biases or (None,) * len(weights)
        return [self.matmul(x, w, b) for w, b in zip(weights, biases, strict=True)]

    @abstractmethod
    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """RMS-normalise the last axis, then scale by weight (last-axis sized)."""

    @abstractmethod
    def rope(self, x: Array, positions: np.ndarray, theta: float, neox: bool,
             freq_factors: np.ndarray | None = None, freq_scale: float = 1.0) -> Array:
        """Rotary embedding over the last axis of x (n, heads, hd) at positions (n,).

        ``neox`` rotates halves (x[i], x[i + hd/2]); otherwise adjacent pairs (x[2i], x[2i+1]),
        as ggml's NEOX and NORM modes. ``freq_factors`` (hd/2,) divide the frequencies (Llama 3).
        """

    def rope_qk(self, q: Array, k: Array, positions: np.ndarray, theta: float, neox: bool,
                freq_factors: np.ndarray | None = None, freq_scale: float = 1.0,
                norms: tuple | None = None) -> tuple[Array, Array]:
        """``rope`` of queries q (n, H, hd) and keys k (n, KVH, hd) at the same positions,
        each head RMS-normalised first where ``norms`` = (q weight, k weight, eps) is given
        (Gemma 3, Qwen3); a device backend does all of it in one launch."""
        if norms is not None:
            q_norm, k_norm, eps = norms
            q, k = self.rms_norm(q, q_norm, eps), self.rms_norm(k, k_norm, eps)
        return (self.rope(q, positions, theta, neox, freq_factors, freq_scale),
                self.rope(k, positions, theta, neox, freq_factors, freq_scale))

    def project_qkv(self, x: Array, weights: tuple, biases: tuple, heads: tuple[int, int, int],
                    positions: np.ndarray, theta: float, neox: bool,
                    freq_factors: np.ndarray | None = None, freq_scale: float = 1.0,
                    norms: tuple | None = None) -> tuple[Array, Array, Array]:
        """Attention's inputs from x (n, d): queries (n, H, hd), keys and values (n, KVH,
        hd), heads = (H, KVH, hd); ``weights`` and ``biases`` are Q's, K's and V's. The three
        projections (``matmuls``), then ``rope_qk`` of q and k; a device backend may rotate
        in the projections' own launch."""
        n = x.shape[0]
        n_heads, n_kv_heads, hd = heads
        q, k, v = self.matmuls(x, weights, biases)
        q, k = self.rope_qk(q.reshape(n, n_heads, hd), k.reshape(n, n_kv_heads, hd), positions,
                            theta, neox, freq_factors, freq_scale, norms)
        return q, k, v.reshape(n, n_kv_heads, hd)

    def residual(self, x: Array, h: Array, eps: float, h_norm: Array | None = None,
                 out_norm: Array | None = None) -> tuple[Array, Array | None]:
        """A residual sublayer's end: ``x + h`` (h RMS-normalised by ``h_norm`` first, where
        given: Gemma's post-norms), and the sum RMS-normalised by ``out_norm`` (the next
        sublayer's input; None where not given). A device backend does it in one launch."""
        if h_norm is not None:
            h = self.rms_norm(h, h_norm, eps)
        x = x + h
        return x, (self.rms_norm(x, out_norm, eps) if out_norm is not None else None)

    @abstractmethod
    def attention(self, q: Array, k: Array, v: Array, mask: np.ndarray, scale: float,
                  softcap: float = 0.0) -> Array:
        """Softmax attention with grouped KV heads.

        q (n, H, hd), k/v (T, KVH, hd), mask (n, T) bool (True = visible) -> (n, H, hd).
        """

    def attention_batch(self, q: Array, parts: Sequence[tuple[Array, Array, np.ndarray]],
                        scale: float, softcap: float = 0.0) -> Array:
        """Attention for several sequences at once, each against its own keys.

        q (N, H, hd) holds the sequences' rows one after another; ``parts`` is one
        (k (T_j, KVH, hd), v, mask (n_j, T_j)) per sequence, its mask's rows giving how many
        of q's rows are its. -> (N, H, hd). Each row's result is what ``attention`` gives it
        (backends override this to do the batch in one call)."""
        out = self.zeros(tuple(q.shape), "float32")  # (N, H, hd)
        row = 0
        for k, v, mask in parts:
            n = mask.shape[0]
            out[row:row + n] = self.attention(q[row:row + n], k, v, mask, scale, softcap)
            row += n
        return out

    def attention_append(self, q: Array, k: Array, v: Array,
                         stores: Sequence[tuple[Array, Array]], slots: Sequence[int],
                         firsts: Sequence[int], scale: float, softcap: float = 0.0) -> Array:
        """A decode step's attention with each sequence's new key and value stored first.

        Row j of q (N, H, hd) and of k, v (N, KVH, hd) is sequence j's one new token: k[j]
        and v[j] go to slot ``slots[j]`` of its storage ``stores[j]`` (keys, values: (S_j,
        KVH, hd)), and q[j] attends to slots ``firsts[j]..slots[j]``. -> (N, H, hd), what
        writing the rows and ``attention_batch`` give (backends override this to do the
        whole layer in one call)."""
        parts = []
        for j, ((keys, values), slot, first) in enumerate(zip(stores, slots, firsts,
                                                              strict=True)):
            keys[slot], values[slot] = k[j], v[j]
            mask = np.zeros((1, slot + 1), dtype=bool)  # (1, T): keys first..slot
            mask[0, first:] = True
            parts.append((keys[:slot + 1], values[:slot + 1], mask))
        return self.attention_batch(q, parts, scale, softcap)

    # -- a decode step's blocks in one call (optional) --------------------------------------
    def prepare_decode_block(self, block: Any, shape: BlockShape) -> Any | None:
        """``block``'s weights (a model Block: norms, attention and MLP matrices) made ready
        for ``decode_blocks``, or None where this backend runs the block op by op (the
        default)."""
        return None

    def decode_blocks(self, plans: Sequence[Any], x: Array, positions: np.ndarray,
                      ropes: Sequence[tuple[float, float, np.ndarray | None]],
                      stores: Sequence[Sequence[tuple[Array, Array]]],
                      claim: Callable[[], tuple[list[int], list[int]]]) -> Array | None:
        """One decode step of consecutive blocks whose ``prepare_decode_block`` gave
        ``plans``: x (N, d) holds one new token of each of N sequences, at ``positions``;
        per block, ``ropes`` has its (theta, freq_scale, freq_factors) and ``stores`` each
        sequence's (keys, values) storage. ``claim()`` books every block's slot of every
        sequence and returns (slots, firsts), block-major, as ``attention_append`` takes
        them; it is called once, only when the blocks will run. -> x after the last block,
        the op path's result to the bit; None (nothing claimed or written) where this step
        cannot run this way."""
        return None

    @abstractmethod
    def silu_mul(self, gate: Array, up: Array) -> Array:
        """silu(gate) * up (SwiGLU)."""

    @abstractmethod
    def gelu_tanh_mul(self, gate: Array, up: Array) -> Array:
        """gelu_tanh(gate) * up (GeGLU)."""

    def gated_projection(self, x: Array, w_gate: Any, w_up: Any, gelu: bool) -> Array:
        """An MLP's input side: act(x @ w_gate.T) * (x @ w_up.T), act gelu_tanh (``gelu``)
        or silu; a device backend does it in one launch."""
        gate, up = self.matmuls(x, (w_gate, w_up))
        return self.gelu_tanh_mul(gate, up) if gelu else self.silu_mul(gate, up)

    def scale(self, x: Array, factor: float) -> Array:
        return x * factor

    def softcap(self, x: Array, cap: float) -> Array:
        """cap * tanh(x / cap): Gemma-style logit soft-capping."""
        return self.asarray(np.tanh(self.to_numpy(x) / cap) * cap)
