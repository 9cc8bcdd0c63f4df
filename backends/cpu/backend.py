"""The fast CPU backend: quantized weights used in place, never expanded to f32.

With the C kernels (AVX-512 VNNI / AVX2 on x86, NEON on aarch64, native/): activations are
rounded to int8 as llama.cpp rounds them and dotted with the weights, repacked at load into
register tiles on x86 (AVX-512 VNNI: a GEMM in prefill; AVX2: 8-token tiles) and in the
file's blocks by mat-vec kernels otherwise (ARM; the types x86 does not repack); norms, RoPE,
activations and decode attention are C too, and Numba is never imported (it costs ~65 MB of
resident memory and half a second of start-up). Without them (no compiler, neither x86 nor
ARM) the Numba kernels take over: the common block types are repacked at load into planes
(numba_packed: int8/nibble planes, f32 scales) that decode dots with int8 activations in
LLVM vector code, and prefill decodes tiles of rows to f32 for BLAS; the other types are
decoded a row at a time from the file's blocks.

Weights keep the GGUF file's own blocks (zero copy over its mmap), so a tied embedding serves
both lookup and output from the same bytes and resident memory stays near the file size.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from edgellm.converters.gguf_reader import QTensor
from edgellm.native import cpu_kernels
from edgellm.quants import Q, dequantize

from ..anon import anonymous_zeros
from ..base import BlockShape
from ..numpy_backend import NumpyBackend, round_activations_like_ggml
from .blas_threads import blas_threads
from .calibrate import prefetch_distance
from .file_rows import FileRows

#: up to this many tokens the Numba path runs its mat-vec kernels; above, tiles + BLAS. The C
#: kernels take every batch: rows outer, tokens inner, each weight block read once.
MATVEC_MAX_TOKENS = 8
#: without C kernels: up to this many query tokens attention runs the Numba kernel; above,
#: BLAS over blocks of queries (the C kernel takes every batch)
ATTENTION_KERNEL_MAX_TOKENS = 16
#: query x key products (per K or V pass) below which attention runs on one thread. The
#: helpers spin 1 ms after a job, so in decode they are awake for it: one token over 110 keys
#: (0.5B) took 12.1 us on one thread and 9.9 on two, 8 sequences 74.6 and 48.3 (Zen 4)
ATTENTION_THREADS_MIN_MACS = 1 << 16
#: queries per block of prefill attention (each block reads only the keys its mask reaches)
ATTENTION_QUERY_BLOCK = 128
#: file bytes packed (then let go) at a time when weights are repacked at load
PACK_SLICE_BYTES = 16 << 20
#: f32 bytes of one decoded weight tile in prefill (large enough for BLAS to run at speed)
TILE_BYTES = 16 << 20


#: the block types kept in their file encoding (the rest are small or rare: kept as f32)
QUANTIZED = frozenset((Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K))


def _numba():
    """The Numba kernel modules, imported on first use (only the no-C path needs them)."""
    from . import numba_ops, numba_quant

    return numba_ops, numba_quant


def _numba_packed():
    """The Numba path's repacked-weight kernels, imported on first use."""
    from . import numba_packed

    return numba_packed


@dataclass
class QuantMatrix:
    """A (rows, cols) weight in its file encoding: ``data`` (rows, row_bytes) uint8 blocks."""

    data: np.ndarray
    qtype: Q
    rows: int
    cols: int
    #: the same weights repacked for the C tiles (native/cpu_packed.c), or None
    packed: np.ndarray | None = None
    #: the same weights repacked for the Numba kernels (numba_packed.PackedWeight), or None
    planes: object = None
    #: an embedding table's rows read from its file (lookups map none of its pages), or None
    file_rows: FileRows | None = None

    def __post_init__(self):
        self.address = int(self.data.ctypes.data)  # for the C kernels (the mmap never moves)

    @property
    def code(self) -> int:
        """The Numba kernels' code for the block type."""
        return _numba()[1].CODES[self.qtype]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass
class _FusedPlan:
    """ek_matvec_multi's per-matrix arguments for one group of weights (built once)."""

    weights: tuple
    total_rows: int
    packed: bool  # all packed (ek_matmul_packed_multi) or none (ek_matvec_multi)
    qtypes: object  # cffi int[]
    addresses: object  # cffi uint8_t *[]
    row_bytes: object  # cffi int64_t[]
    rows: object  # cffi int[]


@dataclass
class _BlockPlan:
    """ek_decode_block's description of one block (block_t) and what it points into."""

    desc: object  # cffi block_t *
    keep: tuple  # cffi arrays and numpy vectors the description points to
    shape: BlockShape
    scratch_floats: int  # per token

    @property
    def width(self) -> int:
        return self.shape.d


