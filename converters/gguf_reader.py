"""Memory-mapped GGUF reader that validates a file before anything uses it.

The header is parsed here, with every count and length checked against the bytes that are
actually in the file, so a truncated or hostile file fails with one clear ``ValueError``
instead of a crash, an endless loop or a giant allocation. Tensor data is never copied: each
tensor is a numpy view over the memory map. Type constants and block sizes come from gguf-py.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NAME_BYTES = 1 << 16

# GGUF metadata value types: id -> (struct format, size); 8 = string, 9 = array.
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY_OF = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64,
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class QTensor:
    """A tensor as stored in the file: raw bytes plus the quant type that explains them.

    ``shape`` is in numpy order (rows first): a ggml tensor with ne = (in, out) has shape
    (out, in). ``data`` is a zero-copy uint8 view of shape (*shape[:-1], row_bytes).
    """

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    #: (file, byte offset of ``data`` in it) where data is a view of a file's mapping: a
    #: reader of a few rows may read them from the file instead of faulting the mapping in
    source: tuple[Path, int] | None = None

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    def dequantize(self) -> np.ndarray:
        """The tensor as float32 (numpy reference path; the oracle for fast kernels)."""
        from edgellm.quants import dequantize

        return dequantize(self.data, self.qtype).reshape(self.shape)


@dataclass
class GGUFFile:
    """A validated GGUF file: metadata, tensor table (zero-copy views) and the memory map."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, QTensor]
    data_offset: int
    file_size: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class StringArray(Sequence[str]):
    """A GGUF array of strings kept as the file's bytes: each item is decoded when asked for.

    A vocabulary as Python strings costs ~70 bytes a token plus the list (Gemma 3's 262,144
    tokens: ~20 MB; Qwen2's 151,387 merges: ~10 MB more); here it is the UTF-8 bytes plus
    12 bytes of offsets a string. Invalid UTF-8 decodes with replacement characters.
    """

    def __init__(self, blob: bytes, starts: np.ndarray, lengths: np.ndarray):
        self._blob, self._starts, self._lengths = blob, starts, lengths  # (n,) each

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        start = int(self._starts[i])
        raw = self._blob[start:start + int(self._lengths[i])]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))

    def first_difference(self, other: StringArray, n: int) -> int | None:
        """The first of items 0..n whose bytes differ between self and other, or None: their
        lengths and bytes compared as arrays (a vocabulary of 152k tokens item by item took
        0.22 s, decoding each)."""
        lengths = [a._lengths[:n].astype(np.int64) for a in (self, other)]
        differs = np.flatnonzero(lengths[0] != lengths[1])
        n = int(differs[0]) if differs.size else n  # (the bytes before it line up)
        mine, theirs = (a._item_bytes(n) for a in (self, other))
        byte = np.flatnonzero(mine != theirs)
        if byte.size:  # the item holding the first differing byte
            return int(np.searchsorted(np.cumsum(lengths[0][:n]), byte[0], side="right"))
        return n if differs.size else None

    def _item_bytes(self, n: int) -> np.ndarray:
        """Items 0..n's bytes, concatenated: (sum of their lengths,) uint8."""
        lengths = self._lengths[:n].astype(np.int64)
        before = np.cumsum(lengths) - lengths  # each item's place in the concatenation
        at = np.repeat(self._starts[:n].astype(np.int64) - before, lengths)
        return np.frombuffer(self._blob, np.uint8)[at + np.arange(at.size)]

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"

    @property
    def lengths(self) -> np.ndarray:
        """Each string's length in bytes (n,)."""
        return self._lengths


