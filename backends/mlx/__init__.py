"""The MLX backend (Apple Silicon GPUs; ``mlx[cpu]`` elsewhere). Importing it without mlx
raises ImportError, so the registry skips it."""

from .backend import MlxBackend

__all__ = ["MlxBackend"]
