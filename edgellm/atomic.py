"""Atomic file writes: a file appears under its final name complete, or not at all.

Everything edgellm writes (pulled models, saved chats, converted models, imatrix files) goes
through ``atomic_write``: the bytes go to a temporary file in the same folder (same file
system, so the rename is atomic), which is flushed and fsynced, then renamed over the final
name, and the folder is fsynced so the rename itself survives a crash. A writer killed at any
moment leaves the previous file (if any) intact and at worst a stray ``.NAME.*.tmp`` file,
never a partial file under the final name.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

TEMP_SUFFIX = ".tmp"


def _default_mode() -> int:
    """The permissions a plain ``open(path, "w")`` would give (mkstemp's are 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


_NEW_FILE_MODE = _default_mode()


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it replaces ``path``.

    ``mode`` is "wb" or "w" (text; ``encoding`` etc. go through ``open_kwargs``). If the body
    raises, the temporary file is removed and ``path`` is untouched.

        with atomic_write("chat.json", "w", encoding="utf-8") as f:
            f.write(text)
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode must be 'w' or 'wb', not {mode!r}")
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        # the previous file's permissions, else those a plain open() would give
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else _NEW_FILE_MODE)
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path."""
    with atomic_write(path, "wb") as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically; returns the path."""
    with atomic_write(path, "w", encoding=encoding) as f:
        f.write(text)
    return Path(path)


def stray_temp_files(folder: str | os.PathLike, name: str) -> list[Path]:
    """Temporary files ``atomic_write`` left for ``name`` (a writer killed mid-write)."""
    return sorted(Path(folder).glob(f".{name}.*{TEMP_SUFFIX}"))
