"""float32 tensors to GGUF tensor bytes: plain floats in numpy, quantized blocks in C.

The block quantizers live in ``native/quantize.c`` (ggml's layouts; Q8_0/Q4_0/Q5_0/Q5_1
bit-identical to ggml's reference rounding; K-quants by a weighted least-squares search).
Rows are split across threads: the C call releases the GIL.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

#: types the C quantizers write
BLOCK_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
#: rows per C call: enough work to amortize the call, small enough to spread over threads
ROWS_PER_TASK = 64


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays a NaN."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = ((bits.astype(np.uint64) + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(is_nan, ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def row_bytes(qtype: GGMLQuantizationType, n_cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return n_cols // block * size


def fits(qtype: GGMLQuantizationType, n_cols: int) -> bool:
    """Whether rows of ``n_cols`` values can be stored as ``qtype`` (whole blocks)."""
    return n_cols % GGML_QUANT_SIZES[qtype][0] == 0


def quantize(values: np.ndarray, qtype: GGMLQuantizationType,
             imatrix: np.ndarray | None = None, threads: int | None = None) -> np.ndarray:
    """A float tensor (..., n_cols) as ``qtype``: uint8 of shape (..., row_bytes).

    ``imatrix`` (n_cols,) weights the search of Q4_0/Q5_0/Q5_1 and the K-quants (mean squared
    activations per input column); Q8_0 and float types ignore it.
    """
    values = np.asarray(values)
    if qtype == Q.F32:
        return np.ascontiguousarray(values, dtype=np.float32).view(np.uint8)
    if qtype == Q.F16:
        return np.ascontiguousarray(values, dtype=np.float32).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        return to_bf16_bits(values).view(np.uint8)
    if qtype not in BLOCK_TYPES:
        raise ValueError(f"no quantizer for {qtype.name}; supported: "
                         + ", ".join(t.name for t in FLOAT_TYPES + BLOCK_TYPES))
    n_cols = values.shape[-1]
    if not fits(qtype, n_cols):
        raise ValueError(f"rows of {n_cols} values are not whole {qtype.name} blocks "
                         f"({GGML_QUANT_SIZES[qtype][0]} values)")
    rows = np.ascontiguousarray(values.reshape(-1, n_cols), dtype=np.float32)  # (n_rows, n_cols)
    rb = row_bytes(qtype, n_cols)
    out = np.empty((rows.shape[0], rb), dtype=np.uint8)
    weights = None
    if imatrix is not None and qtype != Q.Q8_0:
        weights = np.ascontiguousarray(imatrix, dtype=np.float32)
        if weights.shape != (n_cols,):
            raise ValueError(f"importance matrix has {weights.size} columns, tensor {n_cols}")
    _run_c(int(qtype), rows, out, rb, weights, threads or os.cpu_count() or 1)
    return out.reshape(*values.shape[:-1], rb)


def _run_c(type_id: int, rows: np.ndarray, out: np.ndarray, rb: int,
           weights: np.ndarray | None, threads: int) -> None:
    from edgellm.native.quantize import load

    module = load()
    ffi, lib = module.ffi, module.lib
    n_rows, n_cols = rows.shape
    w_ptr = ffi.NULL if weights is None else ffi.from_buffer("float[]", weights)

    def task(start: int) -> None:
        stop = min(n_rows, start + ROWS_PER_TASK)
        x = ffi.from_buffer("float[]", rows[start:stop])
        o = ffi.from_buffer("uint8_t[]", out[start:stop], require_writable=True)
        if lib.eq_quantize_rows(type_id, x, o, stop - start, n_cols, rb, w_ptr) != 0:
            raise ValueError(f"quantizer refused type {type_id}")

    starts = range(0, n_rows, ROWS_PER_TASK)
    if threads <= 1 or n_rows <= ROWS_PER_TASK:
        for s in starts:
            task(s)
        return
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(task, starts))
