"""Loader for the converter's C quantizers (quantize.c), built with cffi on first use.

Portable flags only (no instruction-set switches: a file quantized on one machine must have
the same bytes as on any other) and no FMA contraction, so the 32-block types match ggml's
reference rounding bit for bit. Raises RuntimeError with what to install when it cannot build.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Any

from edgellm.native.cpu_kernels import cache_dir

SOURCE = Path(__file__).with_name("quantize.c")
CDEF = """
int eq_quantize_rows(int type, const float *x, uint8_t *out, int64_t nrows, int64_t ncols,
                     int64_t row_bytes, const float *imatrix);
"""
FLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off", "-fno-fast-math"]

_module: list[Any] = []


def _build() -> Path:
    import cffi

    source = SOURCE.read_text()
    key = hashlib.sha256((source + CDEF + " ".join(FLAGS)).encode()).hexdigest()[:12]
    name = f"_edgellm_quantize_{key}"
    out_dir = cache_dir()
    found = list(out_dir.glob(name + "*.so")) if out_dir.is_dir() else []
    if found:
        return found[0]
    out_dir.mkdir(parents=True, exist_ok=True)
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(name, source, extra_compile_args=FLAGS)
    return Path(ffi.compile(tmpdir=str(out_dir)))


def load() -> Any:
    """The compiled module (``.lib.eq_quantize_rows``, ``.ffi``); built once per source."""
    if not _module:
        try:
            path = _build()
            spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as exc:
            raise RuntimeError(f"the quantizers need a C compiler and cffi ({exc}); install "
                               "gcc or clang and `pip install cffi`") from exc
        _module.append(module)
    return _module[0]
