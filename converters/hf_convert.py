"""Hugging Face folder -> GGUF: plan (everything checked, nothing read), then stream.

``plan_conversion`` opens the folder's headers, names every tensor, checks shapes against
the config, builds the metadata and the tokenizer, and picks each tensor's type: an unknown
architecture, missing or inconsistent files and an unknown pre-tokenizer fail here, before
any weight is read. ``write_gguf`` then reads one tensor at a time from the memory-mapped
safetensors, transforms and quantizes it and appends it to ``OUT.partial``, which is fsynced
and renamed to ``OUT`` only when complete: peak memory follows the largest tensor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from edgellm.converters import hf_arch
from edgellm.converters.hf_folder import HFFolder, open_folder
from edgellm.converters.hf_tokenizer import tokenizer_metadata
from edgellm.converters.imatrix import ImportanceMatrix
from edgellm.converters.quantize import quantize
from edgellm.converters.recipe import OutType, Recipe, out_type

Q = GGMLQuantizationType
GGML_QUANT_VERSION = 2

#: progress(tensors_done, tensors_total, bytes_done, bytes_total) after each tensor
Progress = Callable[[int, int, int, int], None]


@dataclass(frozen=True)
class TensorPlan:
    hf_name: str
    name: str  # GGUF name
    shape: tuple[int, ...]  # numpy order
    qtype: GGMLQuantizationType
    note: str | None  # why it fell back from its recipe's type

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape, dtype=np.int64)) // block * size

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class ConversionPlan:
    folder: HFFolder
    spec: hf_arch.ArchSpec
    kind: OutType
    tensors: list[TensorPlan]
    metadata: dict[str, Any]  # full GGUF keys, in writing order
    imatrix: ImportanceMatrix | None = None
    imatrix_missing: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def n_parameters(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.total_bytes / max(1, self.n_parameters)

    @property
    def fallbacks(self) -> list[TensorPlan]:
        return [t for t in self.tensors if t.note]


def plan_conversion(src: str | os.PathLike, outtype: str = "f16",
                    imatrix: ImportanceMatrix | None = None,
                    name: str | None = None) -> ConversionPlan:
    """Validate the folder and decide every tensor's name and type; reads no weights."""
    folder = open_folder(src)
    spec = hf_arch.arch_spec(folder.config)
    kind = out_type(outtype)
    cfg = folder.config
    named = []
    for hf_name in sorted(folder.tensors):  # llama.cpp's converter writes in name order
        gguf_name = hf_arch.gguf_name(spec, hf_name)
        if gguf_name is not None:
            named.append((hf_name, gguf_name, folder.tensors[hf_name].shape))
    hf_arch.check_shapes(spec, cfg, {g: s for _, g, s in named})
    if "output.weight" not in {g for _, g, _ in named} and cfg.get("tie_word_embeddings") is False:
        raise ValueError("config.json says the output matrix is not tied to the embedding, but "
                         "the checkpoint has no lm_head.weight; re-download the folder")
    recipe = Recipe(kind, [g for _, g, _ in named])
    tensors = []
    for hf_name, gguf_name, shape in named:
        qtype, note = recipe.choose(gguf_name, shape)
        tensors.append(TensorPlan(hf_name, gguf_name, shape, qtype, note))
    n_params = sum(t.n_elements for t in tensors)
    metadata = _metadata(folder, spec, kind, name, n_params)
    missing = []
    if imatrix is not None:
        # the embedding is a lookup and the output matrix is not recorded by default
        missing = [t.name for t in tensors if t.qtype not in (Q.F32, Q.F16, Q.BF16, Q.Q8_0)
                   and t.name not in ("token_embd.weight", "output.weight")
                   and imatrix.weights(t.name) is None]
    return ConversionPlan(folder, spec, kind, tensors, metadata, imatrix, missing)


def _metadata(folder: HFFolder, spec: hf_arch.ArchSpec, kind: OutType,
              name: str | None, n_params: int) -> dict[str, Any]:
    from gguf.utility import size_label

    arch = spec.gguf_arch
    meta: dict[str, Any] = {"general.architecture": arch, "general.type": "model",
                            "general.name": name or _model_name(folder),
                            "general.size_label": size_label(n_params, 0, 0, 0)}
    meta.update({f"{arch}.{k}": v for k, v in hf_arch.model_metadata(spec, folder.config).items()})
    meta["general.file_type"] = int(kind.file_type)
    meta["general.quantization_version"] = GGML_QUANT_VERSION
    meta.update(tokenizer_metadata(folder, int(folder.config["vocab_size"])))
    return meta


