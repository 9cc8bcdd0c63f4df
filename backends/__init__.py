"""Backends by name. Heavy ones (numba, torch, mlx) are imported only when asked for."""

from __future__ import annotations

import importlib

from .base import Backend

# name -> (module, class[, preset options]); modules are relative to this package.
_REGISTRY: dict[str, tuple] = {
    "numpy": (".numpy_backend", "NumpyBackend"),
    # the reference with llama.cpp's CPU arithmetic (8-bit activations, f16 attention, ...)
    "numpy-ggml": (".numpy_backend", "NumpyBackend", {"ggml_numerics": True}),
    "cpu": (".cpu", "CpuBackend"),
    # torch: CUDA (triton kernels, CUDA graphs) when there is a GPU, else CPU torch
    "torch": (".torch", "TorchBackend"),
    # Apple MLX (GPU on Apple Silicon; mlx[cpu] elsewhere): ImportError without mlx
    "mlx": (".mlx", "MlxBackend"),
}

#: Tried in order by ``get_backend("auto")`` (after "torch" where there is an NVIDIA GPU, and
#: "mlx" on an Apple Silicon Mac).
AUTO_ORDER: tuple[str, ...] = ("cpu", "numpy")


def _nvidia_gpu() -> bool:
    """An NVIDIA driver and torch are installed (cheap: torch is not imported here)."""
    import importlib.util
    import os

    return os.path.exists("/dev/nvidiactl") and importlib.util.find_spec("torch") is not None


def _apple_silicon() -> bool:
    """An Apple Silicon Mac with mlx installed (MLX's GPU path; not imported here)."""
    import importlib.util
    import platform
    import sys

    return (sys.platform == "darwin" and platform.machine() == "arm64"
            and importlib.util.find_spec("mlx") is not None)


def available_backends() -> list[str]:
    """Names of the backends that import and run on this machine."""
    names = []
    for name in _REGISTRY:
        try:
            get_backend(name)
        except (ImportError, RuntimeError):
            continue
        names.append(name)
    return names


def get_backend(name: str = "auto", **options) -> Backend:
    """A backend instance by name; "auto" picks the fastest that works here."""
    if name == "auto":
        errors = []
        for candidate in ((("torch",) if _nvidia_gpu() else ())
                          + (("mlx",) if _apple_silicon() else ()) + AUTO_ORDER):
            try:
                backend = get_backend(candidate, **options)
            except (ImportError, RuntimeError) as exc:
                errors.append(f"{candidate}: {exc}")
                continue
            if candidate == "torch" and not getattr(backend, "cuda", False):
                continue  # torch without CUDA is slower than the cpu backend
            return backend
        raise RuntimeError("no backend works here: " + "; ".join(errors))
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}: choose one of auto, {', '.join(_REGISTRY)}")
    module, cls, *preset = _REGISTRY[name]
    backend_cls = getattr(importlib.import_module(module, __name__), cls)
    return backend_cls(**(preset[0] if preset else {}), **options)


__all__ = ["Backend", "get_backend", "available_backends", "AUTO_ORDER"]
