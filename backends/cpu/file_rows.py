"""Rows of a weight table read from its file with ``pread``, not through the file's mapping.

A decode step looks up one row of the embedding table. Read through the mapping, that row
faults in a whole page-cache folio (2 MB on this VM), which has to be dropped again
(``release_file_rows``) or the table grows resident token by token. With a step's weights
just streamed through the caches, mapping and unmapping a folio's 512 pages cost 375 us a
token on the 0.5B (3% of its decode); a ``pread`` of the row's 616 bytes costs ~2 us and
maps nothing.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import numpy as np


class FileRows:
    """Reads rows of a (rows, row_bytes) table stored at ``offset`` in file ``path``."""

    def __init__(self, path: Path, offset: int, rows: int, row_bytes: int):
        self.offset, self.rows, self.row_bytes = offset, rows, row_bytes
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, self._fd)

    @classmethod
    def open(cls, path: Path, offset: int, table: np.ndarray) -> FileRows | None:
        """A reader of ``table``'s rows from its file, or None where this OS has no pread,
        the file cannot be opened, or it no longer holds what was mapped (replaced since)."""
        if not hasattr(os, "pread") or table.ndim != 2 or len(table) == 0:
            return None
        try:
            reader = cls(path, offset, len(table), table.strides[0])
            same = reader.read(np.array([0, len(table) - 1])).tobytes() == \
                np.ascontiguousarray(table[[0, -1]]).tobytes()
        except OSError:
            return None
        return reader if same else None

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (n,) as a (n, row_bytes) uint8 array; IndexError for an id out of
        range, OSError if the file was cut short."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.rows):
            raise IndexError(f"token id out of range 0..{self.rows - 1}")
        out = np.empty((len(ids), self.row_bytes), dtype=np.uint8)
        for j, i in enumerate(ids.tolist()):
            data = os.pread(self._fd, self.row_bytes, self.offset + i * self.row_bytes)
            if len(data) != self.row_bytes:
                raise OSError(f"the model file ended inside row {i} of a table: it was cut "
                              "short after loading; reload the model")
            out[j] = np.frombuffer(data, dtype=np.uint8)
        return out
