"""Loader for the converter's C quantizers (quantize.c), built with cffi on first use.

Portable flags only (no instruction-set switches: a file quantized on one machine must have
the same bytes as on any other) and no FMA contraction, so the 32-block types match ggml's
reference rounding bit for bit. Raises RuntimeError with what to install when it cannot build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgellm.native.cpu_kernels import build_extension, import_extension

SOURCE = Path(__file__).with_name("quantize.c")
CDEF = """
int eq_quantize_rows(int type, const float *x, uint8_t *out, int64_t nrows, int64_t ncols,
                     int64_t row_bytes, const float *imatrix);
"""
FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fno-fast-math"]

_module: list[Any] = []


def load() -> Any:
    """The compiled module (``.lib.eq_quantize_rows``, ``.ffi``); built once per source."""
    if not _module:
        try:
            module = import_extension(
                build_extension("_edgellm_quantize", SOURCE.read_text(), CDEF, FLAGS))
        except Exception as exc:
            raise RuntimeError(f"the quantizers need a C compiler and cffi ({exc}); install "
                               "gcc or clang and `pip install cffi`") from exc
        _module.append(module)
    return _module[0]
