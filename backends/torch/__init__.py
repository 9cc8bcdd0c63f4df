"""The torch backend: CUDA (triton kernels on the file's quantized blocks, CUDA graphs for
decode) or CPU torch."""

from .backend import TorchBackend

__all__ = ["TorchBackend"]
