"""Quant types and the numpy reference dequantizer: the oracle every fast kernel is tested against.

Block layouts are ggml's own; gguf-py carries both the size table and vectorised numpy
dequantizers for every type, so this module only names the supported set.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as _gguf_quants

Q = GGMLQuantizationType

#: The types every backend must handle (the core list of DESIGN.md).
CORE_TYPES: tuple[GGMLQuantizationType, ...] = (
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K,
)


def block_size(qtype: GGMLQuantizationType) -> int:
    """Elements per block (1 for plain float types)."""
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: GGMLQuantizationType) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[qtype][1]


def row_bytes(qtype: GGMLQuantizationType, n: int) -> int:
    """Bytes taken by a row of ``n`` elements."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    return n // bs * ts


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Raw blocks (uint8, last axis = bytes) to float32 (last axis = elements)."""
    if qtype == Q.F32:
        return data.view(np.float32)
    if qtype == Q.F16:
        return data.view(np.float16).astype(np.float32)
    return np.asarray(_gguf_quants.dequantize(data, qtype), dtype=np.float32)


def quantize(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 to raw blocks, for the types gguf-py can quantize (tests and the converter)."""
    if qtype == Q.F32:
        return np.ascontiguousarray(values, dtype=np.float32).view(np.uint8)
    if qtype == Q.F16:
        return np.ascontiguousarray(values, dtype=np.float16).view(np.uint8)
    return _gguf_quants.quantize(np.asarray(values, dtype=np.float32), qtype)
