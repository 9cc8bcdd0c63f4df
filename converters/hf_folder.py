"""A Hugging Face model folder, read without loading it: config, tokenizer files, and the
tensor table of its safetensors files (single or sharded), validated before any weight is read.

Safetensors files are parsed here (an 8-byte header length, a JSON header of names, dtypes,
shapes and byte ranges, then the data) and memory-mapped; ``read(name)`` converts one tensor
to float32, so a conversion holds one tensor at a time, not the model.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: safetensors dtype -> bytes per element (the ones a checkpoint of this kind holds)
DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie: its shard, dtype, shape (numpy order) and byte range."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int  # absolute offsets in the shard
    end: int

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass
class HFFolder:
    """A validated model folder. ``tensors`` maps HF names to entries; nothing is read yet."""

    path: Path
    config: dict[str, Any]
    tensors: dict[str, TensorEntry]
    tokenizer_config: dict[str, Any] = field(default_factory=dict)
    generation_config: dict[str, Any] = field(default_factory=dict)
    _maps: dict[Path, mmap.mmap] = field(default_factory=dict, repr=False)

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return str(archs[0]) if archs else ""

    @property
    def source_bytes(self) -> int:
        return sum(t.end - t.start for t in self.tensors.values())

    def has_file(self, name: str) -> bool:
        return (self.path / name).is_file()

    def read(self, name: str) -> np.ndarray:
        """One tensor as float32 (F32: a read-only view of the mapping; else a converted copy)."""
        entry = self.tensors[name]
        mm = self._maps.get(entry.path)
        if mm is None:
            with open(entry.path, "rb") as f:
                mm = self._maps[entry.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count = entry.n_elements
        if entry.dtype == "F32":
            out = np.frombuffer(mm, np.float32, count, entry.start)  # a view: no copy
        elif entry.dtype == "F16":
            out = np.frombuffer(mm, np.float16, count, entry.start).astype(np.float32)
        else:  # BF16: the high half of an f32
            raw = np.frombuffer(mm, np.uint16, count, entry.start)
            out = (raw.astype(np.uint32) << 16).view(np.float32)
        return out.reshape(entry.shape)

    def release(self, name: str) -> None:
        """Let the page cache drop a tensor's pages once it is written (bounded RSS)."""
        entry = self.tensors[name]
        mm = self._maps.get(entry.path)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            page = mmap.PAGESIZE
            start = entry.start // page * page
            try:
                mm.madvise(mmap.MADV_DONTNEED, start, entry.end - start)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:  # a tensor view is still alive: the GC unmaps it later
                pass
        self._maps.clear()


def _load_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read {what} ({exc}); re-download the model "
                         "folder") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {what} is not a JSON object; re-download the model folder")
    return data


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The tensor table of one .safetensors file, every entry checked against the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path}: safetensors header length {n} does not fit the "
                             f"{size}-byte file: truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: safetensors header is not JSON ({exc})") from None
    base = 8 + n
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ValueError(f"{path}: tensor {name!r} has no dtype/shape/data_offsets entry")
        dtype, shape = info.get("dtype"), info.get("shape", ())
        offsets = info.get("data_offsets", (0, -1))
        if not isinstance(shape, list | tuple) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"{path}: tensor {name!r} has a bad shape {shape!r:.60}")
        if not isinstance(offsets, list | tuple) or len(offsets) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in offsets):
            raise ValueError(f"{path}: tensor {name!r} has bad data_offsets {offsets!r:.60}")
        shape, (begin, end) = tuple(shape), offsets
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}; only "
                             f"{', '.join(DTYPE_SIZES)} checkpoints can be converted")
        expected = math.prod(shape) * DTYPE_SIZES[dtype]  # Python ints: no wrap-around
        if end - begin != expected or begin < 0:
            raise ValueError(f"{path}: tensor {name!r} of shape {list(shape)} {dtype} needs "
                             f"{expected} bytes but its range holds {end - begin}")
        if base + end > size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file "
                             f"({base + end} > {size} bytes): the file is truncated")
        entries[name] = TensorEntry(name, dtype, shape, path, base + begin, base + end)
    return entries


def open_folder(folder: str | os.PathLike) -> HFFolder:
    """Read and validate a model folder's config, tokenizer config and tensor tables.

    Raises FileNotFoundError or ValueError, naming the file and what to do, for a missing
    config or weights, a broken shard index (missing shard, tensor not where the index says),
    truncated files and unsupported dtypes.
    """
    path = Path(folder)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model folder")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json; this is not a Hugging Face model "
                                "folder")
    config = _load_json(path / "config.json", "config.json")
    if isinstance(config.get("text_config"), dict) and "num_hidden_layers" not in config:
        config = {**config["text_config"], "architectures": config.get("architectures")}
    tensors = _tensor_table(path)
    tok_config = (_load_json(path / "tokenizer_config.json", "tokenizer_config.json")
                  if (path / "tokenizer_config.json").is_file() else {})
    gen_config = (_load_json(path / "generation_config.json", "generation_config.json")
                  if (path / "generation_config.json").is_file() else {})
    return HFFolder(path, config, tensors, tok_config, gen_config)


def _tensor_table(path: Path) -> dict[str, TensorEntry]:
    index_path = path / INDEX_FILE
    if index_path.is_file():
        index = _load_json(index_path, "the shard index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path}: no weight_map; re-download the model folder")
        tables: dict[str, dict[str, TensorEntry]] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = path / shard
            if not shard_path.is_file():
                raise FileNotFoundError(f"{shard_path}: shard named by {INDEX_FILE} is "
                                        "missing; re-download the model folder")
            tables[shard] = read_safetensors_header(shard_path)
        tensors = {}
        for name, shard in weight_map.items():
            if name not in tables[shard]:
                raise ValueError(f"{index_path}: tensor {name!r} is not in {shard} as the "
                                 "index says; re-download the model folder")
            tensors[name] = tables[shard][name]
        return tensors
    if (path / SINGLE_FILE).is_file():
        return read_safetensors_header(path / SINGLE_FILE)
    shards = sorted(path.glob("*.safetensors"))
    if len(shards) == 1:
        return read_safetensors_header(shards[0])
    if shards:
        raise ValueError(f"{path}: {len(shards)} .safetensors files but no {INDEX_FILE}; "
                         "re-download the model folder with its index")
    raise FileNotFoundError(f"{path}: no .safetensors weights (only safetensors checkpoints "
                            "can be converted)")
