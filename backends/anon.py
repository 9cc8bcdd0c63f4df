"""Large, long-lived buffers (repacked weights, KV caches) in anonymous mappings of their own.

glibc serves a freed large block's size from its heap afterwards (its mmap threshold rises to
the largest block freed, up to 32 MB), and heap memory goes back to the system only from the
top: the repacked weights of one model, freed, stayed resident under the next one's (the
0.5B's load/free cycles through the C ABI held ~370 MB after the first free). A mapping of
its own is unmapped when the array is freed, whatever malloc has seen before.
"""

from __future__ import annotations

import mmap

import numpy as np


def anonymous_zeros(nbytes: int) -> np.ndarray:
    """A zero-filled (nbytes,) uint8 array in its own anonymous mapping, unmapped when the
    array (and every view of it) is garbage. Never pass it to ``release_file_pages``: that
    drops pages of any mapping, and these have no file to read them back from."""
    buffer = mmap.mmap(-1, max(int(nbytes), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buffer, dtype=np.uint8, count=int(nbytes))


#: below this, an ordinary allocation (a mapping per small array would waste address space
#: and system calls; malloc returns small blocks well enough)
MIN_MAPPED_BYTES = 1 << 20


def zeros(shape: tuple[int, ...], dtype="float32") -> np.ndarray:
    """np.zeros(shape, dtype), in its own mapping from MIN_MAPPED_BYTES up."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < MIN_MAPPED_BYTES:
        return np.zeros(shape, dtype=dtype)
    return anonymous_zeros(nbytes).view(dtype).reshape(shape)
