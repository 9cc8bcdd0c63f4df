"""edgellm: run small language models on your own machine.

    import edgellm
    model = edgellm.load("qwen2.5-coder-0.5b-instruct")
    print(edgellm.generate(model, "def fibonacci(n):", edgellm.SamplingParams(temperature=0)))

Names are imported lazily so that ``import edgellm`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load": "edgellm.api",
    "Model": "edgellm.api",
    "SamplingParams": "edgellm.sampling",
    "generate": "edgellm.generate",
    "stream_generate": "edgellm.generate",
    "generate_step": "edgellm.generate",
    "GenerationResponse": "edgellm.generate",
    "pull": "edgellm.store",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")


__all__ = [*_EXPORTS, "__version__"]
