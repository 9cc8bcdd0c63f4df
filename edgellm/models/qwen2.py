"""Qwen2 / Qwen2.5: the Llama block with biases on Q, K, V and half-split (NEOX) RoPE.

The biases are picked up from the file (``attn_{q,k,v}.bias``) by the shared loader; what
differs is the RoPE layout, which GGUF keeps as in the HF checkpoint for Qwen2.
"""

from __future__ import annotations

from .llama import Model as LlamaModel


class Model(LlamaModel):
    rope_neox = True