def _model_name(folder: HFFolder) -> str:
    return folder.path.resolve().name.replace("-", " ").replace("_", " ").title()


def converted_tensors(plan: ConversionPlan,
                      threads: int | None = None) -> Iterator[tuple[TensorPlan, np.ndarray]]:
    """Each tensor's GGUF bytes (uint8 (rows..., row_bytes)) in plan order, one at a time."""
    cfg = plan.folder.config
    for t in plan.tensors:
        values = hf_arch.transform(plan.spec, cfg, t.name, plan.folder.read(t.hf_name))
        weights = plan.imatrix.weights(t.name) if plan.imatrix is not None else None
        data = quantize(values, t.qtype, imatrix=weights, threads=threads)
        del values
        plan.folder.release(t.hf_name)
        yield t, data


def check_writable(out: Path) -> None:
    """Refuse an output path that cannot be written, before any weight is read."""
    if out.is_dir():
        raise IsADirectoryError(f"{out}: is a directory; give a file name such as model.gguf")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"{parent}: no such directory for the output; create it first")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"{parent}: not writable; choose another output directory")


def write_gguf(plan: ConversionPlan, out: str | os.PathLike, progress: Progress | None = None,
               threads: int | None = None) -> Path:
    """Write the planned GGUF to ``out`` via ``out.partial`` (fsynced, then renamed)."""
    from gguf import GGUFWriter

    out = Path(out)
    check_writable(out)
    partial = out.with_name(out.name + ".partial")
    writer = GGUFWriter(str(partial), plan.spec.gguf_arch)  # writes general.architecture
    for key, value in plan.metadata.items():
        if key != "general.architecture":
            _put(writer, key, value)
    for t in plan.tensors:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    try:
        writer.write_header_to_file(path=partial)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done = 0
        total = plan.total_bytes
        for i, (t, data) in enumerate(converted_tensors(plan, threads)):
            writer.write_tensor_data(data.reshape(-1))
            done += t.nbytes
            if progress:
                progress(i + 1, len(plan.tensors), done, total)
        fout = writer.fout[0]
        fout.flush()
        os.fsync(fout.fileno())
        writer.close()
        os.replace(partial, out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    finally:
        plan.folder.close()
    return out


def _put(writer: Any, key: str, value: Any) -> None:
    """One metadata key with the GGUF value type llama.cpp's converter gives it."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif key == "tokenizer.ggml.token_type":
        writer.add_array(key, [int(v) for v in value])
    elif key == "tokenizer.ggml.scores":
        writer.add_array(key, [float(v) for v in value])
    else:
        writer.add_array(key, list(value))


def convert(src: str | os.PathLike, out: str | os.PathLike, outtype: str = "f16",
            imatrix: ImportanceMatrix | None = None, progress: Progress | None = None,
            threads: int | None = None, name: str | None = None) -> ConversionPlan:
    """Plan and write in one call; returns the plan (types, fallbacks, sizes)."""
    plan = plan_conversion(src, outtype, imatrix, name=name)
    check_writable(Path(out))
    write_gguf(plan, out, progress, threads)
    return plan


def folder_as_gguf(src: str | os.PathLike, outtype: str = "q8_0",
                   threads: int | None = None) -> Any:
    """The ``GGUFFile`` that ``read_gguf`` would give for the converted file, built in memory
    without writing one (``edgellm.load`` of a folder)."""
    import numpy as _np

    from edgellm.converters.gguf_reader import GGUFFile, QTensor

    plan = plan_conversion(src, outtype)
    metadata = dict(plan.metadata)
    metadata["tokenizer.ggml.token_type"] = _np.asarray(metadata["tokenizer.ggml.token_type"],
                                                        dtype=_np.int32)
    if "tokenizer.ggml.scores" in metadata:
        metadata["tokenizer.ggml.scores"] = _np.asarray(metadata["tokenizer.ggml.scores"],
                                                        dtype=_np.float32)
    tensors = {}
    try:
        for t, data in converted_tensors(plan, threads):
            tensors[t.name] = QTensor(t.name, t.qtype, t.shape, data)
    finally:
        plan.folder.close()
    return GGUFFile(Path(src), 3, metadata, tensors, 0, sum(t.nbytes for t in tensors.values()))


def describe_rate(done: int, total: int, started: float) -> str:
    """'MB/s, ETA' for a progress line."""
    elapsed = max(time.perf_counter() - started, 1e-6)
    rate = done / elapsed
    eta = (total - done) / rate if rate else 0.0
    return f"{rate / 1e6:6.1f} MB/s, ETA {eta:4.0f} s"