def _tensor_key(tensor: QTensor) -> tuple:
    """Identifies a tensor's bytes (a tied output is the embedding's own tensor)."""
    return (int(tensor.data.ctypes.data), tensor.data.shape, int(tensor.qtype))


def _file_mapping(view: np.ndarray) -> tuple[mmap.mmap, int] | None:
    """The file mapping under ``view`` and the view's byte offset in it, or None where the
    view is not a file's (a copy in anonymous memory would lose its contents if dropped)."""
    base = view
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):  # numpy's wrapper around the buffer it was given
        base = base.obj
    if not isinstance(base, mmap.mmap) or not hasattr(base, "madvise"):
        return None
    return base, view.ctypes.data - np.frombuffer(base, dtype=np.uint8).ctypes.data


def release_file_pages(view: np.ndarray) -> None:
    """Drop this process's resident pages of a read-only file mapping under ``view`` (whole
    pages inside it only); a later read faults them back in from the page cache."""
    found = _file_mapping(view)
    if found is None:
        return
    base, start = found
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        base.madvise(mmap.MADV_DONTNEED, first, last - first)


#: what one read of a file mapping can bring back resident: the kernel maps a whole large
#: page-cache folio (2 MB on this VM) around the page it faults in
FILE_FOLIO_BYTES = 2 << 20


