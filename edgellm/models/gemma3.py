"""Gemma 3: QK-norm, norms before and after each sublayer, GeGLU (tanh), scaled embeddings,
tied output, and 5 local (sliding-window) layers for every global one.

GGUF stores Gemma's RMSNorm weights with the +1 already folded in, so the plain rms_norm op
applies. Local layers use a 512-token window (from the file) and their own RoPE base.
"""

from __future__ import annotations

import numpy as np

from .llama import Model as LlamaModel

GLOBAL_EVERY = 6  # layers 5, 11, 17, ... attend globally; the rest use the sliding window
LOCAL_ROPE_THETA = 10_000.0


class Model(LlamaModel):
    rope_neox = True
    activation = "gelu_tanh"

    def __init__(self, args, backend, tensors):
        super().__init__(args, backend, tensors)
        self.embed_scale = float(np.sqrt(args.d_model))

    def is_global(self, i: int) -> bool:
        return (i + 1) % GLOBAL_EVERY == 0

    def layer_window(self, i: int) -> int:
        return 0 if self.is_global(i) else self.args.sliding_window

    def layer_rope(self, i: int) -> tuple[float, float]:
        if self.is_global(i):
            return self.args.rope_theta, 1.0 / self.args.rope_scale
        return LOCAL_ROPE_THETA, 1.0  # linear scaling applies to global layers only
