"""A model file summarised: what `edgellm info` shows and what the API reports up front."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from edgellm.config import ModelArgs


class TensorInfo(Protocol):
    """What a summary needs of a tensor: a file's ``QTensor`` or a conversion's plan entry."""

    qtype: Any  # GGMLQuantizationType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int: ...

    @property
    def n_elements(self) -> int: ...


@dataclass(frozen=True)
class ModelHeader:
    """A model's metadata and tensor table, from a GGUF file or planned from a Hugging Face
    folder (types as it would be converted at load; no weight read or converted)."""

    path: Path
    metadata: dict[str, Any]
    tensors: Mapping[str, TensorInfo]
    file_bytes: int  # the .gguf file, or the folder's safetensors weights
    gguf_version: int | None  # None for a folder
    source: str  # "gguf" or "hf folder as q8_0"

    @property
    def gguf_bytes(self) -> int:
        """The model's size as a GGUF: the file's, or a folder's weights as converted."""
        if self.gguf_version is not None:
            return self.file_bytes
        return sum(t.nbytes for t in self.tensors.values())


def read_header(model: str | os.PathLike, quant: str = "q8_0") -> ModelHeader:
    """The header of a catalog model, ``.gguf`` path or Hugging Face folder (``quant``: the
    type ``edgellm.load`` converts a folder to)."""
    if Path(model).is_dir():
        from edgellm.converters.hf_convert import plan_conversion, read_metadata

        plan = plan_conversion(model, quant)
        plan.folder.close()
        return ModelHeader(Path(model), read_metadata(plan), {t.name: t for t in plan.tensors},
                           plan.folder.source_bytes, None, f"hf folder as {quant}")
    from edgellm.converters.gguf_reader import read_gguf
    from edgellm.store import resolve_model

    gguf = read_gguf(resolve_model(model))
    return ModelHeader(gguf.path, gguf.metadata, gguf.tensors, gguf.file_size, gguf.version,
                       "gguf")


def kv_cache_bytes(args: ModelArgs, tokens: int, bytes_per_value: int = 4) -> int:
    """Bytes of keys and values for ``tokens`` positions in every layer."""
    return 2 * args.n_layers * tokens * args.n_kv_heads * args.head_dim * bytes_per_value


def default_cache_plan(args: ModelArgs, tokens: int | None = None, dtype: str = "float16"):
    """The KV cache ``edgellm.load`` would allocate by default (min(context, 4096) tokens, f16,
    sliding-window layers as rings), planned from the args alone: nothing is loaded.
    """
    from edgellm.cache import CacheConfig, LayerSpec, default_context, plan_cache
    from edgellm.models import model_class

    windows = model_class(args.architecture).layer_windows(args)
    specs = [LayerSpec(args.n_kv_heads, args.head_dim, w) for w in windows]
    tokens = tokens or default_context(args.context_length)
    return plan_cache(specs, CacheConfig(max_tokens=tokens, dtype=dtype))


def describe(header: ModelHeader) -> dict[str, Any]:
    """Architecture, sizes, quant mix, context and template of a model."""
    md = header.metadata
    args = ModelArgs.from_metadata(md)
    n_params = sum(t.n_elements for t in header.tensors.values())
    weight_bytes = sum(t.nbytes for t in header.tensors.values())
    mix = Counter()
    for t in header.tensors.values():
        mix[t.qtype.name] += t.nbytes
    template = md.get("tokenizer.chat_template")
    return {
        "path": str(Path(header.path)),
        "source": header.source,
        "name": md.get("general.name"),
        "architecture": args.architecture,
        "file_bytes": header.file_bytes,
        "parameters": n_params,
        "weight_bytes": weight_bytes,
        "bits_per_weight": round(8 * weight_bytes / n_params, 2),
        "quant_mix": {k: v for k, v in mix.most_common()},
        "layers": args.n_layers, "d_model": args.d_model, "d_ff": args.d_ff,
        "heads": args.n_heads, "kv_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "context_length": args.context_length,
        "sliding_window": args.sliding_window,
        "rope_theta": args.rope_theta,
        "tokenizer": md.get("tokenizer.ggml.model"),
        "chat_template": template,
        "kv_bytes_per_token_f16": kv_cache_bytes(args, 1, 2),
        "kv_cache": default_cache_plan(args).describe(),
        "kv_cache_bytes": default_cache_plan(args).nbytes,
        "gguf_version": header.gguf_version,
    }


def backend_memory(path: str | Path, backend: str, quant: str = "q8_0") -> dict[str, Any]:
    """Load the model on ``backend`` and say what it holds: the device's own figures where
    the backend reports them (MLX's active memory, CUDA's allocated bytes), and their ratio
    to the GGUF file's size (a folder: its weights as converted to ``quant``)."""
    from edgellm.api import load

    model = load(path, backend=backend, quant=quant)
    be = model.backend
    size = read_header(path, quant).gguf_bytes
    name = getattr(be, "device_name", None)
    out: dict[str, Any] = {"backend": be.name, "device": name() if name else "host"}
    memory = be.device_memory()
    if memory is not None:
        out["device_memory_active"] = memory["active"]
        out["device_memory_peak"] = memory["peak"]
        out["device_memory_vs_gguf"] = round(memory["active"] / size, 3)
    return out
