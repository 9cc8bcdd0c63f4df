"""KV cache: preallocated once per layer, never grown; it builds the attention mask.

This is the plain cache: one buffer of ``max_tokens`` slots per layer, filled from the
start. Sliding-window layers see only the last ``window`` positions through the mask.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class ContextOverflow(ValueError):
    """More tokens than the cache was allocated for."""


class LayerCache:
    """Keys and values of one attention layer: (max_tokens, n_kv_heads, head_dim) each."""

    def __init__(self, backend, max_tokens: int, n_kv_heads: int, head_dim: int,
                 window: int = 0, dtype: str = "float32"):
        self.max_tokens = max_tokens
        self.window = window
        self.offset = 0
        self.keys = backend.zeros((max_tokens, n_kv_heads, head_dim), dtype)
        self.values = backend.zeros((max_tokens, n_kv_heads, head_dim), dtype)

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)

    def update_and_fetch(self, k: Any, v: Any) -> tuple[Any, Any, np.ndarray]:
        """Store k, v (n, KVH, hd) after what is cached; return all keys, values and the mask.

        The mask is (n, T) bool, True where query i may attend to cached position j.
        """
        n = k.shape[0]
        start, end = self.offset, self.offset + n
        if end > self.max_tokens:
            raise ContextOverflow(f"context full: {end} tokens exceed the cache of "
                                  f"{self.max_tokens}; start over or allow a larger --ctx")
        self.keys[start:end] = k
        self.values[start:end] = v
        self.offset = end
        return self.keys[:end], self.values[:end], self.mask(start, n)

    def mask(self, start: int, n: int) -> np.ndarray:
        """Causal (and, for window layers, sliding-window) visibility for n queries at start."""
        q = np.arange(start, start + n)[:, None]
        k = np.arange(start + n)[None, :]
        visible = k <= q
        if self.window:
            visible &= q - k < self.window
        return visible

    def trim(self, n: int) -> int:
        """Forget the last n tokens (speculative rollback); returns how many were dropped."""
        n = min(n, self.offset)
        self.offset -= n
        return n


class KVCache:
    """One ``LayerCache`` per layer, advanced together by the model's forward pass."""

    def __init__(self, layers: list[LayerCache]):
        self.layers = layers

    @property
    def offset(self) -> int:
        """Tokens processed so far (the position of the next token)."""
        return self.layers[0].offset

    @property
    def max_tokens(self) -> int:
        return min(layer.max_tokens for layer in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def positions(self, n: int) -> np.ndarray:
        """Positions (n,) of the next n tokens."""
        return np.arange(self.offset, self.offset + n)

    def trim(self, n: int) -> int:
        dropped = 0
        for layer in self.layers:
            dropped = layer.trim(n)
        return dropped

    def reset(self) -> None:
        self.trim(self.offset)
