"""The torch backend: every Backend op in torch, on CUDA (device "auto" picks it when there is
one) or on the CPU.

On CUDA the weights stay quantized: each matrix is repacked at load into the planes of
``packing.py`` (the file's own numbers, laid out for wide loads), read by the triton kernels of
``kernels.py``: an int8 mat-vec for up to 8 tokens (decode, speculative checks), dequantization
to f16 tiles for a cuBLAS GEMM above that (prefill); neighbouring projections of one type (Q
and K, gate and up) run as one stacked matrix. Activations are rounded to 8-bit blocks before
every quantized matmul, as llama.cpp rounds them. Attention over the f16 cache with its mask
(sliding windows included): flash-decoding kernels up to 8 queries, SDPA in f32 above. The KV
cache lives on the device; decode steps and prompt slices replay CUDA graphs (``graphs.py``).

On the CPU (tests, or machines without CUDA) weights are dequantized once to f32 for torch's
BLAS (embedding tables stay the file's blocks, rows dequantized on lookup), with the same
activation rounding; the triton kernels are tested against the numpy reference under
``TRITON_INTERPRET=1``, and ``triton=True`` runs the whole GPU path in that interpreter.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from edgellm.converters.gguf_reader import QTensor
from edgellm.quants import Q, dequantize

from ..base import Backend
from ..numpy_backend import (
    attention_like_ggml,
    geglu_like_ggml,
    rms_norm_like_ggml,
    rope_like_ggml,
    rope_tables_like_ggml,
)
from . import tuning
from .packing import CHUNK, K_QUANTS, KINDS, Planes, pack, stack_rows

_MAGIC = 12582912.0  # see kernels._MAGIC
#: Activations are rounded to 8-bit blocks before every quantized matmul, as llama.cpp
#: rounds them: Q8_0 blocks of 32, and against K-quant weights Q8_K blocks of 256 (its CPU
#: backend, which made the reference outputs) when this is True. Measured on CPU torch
#: against the references: per 256, Qwen2.5-1.5B meets every bound; per 32 for every type
#: (llama.cpp's CUDA q8_1 blocks) its first position (activations in the thousands, where
#: llama.cpp's logits are those of 256-blocks) misses by a 3.4-logit margin.
K_QUANT_ACTS_PER_256 = True


@dataclass
class TorchWeight:
    """A weight matrix (rows, cols): packed planes (quantized types) or a dense tensor."""

    qtype: Q
    rows: int
    cols: int
    planes: Planes | None = None
    dense: torch.Tensor | None = None  # f32 (CPU, or float types)
    blocks: np.ndarray | None = None  # the file's blocks (CPU embedding tables)

    @property
    def quantized(self) -> bool:
        return self.qtype in KINDS

    @property
    def nbytes(self) -> int:
        total = self.planes.nbytes if self.planes is not None else 0
        if self.dense is not None:
            total += self.dense.numel() * self.dense.element_size()
        return total


def round_activations_torch(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x (n, K) f32 rounded to 8-bit blocks (torch ops; the triton kernel does the same in one
    launch): x86 Q8_0 per 32 (q = rint(x * 127/amax), d = f16(amax/127)), or Q8_K per 256
    (iscale = -127/peak, q = min(127, rint(x * iscale)), d = 1/iscale)."""
    n, K = x.shape
    xb = x.reshape(n, K // block, block)
    peak = torch.gather(xb, -1, xb.abs().argmax(-1, keepdim=True))  # signed, largest |x|
    empty = peak == 0
    safe = torch.where(empty, torch.ones_like(peak), peak)
    def div(a: float, b: torch.Tensor) -> torch.Tensor:  # IEEE a / b (a scalar / tensor
        return torch.full_like(b, a) / b  # may run as a * (1 / b): 1 ulp off)

    if block == 256:
        iscale = div(-127.0, safe)
        q = torch.clamp(((xb * iscale) + _MAGIC) - _MAGIC, max=127.0)
        scale = torch.where(empty, torch.zeros_like(peak), div(1.0, iscale))
    else:
        amax = safe.abs()
        q = ((xb * div(127.0, amax)) + _MAGIC) - _MAGIC
        scale = torch.where(empty, torch.zeros_like(peak), amax / torch.full_like(amax, 127.0))
        scale = scale.half().float()
    return (q * scale).reshape(n, K)


class KVStorage(torch.Tensor):
    """A KV cache's storage tensor: ``store[slots] = k`` converts k to the storage's dtype
    (f32 keys into an f16 cache), as numpy's item assignment does."""

    def __setitem__(self, idx, value):
        if isinstance(value, torch.Tensor) and value.dtype != self.dtype:
            value = value.to(self.dtype)
        super().__setitem__(idx, value)


def _stackable(a: TorchWeight, b: TorchWeight) -> bool:
    """Can b's rows follow a's in one packed matrix (same block type and width)?"""
    return (a.planes is not None and b.planes is not None and a.qtype == b.qtype
            and a.cols == b.cols and a is not b)


#: the decode fusions EDGELLM_UNFUSE may turn off: the output projection's blocks written
#: by attention, the gate+up mat-vec's GLU, the KV write in attention's launch, two block
#: types' mat-vecs of one input in one launch (``_joined``), RoPE in the Q+K+V mat-vec
#: (``project_qkv``)
FUSIONS = ("attention_blocks", "glu", "kv_write", "join", "rope")


def _unfused(names: str) -> frozenset[str]:
    """EDGELLM_UNFUSE's comma-separated fusion names, checked against FUSIONS."""
    off = frozenset(n.strip() for n in names.split(",") if n.strip())
    if unknown := off - set(FUSIONS):
        raise ValueError(f"EDGELLM_UNFUSE: unknown fusion {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(FUSIONS)})")
    return off


def _mm_writes_f32(device: torch.device) -> bool:
    """Can ``torch.mm`` on this device write f32 from f16 inputs (``out_dtype``: cuBLAS's
    f32-output GEMM, torch >= 2.8 on CUDA)?"""
    a = torch.ones((2, 8), dtype=torch.float16, device=device)
    try:
        return torch.mm(a, a.T, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _same_memory(made: torch.Tensor | None, x: torch.Tensor) -> bool:
    """Is x the tensor ``made`` or a contiguous view of all of it with the same rows (the
    model's reshape of an op's output, (n, H, hd) -> (n, H * hd))? The caller keeps ``made``
    alive, so no other tensor can hold its memory."""
    return made is x or (made is not None and x.data_ptr() == made.data_ptr()
                         and x.numel() == made.numel() and x.shape[0] == made.shape[0]
                         and x.dtype == made.dtype and x.is_contiguous()
                         and made.is_contiguous())


def _plain(x: torch.Tensor) -> torch.Tensor:
    return x.as_subclass(torch.Tensor) if type(x) is not torch.Tensor else x


class TorchBackend(Backend):
    """Backend ops in torch. ``device``: "auto" (cuda when available), "cuda" or "cpu".

    ``triton=True`` on the CPU runs the GPU path (packed weights, triton kernels) in triton's
    interpreter (``TRITON_INTERPRET=1`` before triton is imported): slow, for tests only.
    ``graphs``: replay decode steps and prompt slices as CUDA graphs (default: on CUDA, unless
    EDGELLM_CUDA_GRAPHS=0); on the CPU the same static-buffer steps run eagerly (tests).

    CPU torch (without triton) follows llama.cpp's CPU arithmetic by default, as the cpu
    backend does (``ggml_numerics``): besides the 8-bit activations of every backend, RMS
    norm, RoPE, attention over an f16 cache and the GeGLU's GELU are numpy-ggml's functions
    (zero-copy on CPU tensors). Measured against the references, teacher-forced: Gemma 3
    346/356 in one pass (341 in plain f32) and 345 token by token; Qwen2.5-1.5B token by
    token 108/111 (107).
    """

    name = "torch"

    def __init__(self, threads: int | None = None, device: str = "auto", triton: bool = False,
                 graphs: bool | None = None, ggml_numerics: bool | None = None):
        super().__init__(threads)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError("torch backend: CUDA requested but torch sees no GPU")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:  # prefill's f16 GEMMs: f32 partial sums (cuBLAS may otherwise split K
            # into f16 partials, ~1e-2 off at the logits)
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
            # cuBLAS's workspace: 16 MiB, not Hopper's default 32, unless the user chose one
            # (read at the process's first cuBLAS call). On an H200, Gemma 3 270M's peak went
            # 321 -> 304 MB (1.21x -> 1.15x of GGUF + KV) and its pp512 stayed (44.4k/40.8k
            # against 43.3k/40.6k t/s, alternating); 8 MiB cost its pp512 12%
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:4")
        if threads and not self.cuda:
            torch.set_num_threads(int(threads))
        self.threads = int(threads or torch.get_num_threads())
        self.kernels = None
        if triton and not self.cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("torch backend: triton on the CPU needs TRITON_INTERPRET=1")
        if self.cuda or triton:
            from . import kernels

            self.kernels = kernels
        # prefill GEMMs over dequantized weights: f16 on a GPU (CPU f16 GEMMs are slow),
        # writing f32 where this torch's cuBLAS GEMM can (no cast launch after each one;
        # None: not yet probed, ``gemm_writes_f32``)
        self._gemm_dtype = torch.float16 if self.cuda else torch.float32
        self._gemm_writes_f32 = (None if self.cuda and os.environ.get("EDGELLM_GEMM_F32_OUT",
                                                                      "1") != "0" else False)
        self.ggml_numerics = self.kernels is None if ggml_numerics is None else ggml_numerics
        if self.ggml_numerics and self.kernels is not None:
            raise ValueError("torch backend: ggml_numerics is for CPU torch without triton")
        self._tables: dict[tuple, TorchWeight] = {}  # embedding tables by tensor identity
        self._consts: dict[tuple, torch.Tensor] = {}  # rope frequencies etc., on the device
        self._rope_memo: tuple = (None, {})  # (positions object, {params: (cos, sin)})
        self._stacks: dict[tuple, tuple] = {}  # matmuls' weight ids -> (weights, _stacked plan)
        self._joins: dict[tuple, tuple] = {}  # a plan's weight ids -> _joined's (a, b, bias)
        # the last norm or GLU output quantized in its own launch: (tensor, {block: blocks})
        self._prequantized: tuple = (None, {})
        # False while attention_batch copies its parts' outputs (blocks would be dropped)
        self._attention_blocks = True
        #: norms and GLUs of <= 8 tokens also write their output's 8-bit blocks (GPU path)
        self.fuse_quantize = os.environ.get("EDGELLM_FUSE_QUANTIZE", "1") != "0"
        # Q/K norms + RoPE, and a sublayer's residual add + norms, one launch each
        self.fuse_launches = os.environ.get("EDGELLM_FUSE_LAUNCHES", "1") != "0"
        #: decode fusions turned off one by one (EDGELLM_UNFUSE=glu,kv_write: A/B runs)
        self.unfused = _unfused(os.environ.get("EDGELLM_UNFUSE", ""))
        #: a prompt's GEMM: W's tiles dequantized inside one triton kernel (True: no f16
        #: copy of W, no dequantize launch), or W dequantized for torch's GEMM (False), or
        #: on a GPU whichever is faster for the shape, timed at its first use (None; the
        #: GEMM where nothing is timed). EDGELLM_FUSED_GEMM=1 / 0 forces one
        self.fused_gemm = {"1": True, "0": False}.get(os.environ.get("EDGELLM_FUSED_GEMM", ""))
        self.graphs = None
        if graphs is None:
            graphs = self.cuda and os.environ.get("EDGELLM_CUDA_GRAPHS", "1") != "0"
        if graphs:
            from .graphs import StepGraphs

            self.graphs = StepGraphs(self)

    # -- weights -------------------------------------------------------------------------
    def _weight(self, tensor: QTensor, lookups: bool = False) -> TorchWeight:
        """Packed planes on the GPU path; on the CPU an f32 copy for BLAS, or for an
        embedding table (``lookups``) the file's blocks, rows dequantized on lookup."""
        rows, cols = int(np.prod(tensor.shape[:-1])), int(tensor.shape[-1])
        w = TorchWeight(tensor.qtype, rows, cols)
        if tensor.qtype in KINDS and self.kernels is not None:
            w.planes = pack(tensor.data.reshape(rows, -1), tensor.qtype, rows,
                            cols).upload(self.device)
        elif tensor.qtype in KINDS and lookups:
            w.blocks = tensor.data.reshape(rows, -1)
        else:
            w.dense = self._dense(tensor, rows, cols)
        return w

    def _dense(self, tensor: QTensor, rows: int, cols: int) -> torch.Tensor:
        values = dequantize(tensor.data.reshape(rows, -1), tensor.qtype).reshape(rows, cols)
        return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(self.device)

    @staticmethod
    def _key(tensor: QTensor) -> tuple:
        return (int(tensor.data.ctypes.data), tensor.data.shape, int(tensor.qtype))

    def prepare(self, tensor: QTensor) -> TorchWeight:
        w = self._tables.get(self._key(tensor))  # a tied output: the embedding's own planes
        if w is None:
            return self._weight(tensor)
        if w.planes is None and w.dense is None:  # CPU: the tied table as f32 for BLAS too
            w.dense = self._dense(tensor, w.rows, w.cols)
        return w

    def prepare_embedding(self, tensor: QTensor) -> TorchWeight:
        w = self._weight(tensor, lookups=True)
        self._tables[self._key(tensor)] = w
        return w

    def prepare_vector(self, tensor: QTensor) -> torch.Tensor:
        return self.asarray(np.array(tensor.dequantize(), dtype=np.float32))

    # -- data movement -------------------------------------------------------------------
    def asarray(self, values) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            return values.to(self.device)
        a = np.asarray(values)
        a = np.ascontiguousarray(a, dtype=np.float16 if a.dtype == np.float16 else np.float32)
        return torch.from_numpy(a).to(self.device)

    def to_numpy(self, x) -> np.ndarray:
        if isinstance(x, torch.Tensor):
            return x.detach().to(torch.float32).cpu().numpy()
        return np.asarray(x, dtype=np.float32)

    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> torch.Tensor:
        t = torch.zeros(shape, dtype=getattr(torch, dtype), device=self.device)
        return t.as_subclass(KVStorage)

    def kv_storage(self, owner, layout, dtype: str):
        """With graphs: a new cache's storage in the graphs' own tensors (``StepGraphs.
        storage_for``), so that a graph takes or hands on a cache's storage, never a copy."""
        if self.graphs is None:
            return None
        return self.graphs.storage_for(owner, layout, getattr(torch, dtype))

    def index(self, idx) -> torch.Tensor:
        """Integer indices as a device int64 tensor (the cache's slot writes)."""
        return self._index(idx)

    def device_memory(self) -> dict[str, int] | None:
        if not self.cuda:
            return None
        return {"active": int(torch.cuda.memory_allocated(self.device)),
                "peak": tuning.peak_memory(self.device)}

    def tuning_seconds(self) -> float:
        """Seconds this process spent timing kernel variants on this device (``tuning.py``)."""
        tuner = tuning.tuner_for(self.device) if self.kernels is not None else None
        return tuner.seconds if tuner is not None else 0.0

    def write_rows(self, dst: torch.Tensor, rows, src) -> None:
        """dst[rows] = src, converted to dst's dtype (the KV cache's writes)."""
        idx = self._index(rows)
        dst.index_copy_(0, idx, self.asarray(src).to(dst.dtype))

    def _index(self, ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            return ids.to(self.device, torch.int64)
        return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)).to(
            self.device)

    # -- ops -----------------------------------------------------------------------------
    def embed(self, table: TorchWeight, ids) -> torch.Tensor:
        if table.planes is not None:
            return self.kernels.dequantize(table.planes, torch.float32, self._index(ids))
        if table.blocks is not None:  # CPU: only the rows looked up are dequantized
            ids = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else ids, np.int64)
            return self.asarray(dequantize(table.blocks[ids.reshape(-1)], table.qtype))
        return table.dense[self._index(ids)]

    @staticmethod
    def _act_block(qtype: Q) -> int:
        """Activation block against a weight type (0: not rounded)."""
        if qtype not in KINDS:
            return 0
        return 256 if qtype in K_QUANTS and K_QUANT_ACTS_PER_256 else 32

    def _activations(self, x: torch.Tensor, w: TorchWeight, done: dict):
        """x as ``w`` multiplies it: as is (float weights), rounded to 8-bit blocks (f32, for
        a GEMM), or as int8 blocks ``(xq, xd)`` for the mat-vec; once per group (``done``)."""
        block = self._act_block(w.qtype)
        if not block:
            return x
        matvec = w.planes is not None and x.shape[0] <= self.kernels.MATVEC_MAX_TOKENS
        key = (block, w.planes.padded if matvec else 0)
        made_with, blocks = self._prequantized
        if matvec and key not in done and _same_memory(made_with, x) and block in blocks:
            done[key] = blocks[block]  # quantized by the norm, GLU or attention that made x
        if key not in done:
            if matvec:
                done[key] = self.kernels.quantize_activations(x, block, w.planes.padded)
            elif self.kernels is not None:  # the GEMM's input, in its dtype
                done[key] = self.kernels.round_activations(x, block, self._gemm_dtype)
            else:
                done[key] = round_activations_torch(x, block)
        return done[key]

    def matmul(self, x, weight: TorchWeight, bias=None) -> torch.Tensor:
        x = self.asarray(x).contiguous()
        return self._multiply(self._activations(x, weight, {}), weight, bias)

    def matmuls(self, x, weights: tuple, biases: tuple | None = None) -> list:
        """Several projections of one input, its activations rounded once per block size;
        on the GPU path's mat-vec neighbours of one block type run as one (``_stacked``),
        and two of different types that take the same blocks too (``_joined``). A
        prompt's GEMMs take them one by one: one member's f16 tile alive at a time (the
        peak memory), and inside a graph a launch costs little."""
        x = self.asarray(x).contiguous()
        biases = biases or (None,) * len(weights)
        return self._run_plan(x, self._stacked(tuple(weights), tuple(biases)))

    def _run_plan(self, x, plan: list, rope: tuple | None = None) -> list:
        """Each weight's product of a ``_stacked`` plan, in the weights' order: a joined
        pair in one mat-vec launch, a stack's in one, a prompt's GEMMs member by member.
        ``rope`` (``kernels.qmatvec``'s; ``project_qkv``'s plans only): the first entry's
        mat-vec rotates its Q and K rows."""
        done: dict = {}
        if (joined := self._joined(plan)) is not None:
            xa = self._activations(x, plan[0][0], done)
            if isinstance(xa, tuple):  # the int8 mat-vec: both block types in one launch
                a, b, bias = joined
                out = self.kernels.qmatvec_joined(*xa, a.planes, b.planes, bias, rope=rope)
                rows = [m.rows for w, _, members in plan for m, _ in members or ((w, None),)]
                return list(torch.split(out, rows, dim=1))
        outs = []
        for i, (w, b, members) in enumerate(plan):
            xa = self._activations(x, w, done)
            if members is None:
                outs.append(self._multiply(xa, w, b))
            elif isinstance(xa, tuple):  # the int8 mat-vec: the stack in one launch
                out = self.kernels.qmatvec(*xa, w.planes, b, rope=rope if i == 0 else None)
                outs += list(torch.split(out, [m.rows for m, _ in members], dim=1))
            else:
                outs += [self._multiply(xa, m, mb) for m, mb in members]
        return outs

    def project_qkv(self, x, weights, biases, heads, positions, theta, neox,
                    freq_factors=None, freq_scale=1.0, norms=None):
        """On the GPU path, up to 8 tokens, Q and K stacked first and no Q/K norms: RoPE
        in the stack's mat-vec launch, each program rotating the pairs of rows it took
        (``kernels.qmatvec(rope=...)``), V's rows in the same launch where they are the
        stack's or joined to it (``_joined``); else the projections, then ``rope_qk``."""
        x = self.asarray(x)
        plan = self._rotatable(x, tuple(weights), tuple(biases), heads, norms)
        if plan is None:
            return super().project_qkv(x, weights, biases, heads, positions, theta, neox,
                                       freq_factors, freq_scale, norms)
        n, (n_heads, n_kv_heads, hd) = x.shape[0], heads
        cos, sin = self.rope_tables(positions, hd, theta, freq_factors, freq_scale)
        # (joined: one launch; else the stack's, then V's apart: EDGELLM_UNFUSE=join)
        q, k, v = self._run_plan(x.contiguous(), plan,
                                 rope=(cos, sin, (n_heads + n_kv_heads) * hd, neox))
        return (q.reshape(n, n_heads, hd), k.reshape(n, n_kv_heads, hd),
                v.reshape(n, n_kv_heads, hd))

    def _rotatable(self, x, weights: tuple, biases: tuple, heads: tuple,
                   norms) -> list | None:
        """``project_qkv``'s plan where its mat-vec can rotate Q and K (see there), else
        None: Q and K are the first rows of the plan's first matrix (one stack with V, or
        a stack beside V's matrix), K unsplit, and the angles' pairs whole (a power of two
        head size, as ``rope_qk``'s kernel takes)."""
        hd = heads[2]
        if (not self._fused() or "rope" in self.unfused or norms is not None
                or x.dim() != 2 or x.shape[0] > self.kernels.MATVEC_MAX_TOKENS
                or hd & (hd - 1)):
            return None
        plan = self._stacked(weights, biases)
        first, _, members = plan[0]
        if (members is None or members[0][0] is not weights[0] or members[1][0] is not weights[1]
                or first.planes.padded // CHUNK >= self.kernels.SPLIT_MIN_CHUNKS
                or len(plan) > 2):
            return None
        return plan

    def _stacked(self, weights: tuple, biases: tuple) -> list:
        """(weight, bias, members or None) per matmul that ``matmuls`` runs: neighbouring
        packed matrices of one block type and width stacked into one (Q and K, gate and up: a
        launch less each, and a fuller GPU), once, at their first call; the members'
        planes become views of the stack's rows (no second copy). Stacking is skipped while
        a CUDA graph is being captured (it allocates), and on the CPU's dense path."""
        key = tuple(id(w) for w in weights)
        known = self._stacks.get(key)
        if known is not None:
            return known[1]
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return [(w, b, None) for w, b in zip(weights, biases, strict=True)]
        plan, i = [], 0
        while i < len(weights):
            j = i + 1
            while j < len(weights) and _stackable(weights[i], weights[j]):
                j += 1
            if j - i == 1:
                plan.append((weights[i], biases[i], None))
            else:
                plan.append(self._stack(weights[i:j], biases[i:j]))
            i = j
        self._stacks[key] = (weights, plan)  # the weights kept: their ids stay theirs
        return plan

    def _joined(self, plan: list) -> tuple | None:
        """For a ``_stacked`` plan of two mat-vecs of different block types that one input's
        8-bit blocks serve (the 1.5B's Q+K in Q4_K and V in Q6_K, half its layers; the
        0.5B's Q5_0 and Q8_0): (a, b, bias or None) for ``kernels.qmatvec_joined``'s one
        launch (a launch less a layer); else None. Made once, outside a CUDA graph's
        capture (the bias allocates)."""
        if len(plan) != 2 or not self._fused() or "join" in self.unfused:
            return None
        key = tuple(id(w) for w, _, _ in plan)
        if key in self._joins:
            return self._joins[key]
        (a, ba, _), (b, bb, _) = plan
        if (a.planes is None or b.planes is None or a.qtype == b.qtype
                or self._act_block(a.qtype) != self._act_block(b.qtype)
                or not self.kernels.joinable(a.planes, b.planes)
                or (self.cuda and torch.cuda.is_current_stream_capturing())):
            return None
        bias = self._joined_biases((a, b), (ba, bb))
        joined = self._joins[key] = (a, b, bias)  # the weights kept: their ids stay theirs
        return joined

    def _stack(self, weights: tuple, biases: tuple) -> tuple:
        whole, views = stack_rows([w.planes for w in weights], torch.cat)
        for w, view in zip(weights, views, strict=True):
            w.planes = view
        first = weights[0]
        stacked = TorchWeight(first.qtype, whole.rows, first.cols, planes=whole)
        bias = self._joined_biases(weights, biases)
        return stacked, bias, tuple(zip(weights, biases, strict=True))

    def _joined_biases(self, weights: tuple, biases: tuple) -> torch.Tensor | None:
        """The biases of matrices whose rows one launch writes one after another, as one
        (zeros for a matrix without); None where none has one."""
        if all(b is None for b in biases):
            return None
        return torch.cat([b if b is not None else torch.zeros(w.rows, device=self.device)
                          for w, b in zip(weights, biases, strict=True)])

    def _multiply(self, xa, w: TorchWeight, bias) -> torch.Tensor:
        """xa (as ``_activations`` prepared it) @ w.T (+ bias)."""
        if isinstance(xa, tuple):  # int8 blocks: the mat-vec (<= 8 tokens)
            return self.kernels.qmatvec(*xa, w.planes, bias)
        if w.dense is not None:
            out = xa @ w.dense.T
            return out + bias if bias is not None else out
        return self.kernels.prompt_matmul(xa.to(self._gemm_dtype), w.planes, bias,
                                          self.fused_gemm, self.gemm_writes_f32())

    def gemm_writes_f32(self) -> bool:
        """Does a prompt's cuBLAS GEMM write its f32 sums (``_mm_writes_f32``)? Probed at
        the first GEMM, not at load: the probe's GEMM makes cuBLAS a workspace for the
        stream it runs on, and at load that was the default stream, which a model's steps
        (warmed up and captured on the graphs' own stream) never use. A loaded Gemma 3 held
        exactly 16 MiB more than its weights on an H100, that workspace by its size. (The
        first GEMM runs in a graph's warm-up, never in a capture, which repeats it.)"""
        if self._gemm_writes_f32 is None:
            self._gemm_writes_f32 = _mm_writes_f32(self.device)
        return self._gemm_writes_f32

    def _like_ggml(self, fn, *args) -> torch.Tensor:
        """numpy-ggml's ``fn`` over CPU tensors (numpy views of them, no copies)."""
        arrays = [_plain(a).numpy() if isinstance(a, torch.Tensor) else a for a in args]
        return torch.from_numpy(np.ascontiguousarray(fn(*arrays), dtype=np.float32))

    def rms_norm(self, x, weight, eps: float) -> torch.Tensor:
        x = self.asarray(x)
        if self.ggml_numerics:
            return self._like_ggml(rms_norm_like_ggml, x, weight, eps)
        if self.kernels is not None and x.is_contiguous():
            if self._quantizes_after(x):
                return self._then_quantize("norm", x, weight, eps)
            return self.kernels.rms_norm(x, weight, eps)
        ms = x.square().mean(-1, keepdim=True)
        return x / torch.sqrt(ms + eps) * weight

    def _device_const(self, key: tuple, make) -> torch.Tensor:
        t = self._consts.get(key)
        if t is None:
            t = self._consts[key] = torch.from_numpy(make()).to(self.device)
        return t

    def rope_tables(self, positions, hd: int, theta: float, freq_factors=None,
                    freq_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (n, hd/2) f32 of positions (n,) (numpy, or a device tensor under CUDA
        graphs), angles in f64 (ggml's f32 recurrence with ``ggml_numerics``); memoized for
        the step (every layer's positions object)."""
        memo_pos, memo = self._rope_memo
        if memo_pos is not positions:
            memo = {}
            self._rope_memo = (positions, memo)
        ff_key = None if freq_factors is None else id(freq_factors)
        key = (hd, float(theta), float(freq_scale), ff_key)
        if key in memo:
            return memo[key]

        def inv_freq():
            f = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd) * freq_scale
            if freq_factors is not None:
                f = f / np.asarray(freq_factors, dtype=np.float64)
            return f

        if self.ggml_numerics:  # CPU tensors
            pos = positions.numpy() if isinstance(positions, torch.Tensor) else positions
            tables = tuple(torch.from_numpy(t) for t in rope_tables_like_ggml(
                np.asarray(pos), hd, theta, freq_factors, freq_scale))
        elif isinstance(positions, torch.Tensor):
            freqs = self._device_const(("inv_freq",) + key, inv_freq)
            angles = positions.to(torch.float64)[:, None] * freqs[None, :]
            tables = (torch.cos(angles).float(), torch.sin(angles).float())
        else:
            angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq()[None, :]
            tables = (self.asarray(np.cos(angles)), self.asarray(np.sin(angles)))
        memo[key] = tables
        return tables

    def rope(self, x, positions, theta, neox, freq_factors=None, freq_scale=1.0):
        x = self.asarray(x)
        hd = x.shape[-1]
        cos, sin = self.rope_tables(positions, hd, theta, freq_factors, freq_scale)
        if self.ggml_numerics:
            return self._like_ggml(rope_like_ggml, x, cos[:, None, :], sin[:, None, :], neox)
        if self.kernels is not None:
            return self.kernels.rope(x.contiguous(), cos, sin, neox)
        cos, sin = cos[:, None, :], sin[:, None, :]  # (n, 1, hd/2)
        if neox:
            a, b = x[..., : hd // 2], x[..., hd // 2:]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).reshape(x.shape)

    def _fused(self) -> bool:
        """Do the triton kernels run this op (not ggml's CPU arithmetic, not plain torch)?"""
        return self.kernels is not None and not self.ggml_numerics and self.fuse_launches

    def rope_qk(self, q, k, positions, theta, neox, freq_factors=None, freq_scale=1.0,
                norms=None):
        q, k = self.asarray(q), self.asarray(k)
        hd = q.shape[-1]
        if not self._fused() or q.dim() != 3 or hd & (hd - 1):
            return super().rope_qk(q, k, positions, theta, neox, freq_factors, freq_scale,
                                   norms)
        cos, sin = self.rope_tables(positions, hd, theta, freq_factors, freq_scale)
        return self.kernels.rope_qk(q.contiguous(), k.contiguous(), cos, sin, neox, norms)

    def residual(self, x, h, eps, h_norm=None, out_norm=None):
        x, h = self.asarray(x), self.asarray(h)
        if not self._fused() or x.dim() != 2 or (h_norm is None and out_norm is None):
            return super().residual(x, h, eps, h_norm, out_norm)
        quantize = out_norm is not None and self._quantizes_after(x)
        total, normed, blocks = self.kernels.residual(x.contiguous(), h.contiguous(), eps,
                                                      h_norm, out_norm, quantize)
        if blocks is not None:  # the next matmul of normed takes them
            self._prequantized = (normed, blocks)
        return total, normed

    def attention(self, q, k, v, mask, scale, softcap=0.0, write=None,
                  span=None, apart=None) -> torch.Tensor:
        """q (n, H, hd) f32; k/v (T, KVH, hd) (the cache's dtype); mask (n, T) bool.
        Scores, softmax and sums in f32 (f16 queries would cost 1e-3 relative: more than
        the reference checks allow). ``write`` (GPU path: a graph step's in-place KV
        write) = (slots (n,) int64 on the device, new keys, new values (n, KVH, hd)): store
        them at those slots of k's and v's memory first (which holds one row past T: the
        pads' spare row), in the attention's own launch where the split kernels run.
        ``span`` (the same graph steps): a (1,) int64 device tensor, the leading slots
        outside which the mask hides all: the split kernels cover those only
        (``kernels.attention``); every other path reads the mask alone. ``apart`` (a batch
        graph's step, where ``attends_apart``): each row is another sequence's, over its own
        cache at those offsets from k's and v's memory, with its own span and write
        (``kernels.attention``'s): one launch for them all."""
        q, k, v = _plain(self.asarray(q)), _plain(self.asarray(k)), _plain(self.asarray(v))
        if apart is not None and not self.attends_apart(q):
            raise ValueError("attention of rows over their own caches needs the split "
                             "kernels with the KV write (attends_apart)")
        if write is not None:
            slots, kn, vn = write[0], write[1].contiguous(), write[2].contiguous()
            write = (slots, kn, vn)
            if not self.attends_apart(q):
                self.kernels.store_kv(k, v, slots, kn, vn)
                write = None
        if self.ggml_numerics:
            mask = mask.numpy() if isinstance(mask, torch.Tensor) else mask
            return self._like_ggml(attention_like_ggml, q, k, v, mask, scale, softcap)
        n, hd = q.shape[0], q.shape[2]
        if not isinstance(mask, torch.Tensor):
            mask = torch.from_numpy(np.ascontiguousarray(mask, dtype=bool)).to(self.device)
        if self._split_attention(q):  # decode, speculative checks: one launch
            args = (q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous(), scale,
                    softcap)
            if (self._fused() and n <= self.kernels.MATVEC_MAX_TOKENS
                    and self._attention_blocks and "attention_blocks" not in self.unfused):
                # the output projection's 8-bit blocks written in the same launch
                out, blocks = self.kernels.attention(*args, quantize=True, write=write,
                                                     span=span, apart=apart)
                self._prequantized = (out, blocks)
                return out
            return self.kernels.attention(*args, write=write, span=span, apart=apart)
        # (CPU SDPA with a mask: ~40 ms a decode step)
        default = (self._explicit_attention if softcap or not self.cuda
                   else self._sdpa_attention)
        if (softcap or self.kernels is None or k.dtype != torch.float16 or hd < 16
                or hd & (hd - 1)):
            return default(q, k, v, mask, scale, softcap)
        return self._prompt_attention(default, q, k, v, mask, scale)

    def attention_batch(self, q, parts, scale, softcap=0.0) -> torch.Tensor:
        """One sequence (eager decode's ``attention_append``): its attention as is, so the
        output projection takes the 8-bit blocks its launch wrote (no zeros, copy or
        quantize launch); several: each into one output, their launches writing no blocks
        (the copy would drop them)."""
        if len(parts) == 1:
            k, v, mask = parts[0]
            return self.attention(q, k, v, mask, scale, softcap)
        with self.attention_rows_apart():
            return super().attention_batch(q, parts, scale, softcap)

    @contextlib.contextmanager
    def attention_rows_apart(self) -> Iterator[None]:
        """Attention launches whose outputs are joined after (several sequences', each over
        its own cache) write no 8-bit blocks for the output projection: the join would
        drop them, and the projection quantizes the joined rows itself."""
        self._attention_blocks = False
        try:
            yield
        finally:
            self._attention_blocks = True

    def attends_apart(self, q) -> bool:
        """Do q's rows attend in one launch of the split kernels that also stores their
        keys and values (``attention``'s write in its launch; rows over their own caches:
        ``apart``)?"""
        return self._fused() and self._split_attention(q) and "kv_write" not in self.unfused

    def _split_attention(self, q) -> bool:
        """Do the split (flash-decoding) kernels run q's attention? (They alone take a KV
        write in their launch.)"""
        hd = q.shape[-1]
        return (self.kernels is not None and q.shape[0] <= self.kernels.ATTENTION_MAX_QUERIES
                and hd & (hd - 1) == 0)

    def _prompt_attention(self, default, q, k, v, mask, scale: float) -> torch.Tensor:
        """A prompt's attention on the GPU path: ``default`` (SDPA on a GPU), or the triton
        flash kernel in one of its tiles where the GPU timed it faster for this shape."""
        n, H, hd = q.shape
        T, kvh = k.shape[0], k.shape[1]
        args = (q.contiguous(), k.contiguous(), v.contiguous(), mask.contiguous(), scale)

        def run(choice):
            if choice == "default":
                return default(*args)
            return self.kernels.flash_prompt_attention(*args, tile=choice)

        # (sizes rounded to powers of two: fewer timings)
        key = ("attention", kvh, H // kvh, hd, 1 << (n - 1).bit_length(),
               1 << (T - 1).bit_length())
        return run(tuning.choose(self.device, key, ("default", *self.kernels.flash_tiles(hd)),
                                 run, "default"))

    @staticmethod
    def _explicit_attention(q, k, v, mask, scale: float, softcap: float = 0.0):
        """Scores, softcap, mask and softmax as plain tensor ops (the CPU; soft-capping)."""
        group = q.shape[1] // k.shape[1]
        kh = k.float().transpose(0, 1)[None]  # (1, KVH, T, hd)
        vh = v.float().transpose(0, 1)[None]
        qh = q.transpose(0, 1)[None]  # (1, H, n, hd)
        scores = (qh @ kh.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask[None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return (probs @ vh.repeat_interleave(group, dim=1))[0].transpose(0, 1)

    @staticmethod
    def _sdpa_attention(q, k, v, mask, scale: float, softcap: float = 0.0):
        """The query heads of each KV head as one sequence of group * n rows: one SDPA call
        (f32, any mask) covers GQA without repeating K/V."""
        n, H, hd = q.shape
        kvh = k.shape[1]
        group = H // kvh
        kh = k.float().transpose(0, 1)[None]  # (1, KVH, T, hd)
        vh = v.float().transpose(0, 1)[None]
        qg = q.reshape(n, kvh, group, hd).permute(1, 2, 0, 3).reshape(1, kvh, group * n, hd)
        out = F.scaled_dot_product_attention(qg, kh, vh, attn_mask=mask.repeat(group, 1)[None],
                                             scale=scale)  # (1, KVH, group * n, hd)
        return out.reshape(kvh, group, n, hd).permute(2, 0, 1, 3).reshape(n, H, hd)

    def _quantizes_after(self, x: torch.Tensor) -> bool:
        """Does a norm or GLU of x (n, K) quantize its output in the same launch? (up to the
        mat-vec's token count, where a matmul of it then runs no quantize launch)"""
        return (self.fuse_quantize and x.dim() == 2
                and x.shape[0] <= self.kernels.MATVEC_MAX_TOKENS)

    def _then_quantize(self, op: str, a, b, eps: float = 0.0) -> torch.Tensor:
        """kernels.then_quantize, its 8-bit blocks kept for the next matmul of the output."""
        out, blocks = self.kernels.then_quantize(op, a, b, eps)
        self._prequantized = (out, blocks)
        return out

    def _glu(self, gate, up, gelu: bool) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        if self._quantizes_after(gate):
            return self._then_quantize("gelu" if gelu else "silu", gate, up)
        return self.kernels.glu(gate, up, gelu)

    def gated_projection(self, x, w_gate, w_up, gelu: bool) -> torch.Tensor:
        """Up to 8 tokens on the GPU path, gate and up stacked (one block type and width,
        no biases, K not split): the mat-vec, the GLU and the down projection's 8-bit
        blocks in one launch (``kernels.qmatvec_glu``); else the matmuls, then the GLU."""
        x = self.asarray(x)
        if self._fused() and self._quantizes_after(x) and "glu" not in self.unfused:
            x = x.contiguous()
            plan = self._stacked((w_gate, w_up), (None, None))
            stacked, bias, members = plan[0]
            if (len(plan) == 1 and members is not None and bias is None
                    and stacked.planes.padded // CHUNK < self.kernels.SPLIT_MIN_CHUNKS):
                xq, xd = self._activations(x, stacked, {})
                act, blocks = self.kernels.qmatvec_glu(xq, xd, stacked.planes, gelu)
                self._prequantized = (act, blocks)  # the down projection's input
                return act
        return super().gated_projection(x, w_gate, w_up, gelu)

    def silu_mul(self, gate, up) -> torch.Tensor:
        if self.kernels is not None:
            return self._glu(gate, up, False)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate, up) -> torch.Tensor:
        if self.ggml_numerics:
            return self._like_ggml(geglu_like_ggml, gate, up)
        if self.kernels is not None:
            return self._glu(gate, up, True)
        return F.gelu(gate, approximate="tanh") * up

    def softcap(self, x, cap: float) -> torch.Tensor:
        return torch.tanh(x / cap) * cap

    # -- device facts --------------------------------------------------------------------
    def device_name(self) -> str:
        if not self.cuda:
            return f"CPU torch {torch.__version__} ({self.threads} threads)"
        props = torch.cuda.get_device_properties(self.device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"

    def peak_bandwidth(self) -> float | None:
        """The device's memory bandwidth in bytes/s from its clock and bus width, if known."""
        if not self.cuda:
            return None
        props = torch.cuda.get_device_properties(self.device)
        clock = getattr(props, "memory_clock_rate", 0)  # kHz
        width = getattr(props, "memory_bus_width", 0)  # bits
        return 2.0 * clock * 1e3 * width / 8 if clock and width else None
