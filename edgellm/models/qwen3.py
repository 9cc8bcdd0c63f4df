"""Qwen3 (dense): the Llama block with per-head RMSNorm on queries and keys (QK-norm, applied
before RoPE), half-split (NEOX) RoPE, no Q/K/V biases, and an explicit head size
(``qwen3.attention.key_length``, e.g. 128 with d_model 1024 and 16 heads).

The QK-norm weights (``attn_q_norm``/``attn_k_norm``) are optional tensors of the shared block.
"""

from __future__ import annotations

from .llama import Model as LlamaModel


class Model(LlamaModel):
    rope_neox = True
