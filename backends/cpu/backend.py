"""The fast CPU backend: quantized weights used in place, never expanded to f32.

Decode (a few tokens): activations are quantized to int8 per 32 and dotted with the weight
blocks by the C kernels (AVX-512 VNNI / AVX2, native/cpu_kernels.c), or by Numba kernels that
decode one weight row at a time where there is no C compiler or no x86. Prefill (many tokens):
weights are decoded a tile of rows at a time into an f32 buffer and multiplied with BLAS, so
the work is compute-bound matrix-matrix and the f32 tile stays small.

Weights keep the GGUF file's own blocks (zero copy over its mmap), so a tied embedding serves
both lookup and output from the same bytes and resident memory stays near the file size.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numba
import numpy as np

from edgellm.converters.gguf_reader import QTensor
from edgellm.native import cpu_kernels
from edgellm.quants import Q

from ..numpy_backend import NumpyBackend, round_activations_like_ggml
from . import numba_ops
from .blas_threads import blas_threads
from .numba_quant import CODES, F16_TABLE, dequant_rows, dequant_rows_serial, matvec

#: up to this many tokens the Numba path runs its mat-vec kernels; above, tiles + BLAS. The C
#: kernels take every batch: rows outer, tokens inner, each weight block read once.
MATVEC_MAX_TOKENS = 8
#: up to this many query tokens attention runs the Numba kernel; above, BLAS (reference)
ATTENTION_KERNEL_MAX_TOKENS = 16
#: queries per block of prefill attention (each block reads only the keys its mask reaches)
ATTENTION_QUERY_BLOCK = 128
#: f32 bytes of one decoded weight tile in prefill (large enough for BLAS to run at speed)
TILE_BYTES = 16 << 20


@dataclass
class QuantMatrix:
    """A (rows, cols) weight in its file encoding: ``data`` (rows, row_bytes) uint8 blocks."""

    data: np.ndarray
    qtype: Q
    rows: int
    cols: int

    @property
    def code(self) -> int:
        return CODES[self.qtype]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads counted once)."""
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        siblings = [int(line.split(":")[1]) for line in text.splitlines()
                    if line.startswith("siblings")]
        cores = [int(line.split(":")[1]) for line in text.splitlines()
                 if line.startswith("cpu cores")]
        if siblings and cores and siblings[0] > cores[0]:
            return max(1, logical * cores[0] // siblings[0])
    except (OSError, ValueError, IndexError):
        pass
    return max(1, logical or 1)


class CpuBackend(NumpyBackend):
    """Quantized kernels for laptop CPUs; f32 activations, weights in their GGUF blocks.

    ``threads`` defaults to the physical cores; ``kernels`` is "auto" (C where it builds,
    else Numba), "c" or "numba".
    """

    name = "cpu"

    def __init__(self, threads: int | None = None, kernels: str = "auto"):
        self.threads = int(threads or physical_cores())
        numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        if kernels not in ("auto", "c", "numba"):
            raise ValueError(f"kernels must be auto, c or numba, not {kernels!r}")
        self.native = None if kernels == "numba" else cpu_kernels.load()
        if kernels == "c" and self.native is None:
            raise RuntimeError("C kernels requested but they do not build here "
                               "(need x86 AVX2, a C compiler and cffi: pip install cffi)")
        self.kernels = "c" if self.native is not None else "numba"
        self._pool: ThreadPoolExecutor | None = None  # prefill workers, started on first use

    # -- weights -------------------------------------------------------------------------
    def prepare(self, tensor: QTensor):
        if tensor.qtype not in CODES:  # F32 / F16 / BF16: small or rare, kept as f32
            return np.ascontiguousarray(tensor.dequantize(), dtype=np.float32)
        rows, cols = int(np.prod(tensor.shape[:-1])), int(tensor.shape[-1])
        return QuantMatrix(tensor.data.reshape(rows, -1), tensor.qtype, rows, cols)

    def prepare_embedding(self, tensor: QTensor):
        return self.prepare(tensor)  # the same zero-copy blocks serve lookup and output

    # -- ops -----------------------------------------------------------------------------
    def embed(self, table, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if not isinstance(table, QuantMatrix):
            return np.asarray(table[ids], dtype=np.float32)
        out = np.empty((len(ids), table.cols), dtype=np.float32)  # (n, d)
        dequant_rows(table.code, table.data, ids, out, F16_TABLE)
        return out

    def matmul(self, x: np.ndarray, weight, bias=None) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)  # (n, in)
        if not isinstance(weight, QuantMatrix):
            out = x @ weight.T
        elif x.shape[0] <= MATVEC_MAX_TOKENS or (self.native is not None
                                                 and weight.cols % 32 == 0):
            out = self._matvec(x, weight)
        else:
            out = self._matmul_tiled(x, weight)
        if bias is not None:
            out += bias
        return out

    def _matvec(self, x: np.ndarray, w: QuantMatrix) -> np.ndarray:
        n = x.shape[0]
        out = np.empty((n, w.rows), dtype=np.float32)  # (n, out)
        lib = self.native
        if lib is None or w.cols % 32:
            matvec(w.code, w.data, x, out, F16_TABLE)
            return out
        ptr = lib.ffi.cast
        # activations rounded in C as llama.cpp rounds them (Q8_K per 256 against K-quants);
        # a batch too big for the mat-vec registers (prefill) takes the GEMM where it has one
        status = lib.lib.ek_matmul_f32(int(w.qtype), ptr("uint8_t *", w.data.ctypes.data),
                                       w.data.strides[0], w.rows, w.cols,
                                       ptr("float *", x.ctypes.data), n,
                                       ptr("float *", out.ctypes.data), self.threads,
                                       MATVEC_MAX_TOKENS)
        if status != 0:
            raise MemoryError(f"no memory for the int8 activations of {n} tokens x {w.cols}")
        return out

    def _matmul_tiled(self, x: np.ndarray, w: QuantMatrix) -> np.ndarray:
        """Prefill: each worker decodes a tile of rows to f32 and multiplies it with BLAS."""
        out_t = np.empty((w.rows, x.shape[0]), dtype=np.float32)  # (out, n): tiles are rows
        # several tiles per worker, so one descheduled worker does not hold up the rest
        tile_rows = max(64, min(TILE_BYTES // (4 * w.cols), -(-w.rows // (4 * self.threads))))
        # the f32 product of llama.cpp's 8-bit-rounded activations with the decoded weights
        x_t = np.ascontiguousarray(round_activations_like_ggml(x, w.qtype).T)  # (in, n)

        def run_tile(r0: int) -> None:
            r1 = min(w.rows, r0 + tile_rows)
            tile = np.empty((r1 - r0, w.cols), dtype=np.float32)  # (tile, in)
            dequant_rows_serial(w.code, w.data, r0, r1, tile, F16_TABLE)
            np.matmul(tile, x_t, out=out_t[r0:r1])

        with blas_threads(1):
            list(self._workers().map(run_tile, range(0, w.rows, tile_rows)))
        return np.ascontiguousarray(out_t.T)  # (n, out)

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="edgellm-cpu")
        return self._pool

    # -- fused elementwise ops (Numba) ------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        return numba_ops.rms_norm(np.ascontiguousarray(x, dtype=np.float32), weight,
                                  np.float32(eps))

    def silu_mul(self, gate, up):
        if self.native is None:
            return numba_ops.silu_mul(gate, up)
        return self._elementwise("ek_silu_mul", gate, up)

    def gelu_tanh_mul(self, gate, up):
        if self.native is None:
            return super().gelu_tanh_mul(gate, up)
        return self._elementwise("ek_gelu_tanh_mul", gate, up)

    def _elementwise(self, kernel: str, gate, up):
        """out = f(gate) * up by a one-pass C kernel (no numpy temporaries)."""
        gate = np.ascontiguousarray(gate, dtype=np.float32)
        up = np.ascontiguousarray(up, dtype=np.float32)
        out = np.empty_like(gate)
        ffi = self.native.ffi
        getattr(self.native.lib, kernel)(ffi.cast("float *", gate.ctypes.data),
                                         ffi.cast("float *", up.ctypes.data),
                                         ffi.cast("float *", out.ctypes.data), gate.size)
        return out

    def rope(self, x, positions, theta, neox, freq_factors=None, freq_scale=1.0):
        return numba_ops.rope(x, positions, theta, neox, freq_factors, freq_scale)

    def attention(self, q, k, v, mask, scale, softcap=0.0):
        if k.dtype not in (np.float16, np.float32):
            return super().attention(q, k, v, mask, scale, softcap)
        if q.shape[0] > ATTENTION_KERNEL_MAX_TOKENS:
            return self._attention_blocked(q, k, v, mask, scale, softcap)
        if self.native is not None and k.dtype == np.float16 and q.shape[-1] % 8 == 0:
            return self._attention_f16(q, k, v, mask, scale, softcap)
        return numba_ops.attention(q, k, v, mask, scale, softcap, F16_TABLE)

    def _attention_f16(self, q, k, v, mask, scale, softcap):
        """Decode attention over the f16 cache in C (F16C loads, f32 arithmetic)."""
        q = np.ascontiguousarray(q, dtype=np.float32)  # (n, H, hd)
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)  # (T, KVH, hd) f16
        mask = np.ascontiguousarray(mask, dtype=np.uint8)  # (n, T)
        out = np.empty_like(q)
        ptr = self.native.ffi.cast
        status = self.native.lib.ek_attention_f16(
            ptr("float *", q.ctypes.data), ptr("uint16_t *", k.ctypes.data),
            ptr("uint16_t *", v.ctypes.data), ptr("uint8_t *", mask.ctypes.data), q.shape[0],
            q.shape[1], k.shape[1], q.shape[2], k.shape[0], float(scale), float(softcap),
            ptr("float *", out.ctypes.data))
        if status != 0:
            raise MemoryError("no memory for attention scores")
        return out

    def _attention_blocked(self, q, k, v, mask, scale, softcap):
        """Prefill attention: the reference's matrix products over blocks of queries, each
        against only the span of keys its mask reaches (a causal mask halves the work, a
        window cuts it to the window). q (n, H, hd); k, v (T, KVH, hd); mask (n, T)."""
        out = np.zeros(q.shape, dtype=np.float32)  # (n, H, hd)
        k, v = np.asarray(k, np.float32), np.asarray(v, np.float32)  # once, not per block
        for q0 in range(0, q.shape[0], ATTENTION_QUERY_BLOCK):
            rows = slice(q0, q0 + ATTENTION_QUERY_BLOCK)
            keys = np.flatnonzero(mask[rows].any(axis=0))
            if len(keys) == 0:
                continue  # fully masked rows attend to nothing (their output stays zero)
            span = slice(keys[0], keys[-1] + 1)
            out[rows] = super().attention(q[rows], k[span], v[span], mask[rows, span], scale,
                                          softcap)
        out[~mask.any(axis=1)] = 0.0  # a fully masked row inside a block (NaN there)
        return out