def release_file_rows(table: np.ndarray, ids: np.ndarray) -> None:
    """Drop the resident file pages around rows ``ids`` of a read-only file mapping (each
    row's whole folio-sized block), after they were read. An embedding table read in place
    otherwise stays resident block by block as new token ids arrive: the 0.5B's 145 MB
    table added 16 MB to a server's RSS over 200 requests, up to all of it in time."""
    found = _file_mapping(table) if len(ids) else None
    if found is None:
        return
    base, start = found
    offsets = start + np.asarray(ids, dtype=np.int64) * table.strides[0]
    for block in np.unique(offsets // FILE_FOLIO_BYTES):
        first = int(block) * FILE_FOLIO_BYTES
        base.madvise(mmap.MADV_DONTNEED, first, min(FILE_FOLIO_BYTES, len(base) - first))


def _copy_out_of_file(tensor: QTensor) -> np.ndarray:
    """A small tensor as f32 in anonymous memory. An F32 tensor's values are a view into the
    file's mapping, and every read of such a view (a norm weight, once per layer per step)
    maps whole page-cache folios around it back in: 2 MB a norm on this VM, 56 MB of
    already repacked weights resident again after Gemma's first prompt."""
    return np.array(tensor.dequantize(), dtype=np.float32, copy=True)


def rope_tables(positions: np.ndarray, hd: int, theta: float,
                freq_factors: np.ndarray | None = None,
                freq_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n, hd/2) f32 of each position's RoPE angles (computed in f64)."""
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd) * freq_scale
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, dtype=np.float64)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq  # (n, hd/2)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


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
        if kernels not in ("auto", "c", "numba"):
            raise ValueError(f"kernels must be auto, c or numba, not {kernels!r}")
        isa = cpu_kernels.requested_isa()  # $EDGELLM_ISA forces a variant (or Numba)
        if isa == "numba" and kernels == "auto":
            kernels = "numba"
        self.native = None if kernels == "numba" else cpu_kernels.load(
            None if isa == "numba" else isa)
        if kernels == "c" and self.native is None:
            raise RuntimeError("C kernels requested but they do not build here "
                               "(need x86 AVX2 or aarch64, a C compiler and cffi: "
                               "pip install cffi)")
        self.kernels = "c" if self.native is not None else "numba"
        #: weights repacked at load for the C tiles (x86 builds; EDGELLM_PACK=0: off)
        self.packing = (self.native is not None and os.environ.get("EDGELLM_PACK", "1") != "0"
                        and self.native.lib.ek_packed_bytes(int(Q.Q8_0), 16, 32) > 0)
        if self.native is not None:  # measured once per CPU model, then read from the cache
            distance = prefetch_distance(self.native, self.variant, self.threads)
            if distance is not None:
                self.native.lib.ek_set_prefetch_ahead(distance)
        #: weights repacked at load for the Numba kernels (EDGELLM_PACK=0: off)
        self.numba_packing = self.native is None and os.environ.get("EDGELLM_PACK", "1") != "0"
        if self.native is None:
            import numba

            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        self._pool: ThreadPoolExecutor | None = None  # prefill workers, started on first use
        self._matvec_pool = None  # the Numba mat-vec's threads, started on first use
        self._plans: dict[tuple, _FusedPlan] = {}  # matmuls' C arguments per weight group
        self._rope_cache: dict[tuple, tuple] = {}  # (cos, sin, freq_factors) per step
        self._embeddings: dict[tuple, object] = {}  # _tensor_key -> table (tied outputs)

    @property
    def variant(self) -> str:
        """The kernels this backend runs: a C build ("avx2", "avx512vnni", "neon_dotprod", ...)
        or "numba"."""
        return cpu_kernels.variant_of(self.native) if self.native is not None else "numba"

    # -- weights -------------------------------------------------------------------------
    def prepare(self, tensor: QTensor):
        # a tied output matrix is the embedding table already prepared: one packed copy
        # serves the matmuls and the lookups
        weight = self._embeddings.get(_tensor_key(tensor))
        if weight is None:
            weight = self._file_blocks(tensor)
        if isinstance(weight, QuantMatrix) and self.packing and weight.packed is None:
            weight.packed = self._pack(weight)
        if isinstance(weight, QuantMatrix) and self.numba_packing and weight.planes is None:
            weight.planes = self._pack_numba(weight)
        return weight

    def prepare_embedding(self, tensor: QTensor):
        """The file's blocks, zero copy (lookups read only the rows they need)."""
        table = self._file_blocks(tensor)
        if isinstance(table, QuantMatrix) and tensor.source is not None:
            table.file_rows = FileRows.open(*tensor.source, table.data)
            release_file_rows(table.data, np.array([0, table.rows - 1]))  # the check's reads
        self._embeddings[_tensor_key(tensor)] = table  # prepare() packs it if it is tied
        return table

    def prepare_vector(self, tensor: QTensor) -> np.ndarray:
        return _copy_out_of_file(tensor)

    def _file_blocks(self, tensor: QTensor):
        if tensor.qtype not in QUANTIZED:  # F32 / F16 / BF16: small or rare, kept as f32
            return _copy_out_of_file(tensor)
        rows, cols = int(np.prod(tensor.shape[:-1])), int(tensor.shape[-1])
        return QuantMatrix(tensor.data.reshape(rows, -1), tensor.qtype, rows, cols)

    def _pack(self, w: QuantMatrix) -> np.ndarray | None:
        """w repacked for the C tiles (None where its type is not packed), after which the
        file's pages of w are handed back: resident memory holds the weights once."""
        lib = self.native.lib
        size = lib.ek_packed_bytes(int(w.qtype), w.rows, w.cols)
        if size <= 0:
            return None
        packed = anonymous_zeros(size)  # its own mapping: unmapped again when freed
        chunk_bytes = size // -(-w.rows // 16)  # one packed chunk of 16 rows
        f = self.native.ffi
        # in slices, each slice's file pages let go before the next is read: resident memory
        # peaks at the packed copy plus one slice, not plus the whole matrix (Gemma's tied
        # 262144-row output: +16 MB instead of +178 MB while loading)
        step = max(16, (PACK_SLICE_BYTES // w.data.strides[0]) // 16 * 16)
        for r0 in range(0, w.rows, step):
            rows = min(step, w.rows - r0)
            dst = packed[r0 // 16 * chunk_bytes:]
            src = f.cast("uint8_t *", w.address + r0 * w.data.strides[0])
            status = lib.ek_pack(int(w.qtype), src, w.data.strides[0], rows, w.cols,
                                 f.from_buffer("uint8_t[]", dst), self.threads)
            if status != 0:
                raise MemoryError(f"no memory to repack a {w.rows} x {w.cols} weight")
            release_file_pages(w.data[r0:r0 + rows])
        return packed

    def _pack_numba(self, w: QuantMatrix):
        """w repacked into the Numba kernels' planes (None where its type is not packed), in
        slices whose file pages are let go as they are done (as _pack)."""
        npk = _numba_packed()
        if not npk.packable(w.qtype, w.cols):
            return None
        planes = npk.allocate(w.qtype, w.rows, w.cols)
        step = max(16, PACK_SLICE_BYTES // w.data.strides[0])
        for r0 in range(0, w.rows, step):
            npk.pack_rows(planes, w.data[r0:r0 + step], r0)
            release_file_pages(w.data[r0:r0 + step])
        return planes

    # -- ops -----------------------------------------------------------------------------
    def embed(self, table, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if not isinstance(table, QuantMatrix):
            return np.asarray(table[ids], dtype=np.float32)
        if self.native is not None and table.packed is not None:  # a tied, packed output
            out = np.empty((len(ids), table.cols), dtype=np.float32)  # (n, d)
            f = self.native.ffi.from_buffer
            status = self.native.lib.ek_packed_rows(int(table.qtype), f("uint8_t[]", table.packed),
                                                    table.rows, table.cols,
                                                    f("int64_t[]", ids), len(ids),
                                                    f("float[]", out))
            if status != 0:
                raise IndexError(f"token id out of range 0..{table.rows - 1}")
            return out
        out = np.empty((len(ids), table.cols), dtype=np.float32)  # (n, d)
        if table.planes is not None:  # a tied output, repacked (the file's pages let go)
            if len(ids) and (ids.min() < 0 or ids.max() >= table.rows):
                raise IndexError(f"token id out of range 0..{table.rows - 1}")
            _numba_packed().dequantize_rows(table.planes, ids, out)
            return out
        if table.file_rows is not None:  # read from the file: no page of it mapped
            blocks, ids = table.file_rows.read(ids), np.arange(len(ids))  # (n, row_bytes)
        else:
            blocks = table.data
        if self.native is not None:
            rows = self._dequantize_rows(np.ascontiguousarray(blocks[ids]), table)  # (n, d)
            if table.file_rows is None:
                release_file_rows(table.data, ids)
            return rows
        nq = _numba()[1]
        nq.dequant_rows(table.code, blocks, ids, out, nq.F16_TABLE)
        return out

    def _dequantize_rows(self, blocks: np.ndarray, table: QuantMatrix) -> np.ndarray:
        """Rows of table's blocks (n, row_bytes) as f32 (n, d), the same bits as gguf-py's
        numpy dequantizer: packed and read back in C where the type packs (a decode step's
        lookup on the 0.5B, caches cold after the step's weights: 187 -> 74 us), else
        numpy."""
        lib, f = self.native.lib, self.native.ffi.from_buffer
        n = len(blocks)
        size = lib.ek_packed_bytes(int(table.qtype), n, table.cols)
        if size <= 0 or n == 0:
            return dequantize(blocks, table.qtype)
        packed = np.empty(size, dtype=np.uint8)
        out = np.empty((n, table.cols), dtype=np.float32)
        if lib.ek_pack(int(table.qtype), f("uint8_t[]", blocks), table.data.strides[0], n,
                       table.cols, f("uint8_t[]", packed), 1) != 0 or lib.ek_packed_rows(
                int(table.qtype), f("uint8_t[]", packed), n, table.cols,
                f("int64_t[]", np.arange(n, dtype=np.int64)), n, f("float[]", out)) != 0:
            return dequantize(blocks, table.qtype)
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
        if w.packed is not None and lib is not None:  # decode and prefill: the packed copy
            f = lib.ffi.from_buffer
            status = lib.lib.ek_matmul_packed(int(w.qtype), f("uint8_t[]", w.packed), w.rows,
                                              w.cols, f("float[]", x), n, f("float[]", out),
                                              self.threads)
            if status != 0:
                raise MemoryError(f"no memory for the int8 activations of {n} tokens")
            return out
        if w.planes is not None:  # Numba: int8 activations . the repacked planes
            return _numba_packed().matvec(w.planes, x, self._numba_pool())
        if lib is None or w.cols % 32:
            nq = _numba()[1]
            nq.matvec(w.code, w.data, x, out, nq.F16_TABLE)
            return out
        ffi = lib.ffi
        # activations rounded in C as llama.cpp rounds them (Q8_K per 256 against K-quants);
        # a batch too big for the mat-vec registers (prefill) takes the GEMM where it has one
        status = lib.lib.ek_matmul_f32(int(w.qtype), ffi.cast("uint8_t *", w.address),
                                       w.data.strides[0], w.rows, w.cols,
                                       ffi.from_buffer("float[]", x), n,
                                       ffi.from_buffer("float[]", out), self.threads,
                                       MATVEC_MAX_TOKENS)
        if status != 0:
            raise MemoryError(f"no memory for the int8 activations of {n} tokens x {w.cols}")
        return out

    def matmuls(self, x, weights, biases=None):
        """Decode's Q/K/V (gate/up) in one C job: the activations rounded once, the threads
        woken once; results bit-identical to separate matmuls."""
        x = np.ascontiguousarray(x, dtype=np.float32)  # (n, in)
        plan = self._fused_plan(weights) if x.shape[0] <= MATVEC_MAX_TOKENS else None
        if plan is None:
            return super().matmuls(x, weights, biases)
        n, f = x.shape[0], self.native.ffi.from_buffer
        out = np.empty(n * plan.total_rows, dtype=np.float32)
        if plan.packed:
            status = self.native.lib.ek_matmul_packed_multi(
                len(weights), plan.qtypes, plan.addresses, plan.rows, x.shape[1],
                f("float[]", x), n, f("float[]", out), self.threads)
        else:
            status = self.native.lib.ek_matvec_multi(
                len(weights), plan.qtypes, plan.addresses, plan.row_bytes, plan.rows,
                x.shape[1], f("float[]", x), n, f("float[]", out), self.threads)
        if status == -2:  # a type (or width) without C mat-vec kernels
            return super().matmuls(x, weights, biases)
        if status != 0:
            raise MemoryError(f"no memory for the int8 activations of {n} tokens")
        outs, start = [], 0
        for w, b in zip(weights, biases or (None,) * len(weights), strict=True):
            y = out[start:start + n * w.rows].reshape(n, w.rows)  # (n, out_i)
            start += n * w.rows
            outs.append(y if b is None else y + b)
        return outs

    def _fused_plan(self, weights) -> _FusedPlan | None:
        """The C arguments describing ``weights`` (cached), or None where they can't fuse."""
        key = tuple(id(w) for w in weights)
        plan = self._plans.get(key)
        if plan is not None and all(a is b for a, b in zip(plan.weights, weights, strict=True)):
            return plan
        lib = self.native
        if (lib is None or not 1 < len(weights) <= 8
                or not all(isinstance(w, QuantMatrix) for w in weights)
                or len({w.cols for w in weights}) != 1
                or len({w.packed is None for w in weights}) != 1):
            return None
        ffi = lib.ffi
        packed = weights[0].packed is not None
        plan = _FusedPlan(
            weights=tuple(weights), total_rows=sum(w.rows for w in weights), packed=packed,
            qtypes=ffi.new("int[]", [int(w.qtype) for w in weights]),
            addresses=ffi.new("uint8_t *[]", [
                ffi.cast("uint8_t *", w.packed.ctypes.data if packed else w.address)
                for w in weights]),
            row_bytes=ffi.new("int64_t[]", [w.data.strides[0] for w in weights]),
            rows=ffi.new("int[]", [w.rows for w in weights]))
        self._plans[key] = plan
        return plan

    def _matmul_tiled(self, x: np.ndarray, w: QuantMatrix) -> np.ndarray:
        """Prefill: each worker decodes a tile of rows to f32 and multiplies it with BLAS."""
        out_t = np.empty((w.rows, x.shape[0]), dtype=np.float32)  # (out, n): tiles are rows
        # several tiles per worker, so one descheduled worker does not hold up the rest
        tile_rows = max(64, min(TILE_BYTES // (4 * w.cols), -(-w.rows // (4 * self.threads))))
        # the f32 product of llama.cpp's 8-bit-rounded activations with the decoded weights
        x_t = np.ascontiguousarray(round_activations_like_ggml(x, w.qtype).T)  # (in, n)

        nq = _numba()[1]

        def run_tile(r0: int) -> None:
            r1 = min(w.rows, r0 + tile_rows)
            tile = np.empty((r1 - r0, w.cols), dtype=np.float32)  # (tile, in)
            if w.planes is not None:
                _numba_packed().dequantize_rows(w.planes, np.arange(r0, r1, dtype=np.int64),
                                                tile)
            else:
                nq.dequant_rows_serial(w.code, w.data, r0, r1, tile, nq.F16_TABLE)
            np.matmul(tile, x_t, out=out_t[r0:r1])

        with blas_threads(1):
            list(self._workers().map(run_tile, range(0, w.rows, tile_rows)))
        return np.ascontiguousarray(out_t.T)  # (n, out)

    def _numba_pool(self):
        """The Numba mat-vec's threads (numba_pool: barrier-free, as the C kernels'), started
        on first use."""
        if self._matvec_pool is None:
            from .numba_pool import MatvecPool

            self._matvec_pool = MatvecPool(self.threads)
        return self._matvec_pool

    def _workers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="edgellm-cpu")
        return self._pool

    # -- small fused ops (C, else Numba) ----------------------------------------------------
    def rms_norm(self, x, weight, eps):
        x = np.ascontiguousarray(x, dtype=np.float32)  # (..., d)
        if self.native is None:
            return _numba()[0].rms_norm(x, weight, np.float32(eps))
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        out = np.empty_like(x)
        f = self.native.ffi.from_buffer
        self.native.lib.ek_rms_norm(f("float[]", x), f("float[]", weight), f("float[]", out),
                                    x.size // x.shape[-1], x.shape[-1], float(eps))
        return out

    def silu_mul(self, gate, up):
        if self.native is None:
            return _numba()[0].silu_mul(gate, up)
        return self._elementwise("ek_silu_mul", gate, up)

    def gelu_tanh_mul(self, gate, up):
        if self.native is None:
            return _numba()[0].gelu_tanh_mul(gate, up)
        return self._elementwise("ek_gelu_tanh_mul", gate, up)

    def _elementwise(self, kernel: str, gate, up):
        """out = f(gate) * up by a one-pass C kernel (no numpy temporaries; threaded when
        large, as in prefill)."""
        gate = np.ascontiguousarray(gate, dtype=np.float32)
        up = np.ascontiguousarray(up, dtype=np.float32)
        out = np.empty_like(gate)
        f = self.native.ffi.from_buffer
        getattr(self.native.lib, kernel)(f("float[]", gate), f("float[]", up), f("float[]", out),
                                         gate.size, self.threads)
        return out

    def rope(self, x, positions, theta, neox, freq_factors=None, freq_scale=1.0):
        cos, sin = self._rope_tables(np.asarray(positions), x.shape[-1], theta, freq_factors,
                                     freq_scale)  # (n, hd/2) each
        x = np.ascontiguousarray(x, dtype=np.float32)  # (n, heads, hd)
        if self.native is None:
            return _numba()[0].rope(x, cos, sin, neox)
        out = np.empty_like(x)
        f = self.native.ffi.from_buffer
        self.native.lib.ek_rope(f("float[]", x), f("float[]", cos), f("float[]", sin),
                                f("float[]", out), x.shape[0], x.shape[1], x.shape[2], bool(neox))
        return out

    def _rope_tables(self, positions, hd, theta, freq_factors, freq_scale):
        """cos/sin for these positions, computed once per forward pass, not per layer: every
        layer (and Q and K) of a step turns the same positions by the same few RoPE bases."""
        key = (positions.tobytes(), hd, float(theta), float(freq_scale), id(freq_factors))
        tables = self._rope_cache.get(key)
        if tables is None:
            if len(self._rope_cache) >= 8:  # older steps' positions are never asked for again
                self._rope_cache.clear()
            # the entry holds freq_factors, so the id in its key cannot be reused meanwhile
            tables = (*rope_tables(positions, hd, theta, freq_factors, freq_scale), freq_factors)
            self._rope_cache[key] = tables
        return tables[:2]

    def attention(self, q, k, v, mask, scale, softcap=0.0):
        if k.dtype not in (np.float16, np.float32):
            return super().attention(q, k, v, mask, scale, softcap)
        if self._c_attention_takes(q, (k,)):
            return self._attention_f16(q, k, v, mask, scale, softcap)
        if q.shape[0] > ATTENTION_KERNEL_MAX_TOKENS:
            return self._attention_blocked(q, k, v, mask, scale, softcap)
        if self.native is not None:  # an f32 cache, or an odd head size: rare, no Numba
            return super().attention(q, k, v, mask, scale, softcap)
        nops, nq = _numba()
        return nops.attention(q, k, v, mask, scale, softcap, nq.F16_TABLE)

    def _attention_f16(self, q, k, v, mask, scale, softcap):
        """Attention over the f16 cache in C (F16C loads, f32 arithmetic), flash style, one
        unit of work per KV head and block of 16 tokens on the kernels' threads. A token's
        result does not depend on the rest of the batch, so decode, speculative checks and
        prompts agree."""
        out = self._attention_f16_parts(q, [(k, v, mask)], scale, softcap)
        return super().attention(q, k, v, mask, scale, softcap) if out is None else out

    def attention_batch(self, q, parts, scale, softcap=0.0):
        """Every sequence's attention in one C job (a batched decode step: one row per
        sequence), the units shared across the threads; the same bits as ``attention`` gives
        each sequence alone. Other layouts take the per-sequence loop."""
        out = None
        if self._c_attention_takes(q, [a for k, v, _ in parts for a in (k, v)]):
            out = self._attention_f16_parts(q, parts, scale, softcap)
        return super().attention_batch(q, parts, scale, softcap) if out is None else out

    def attention_append(self, q, k, v, stores, slots, firsts, scale, softcap=0.0):
        """The whole layer in one C call (rows stored as f16, masks built in C): the same
        bits as the base class's writes and ``attention_batch``."""
        if not self._c_attention_takes(q, [a for pair in stores for a in pair]):
            return super().attention_append(q, k, v, stores, slots, firsts, scale, softcap)
        q = np.ascontiguousarray(q, dtype=np.float32)  # (N, H, hd)
        k = np.ascontiguousarray(k, dtype=np.float32)  # (N, KVH, hd)
        v = np.ascontiguousarray(v, dtype=np.float32)
        out = np.empty_like(q)
        f = self.native.ffi.from_buffer
        n_kv = k.shape[1]
        macs = sum(slot + 1 for slot in slots) * q[0].size
        status = self.native.lib.ek_attention_f16_append(
            len(stores), f("float[]", q), f("float[]", k), f("float[]", v),
            [f("uint16_t[]", keys) for keys, _ in stores],
            [f("uint16_t[]", values) for _, values in stores], slots, firsts, q.shape[1],
            n_kv, q.shape[2], float(scale), float(softcap), f("float[]", out),
            self._attention_threads(macs))
        if status == -2:  # a head layout the kernel does not take (nothing written)
            return super().attention_append(q, k, v, stores, slots, firsts, scale, softcap)
        if status != 0:
            raise MemoryError("no memory for attention scores")
        return out

    # -- a decode step's whole block in one C call --------------------------------------------
    def prepare_decode_block(self, block, shape: BlockShape) -> _BlockPlan | None:
        """ek_decode_block's description of the block where every matrix is packed and the
        shapes are the kernels' (else None: op by op)."""
        if self.native is None or shape.head_dim % 8 or shape.activation not in (
                "silu", "gelu_tanh"):
            return None
        a = block.attn
        mats = block.matrices()
        if not all(isinstance(w, QuantMatrix) and w.packed is not None for w in mats):
            return None
        d, qd, kvd, ffn = (shape.d, shape.n_heads * shape.head_dim,
                           shape.n_kv_heads * shape.head_dim, shape.ffn)
        want = [(d, qd), (d, kvd), (d, kvd), (qd, d), (d, ffn), (d, ffn), (ffn, d)]
        if [(w.cols, w.rows) for w in mats] != want or (a.q_norm is None) != (a.k_norm is None):
            return None
        ffi = self.native.ffi
        vectors = {}
        for name, vec, size in (("attn_norm", block.attn_norm, d), ("ffn_norm", block.ffn_norm, d),
                                ("post_attn_norm", block.post_attn_norm, d),
                                ("post_ffn_norm", block.post_ffn_norm, d),
                                ("q_norm", a.q_norm, shape.head_dim),
                                ("k_norm", a.k_norm, shape.head_dim),
                                ("bq", a.bq, qd), ("bk", a.bk, kvd), ("bv", a.bv, kvd)):
            if vec is None:
                continue
            if not (isinstance(vec, np.ndarray) and vec.dtype == np.float32
                    and vec.flags.c_contiguous and vec.size == size):
                return None
            vectors[name] = vec
        if "attn_norm" not in vectors or "ffn_norm" not in vectors:
            return None

        def ptr(name):
            return ffi.from_buffer("float[]", vectors[name]) if name in vectors else ffi.NULL

        def packed(w):
            return ffi.cast("uint8_t *", w.packed.ctypes.data)

        qkv = ffi.new("uint8_t *[]", [packed(w) for w in mats[:3]])
        qkv_types = ffi.new("int[]", [int(w.qtype) for w in mats[:3]])
        biases = [ptr(name) for name in ("bq", "bk", "bv")]
        qkv_bias = ffi.new("float *[]", biases)
        gate_up = ffi.new("uint8_t *[]", [packed(w) for w in mats[4:6]])
        desc = ffi.new("block_t *", {
            "d": d, "n_heads": shape.n_heads, "n_kv": shape.n_kv_heads, "hd": shape.head_dim,
            "ffn": ffn, "eps": shape.eps, "scale": shape.scale, "softcap": shape.softcap,
            "neox": int(shape.neox), "gelu": int(shape.activation == "gelu_tanh"),
            "attn_norm": ptr("attn_norm"), "q_norm": ptr("q_norm"), "k_norm": ptr("k_norm"),
            "post_attn_norm": ptr("post_attn_norm"), "ffn_norm": ptr("ffn_norm"),
            "post_ffn_norm": ptr("post_ffn_norm"), "qkv_types": qkv_types, "qkv": qkv,
            "qkv_bias": qkv_bias, "wo_type": int(a.wo.qtype),
            "gate_up_types": [int(block.w_gate.qtype), int(block.w_up.qtype)],
            "down_type": int(block.w_down.qtype), "wo": packed(a.wo),
            "down": packed(block.w_down), "gate_up": gate_up})
        keep = (mats, vectors, qkv, qkv_types, qkv_bias, gate_up, biases)
        # normed, h (n, d); q, k, v; RoPE'd q, k; attention (n, qd); gate, up, act (n, ffn)
        scratch = 2 * d + (qd + 2 * kvd) + (qd + kvd) + qd + 3 * ffn
        return _BlockPlan(desc, keep, shape, scratch)

    def decode_blocks(self, plans, x, positions, ropes, stores, claim):
        """The blocks in one C call (native/cpu_block.c): the op path's kernels, in its order,
        on the same arguments."""
        x = np.array(x, dtype=np.float32, order="C", copy=True)  # (n, d), updated in place
        n, width = x.shape
        if n > MATVEC_MAX_TOKENS or any(p.width != width for p in plans):
            return None
        for per_block in stores:
            if len(per_block) != n:
                return None
            for keys, values in per_block:
                if keys.dtype != np.float16 or values.dtype != np.float16:
                    return None
        f = self.native.ffi.from_buffer
        positions = np.asarray(positions)
        tables, cos, sin = {}, [], []
        for plan, (theta, freq_scale, freq_factors) in zip(plans, ropes, strict=True):
            key = (plan.shape.head_dim, theta, freq_scale, id(freq_factors))
            if key not in tables:  # (n, hd/2) each: one or two RoPE bases a model
                c, sn = self._rope_tables(positions, plan.shape.head_dim, theta, freq_factors,
                                          freq_scale)
                tables[key] = (f("float[]", c), f("float[]", sn))
            cos.append(tables[key][0])
            sin.append(tables[key][1])
        slots, firsts = claim()
        macs = [sum(slot + 1 for slot in slots[b * n:(b + 1) * n])
                * plan.shape.n_heads * plan.shape.head_dim for b, plan in enumerate(plans)]
        attn_threads = [self._attention_threads(m) for m in macs]
        scratch = np.empty(n * max(p.scratch_floats for p in plans), dtype=np.float32)
        status = self.native.lib.ek_decode_blocks(
            [p.desc for p in plans], len(plans), f("float[]", x), n,
            [f("uint16_t[]", keys) for per_block in stores for keys, _ in per_block],
            [f("uint16_t[]", values) for per_block in stores for _, values in per_block],
            slots, firsts, cos, sin, f("float[]", scratch), self.threads, attn_threads)
        if status != 0:
            raise MemoryError("no memory for a decode step's activations")
        return x

    def _attention_threads(self, macs: int) -> int:
        """Threads for an attention job of ``macs`` multiply-adds (one below the size where
        waking the helpers pays)."""
        return self.threads if macs >= ATTENTION_THREADS_MIN_MACS else 1

    def _c_attention_takes(self, q, cached) -> bool:
        """The C attention kernel's case: C kernels loaded, an f16 cache (``cached``: the
        key/value arrays), a head size in 8s."""
        return (self.native is not None and q.shape[-1] % 8 == 0
                and all(a.dtype == np.float16 for a in cached))

    def _attention_f16_parts(self, q, parts, scale, softcap) -> np.ndarray | None:
        """q (N, H, hd) against one (k, v, mask) per sequence of its rows, in one C job; None
        for a head layout the kernel does not take (heads not a multiple of KV heads)."""
        q = np.ascontiguousarray(q, dtype=np.float32)  # (N, H, hd)
        keys = [np.ascontiguousarray(k) for k, _, _ in parts]  # (T_j, KVH, hd) f16
        values = [np.ascontiguousarray(v) for _, v, _ in parts]
        masks = [np.ascontiguousarray(m, dtype=np.uint8) for _, _, m in parts]  # (n_j, T_j)
        rows = [m.shape[0] for m in masks]
        if sum(rows) != q.shape[0]:
            raise ValueError(f"the masks cover {sum(rows)} rows of {q.shape[0]} queries")
        out = np.empty_like(q)
        macs = sum(n * k.shape[0] for n, k in zip(rows, keys, strict=True)) * q[0].size
        threads = self._attention_threads(macs)
        f = self.native.ffi.from_buffer
        status = self.native.lib.ek_attention_f16_batch(
            len(parts), f("float[]", q), [f("uint16_t[]", k) for k in keys],
            [f("uint16_t[]", v) for v in values], [f("uint8_t[]", m) for m in masks], rows,
            [k.shape[0] for k in keys], q.shape[1], keys[0].shape[1], q.shape[2], float(scale),
            float(softcap), f("float[]", out), threads)
        if status == -2:
            return None
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
