"""edgellm: run small language models on your own machine.

    import edgellm
    model = edgellm.load("qwen2.5-coder-0.5b-instruct")
    print(edgellm.generate(model, "def fibonacci(n):", edgellm.SamplingParams(temperature=0)))

The generators and SamplingParams need only numpy and are imported at once (``generate``
must be bound after the submodule of the same name); ``load`` and ``Model`` (tokenizers,
jinja2, gguf) are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

from edgellm.generate import GenerationResponse, generate, generate_step, stream_generate
from edgellm.sampling import SamplingParams

_EXPORTS = {
    "load": "edgellm.api",
    "Model": "edgellm.api",
    "ChatSession": "edgellm.chat",
    "pull": "edgellm.store",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")


__all__ = [*_EXPORTS, "GenerationResponse", "SamplingParams", "generate", "generate_step",
           "stream_generate", "__version__"]