class _Cursor:
    """Bounds-checked little-endian reads over a buffer."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: not a valid GGUF file: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"truncated while reading {what} at byte {self.pos} "
                            f"(file has {len(self.buf)} bytes); re-download or re-convert it")

    def scalar(self, fmt: str, size: int, what: str):
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long (limit {limit})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def strings(self, count: int, what: str) -> StringArray:
        """``count`` length-prefixed strings, as one copy of their bytes and offsets."""
        first = self.pos
        starts = np.empty(count, dtype=np.int64)
        lengths = np.empty(count, dtype=np.uint32)
        unpack, buf, end = struct.unpack_from, self.buf, len(self.buf)
        pos = self.pos
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, f"length of element {i} of {what}")
            (n,) = unpack("<Q", buf, pos)
            if n >= 1 << 32:
                raise self.fail(f"element {i} of {what} is {n} bytes long")
            if n > end - pos - 8:
                self.pos = pos + 8
                self.need(n, f"element {i} of {what}")
            starts[i], lengths[i] = pos + 8 - first, n
            pos += 8 + n
        self.pos = pos
        return StringArray(bytes(buf[first:pos]), starts, lengths)

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.scalar(fmt, size, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth > 2:
                raise self.fail(f"{what}: arrays nested too deep")
            etype = self.u32(f"element type of {what}")
            count = self.u64(f"element count of {what}")
            if etype in _SCALARS:
                size = _SCALARS[etype][1]
                self.need(count * size, f"{count} elements of {what}")
                arr = np.frombuffer(self.buf, dtype=_NUMPY_OF[etype], count=count, offset=self.pos)
                self.pos += count * size
                return arr.copy()
            # each element takes at least 8 bytes: reject absurd counts before looping
            if etype == _STRING:
                self.need(count * 8, f"{count} elements of {what}")
                return self.strings(count, what)
            if etype == _ARRAY:
                self.need(count * 8, f"{count} elements of {what}")
                return [self.value(etype, what, depth + 1) for _ in range(count)]
            raise self.fail(f"{what}: unknown array element type {etype}")
        raise self.fail(f"{what}: unknown value type {vtype}")


def _row_bytes(qtype: GGMLQuantizationType, row_elems: int, name: str, path: Path) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    if row_elems % block:
        raise ValueError(f"{path}: tensor {name!r}: row of {row_elems} elements is not a "
                         f"multiple of the {qtype.name} block size {block}")
    return row_elems // block * type_size


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open, validate and memory-map a GGUF file.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming the problem for
    anything malformed: bad magic, unsupported version, truncation, absurd counts, unknown
    tensor types, tensors that overlap, are misaligned, or point past the end of the file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a GGUF file")
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path}: not a valid GGUF file: only {size} bytes")
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(memoryview(mm), path)
    if bytes(cur.buf[:4]) != GGUF_MAGIC:
        raise cur.fail(f"bad magic {bytes(cur.buf[:4])!r} (expected b'GGUF')")
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        raise cur.fail(f"unsupported GGUF version {version} (supported: 2, 3); "
                       "re-convert it with a current converter")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    # a key-value pair takes >= 13 bytes and a tensor entry >= 24: bound the loops by the file
    if n_kv * 13 > size or n_tensors * 24 > size:
        raise cur.fail(f"absurd counts ({n_tensors} tensors, {n_kv} metadata keys) "
                       f"for a {size}-byte file")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key", limit=MAX_NAME_BYTES)
        vtype = cur.u32(f"type of {key!r}")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int):
        raise cur.fail(f"general.alignment is a {type(alignment).__name__}, not an integer")
    if alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 30:
        raise cur.fail(f"general.alignment {alignment} is not a power of two")

    infos = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}", limit=MAX_NAME_BYTES)
        n_dims = cur.u32(f"rank of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
        ne = [cur.u64(f"dimension of {name!r}") for _ in range(n_dims)]
        if any(d == 0 or d > 1 << 40 for d in ne):
            raise cur.fail(f"tensor {name!r} has absurd dimensions {ne}")
        raw_type = cur.u32(f"type of {name!r}")
        offset = cur.u64(f"offset of {name!r}")
        try:
            qtype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise cur.fail(f"tensor {name!r} has unknown type id {raw_type}") from None
        if qtype not in GGML_QUANT_SIZES:
            raise cur.fail(f"tensor {name!r} has unsupported type {qtype.name}")
        infos.append((name, tuple(ne), qtype, offset))

    names = [info[0] for info in infos]
    if len(set(names)) != len(names):
        raise cur.fail("duplicate tensor names")
    data_offset = -(-cur.pos // alignment) * alignment

    tensors: dict[str, QTensor] = {}
    spans = []
    for name, ne, qtype, offset in infos:
        if offset % alignment:
            raise cur.fail(f"tensor {name!r} at offset {offset} is not aligned to {alignment}")
        row_bytes = _row_bytes(qtype, ne[0], name, path)
        n_rows = 1
        for d in ne[1:]:  # Python integers: a product of lying dimensions cannot wrap around
            n_rows *= d
        nbytes = row_bytes * n_rows
        start = data_offset + offset
        if start + nbytes > size:
            raise cur.fail(f"tensor {name!r} ({nbytes} bytes at {start}) runs past the end of "
                           f"the file ({size} bytes): the file is truncated")
        spans.append((start, start + nbytes, name))
        shape = tuple(reversed(ne))
        view = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=start)
        tensors[name] = QTensor(name, qtype, shape, view.reshape(*shape[:-1], row_bytes),
                                source=(path, start))
    spans.sort()
    for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:], strict=False):
        if start_b < end_a:
            raise cur.fail(f"tensors {a!r} and {b!r} overlap")

    return GGUFFile(path, version, metadata, tensors, data_offset, size)
