"""The fast CPU backend (Numba kernels, optional C kernels); see ``backend.py``."""

from .backend import CpuBackend, QuantMatrix

__all__ = ["CpuBackend", "QuantMatrix"]
