"""Scoped control of numpy's OpenBLAS thread count (where numpy links OpenBLAS).

The tiled prefill runs one BLAS call per worker thread, so BLAS itself must stay on one thread
meanwhile: two thread pools spinning against each other on two cores lose most of the time.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

_NAMES = [("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
          ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
          ("openblas_get_num_threads", "openblas_set_num_threads")]


@cache
def _openblas():
    """(get, set) thread-count functions of the loaded OpenBLAS, or None."""
    import numpy  # noqa: F401  (loads its BLAS)

    try:
        with open("/proc/self/maps") as f:
            paths = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", f.read())))
    except OSError:
        return None
    for path in paths:
        lib = ctypes.CDLL(path)
        for get, put in _NAMES:
            if hasattr(lib, get) and hasattr(lib, put):
                return getattr(lib, get), getattr(lib, put)
    return None


@contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Run the block with numpy's BLAS on n threads, then restore the previous count."""
    funcs = _openblas()
    if funcs is None:
        yield
        return
    get, put = funcs
    before = get()
    put(n)
    try:
        yield
    finally:
        put(before)
