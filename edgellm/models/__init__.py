"""Architectures by GGUF ``general.architecture`` name; one module each."""

from __future__ import annotations

import importlib

from edgellm.config import ModelArgs
from edgellm.model_checks import (
    check_shapes,
    check_types,
    finite_checked_on_prepare,
    release_file_pages,
)

# general.architecture -> module (relative to this package) defining ``Model``
ARCHITECTURES: dict[str, str] = {
    "llama": ".llama",
    "mistral": ".llama",
    "qwen2": ".qwen2",
    "gemma3": ".gemma3",
    "qwen3": ".qwen3",
}


def model_class(architecture: str) -> type:
    """The ``Model`` class for an architecture name, or a ValueError naming the supported ones."""
    if architecture not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"unsupported architecture {architecture!r} (supported: {supported})")
    return importlib.import_module(ARCHITECTURES[architecture], __name__).Model


def build_model(metadata: dict, tensors: dict, backend):
    """ModelArgs from the metadata, then the architecture's Model over the backend."""
    cls = model_class(str(metadata.get("general.architecture", "")))
    args = ModelArgs.from_metadata(metadata)
    # shapes against the metadata and no NaN/inf scales, before any kernel sees a tensor
    tokens = metadata.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if hasattr(tokens, "__len__") and not isinstance(tokens, str) else None
    check_shapes(args, tensors, n_tokens)
    check_types(tensors)
    with finite_checked_on_prepare(backend, tensors):  # NaN/inf scales, tensor by tensor
        net = cls(args, backend, tensors)
    release_file_pages(tensors)  # the check read every page; keep resident only what is used
    return net
