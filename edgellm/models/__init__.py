"""Architectures by GGUF ``general.architecture`` name; one module each."""

from __future__ import annotations

import importlib

from edgellm.config import ModelArgs

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
    return cls(ModelArgs.from_metadata(metadata), backend, tensors)
