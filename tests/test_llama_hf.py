"""The llama architecture against HF transformers' LlamaForCausalLM on the same weights.

A tiny random model is written as GGUF (Q/K permuted as llama.cpp's converter does) and
loaded by edgellm; the same weights go into transformers in HF layout. Logits must agree.
Skipped where torch/transformers are not installed (`pip install -e .[hf]`).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

import edgellm
from edgellm.quants import dequantize, quantize
from tests.tiny_models import TinyConfig, hf_weights, write_tiny_llama

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOKENS = [1, 260, 300 - 3, 17, 42, 99, 270, 5, 288, 261, 250, 13, 7, 7, 7, 290]


def hf_logits(cfg: TinyConfig, seed: int, tokens: list[int],
              round_trip: bool = False) -> np.ndarray:
    """transformers' logits; ``round_trip`` feeds it the weights as quantized in the GGUF."""
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.context_length,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False,
    )
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    weights = hf_weights(cfg, seed)
    if round_trip:  # quantization is per row, so it commutes with the Q/K row permutation
        weights = {k: dequantize(quantize(v, cfg.qtype), cfg.qtype) if v.ndim == 2 else v
                   for k, v in weights.items()}
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in weights.items()}
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def edgellm_logits(path, tokens: list[int], split: int) -> np.ndarray:
    """Prefill the first ``split`` tokens in one pass, then decode the rest one by one."""
    model = edgellm.load(path, backend="numpy")
    cache = model.make_cache(64, dtype="float32")  # f32 KV: an f32 comparison
    first = model.net.forward(np.array(tokens[:split]), cache, all_logits=True)
    rest = [model.net.forward(np.array([t]), cache) for t in tokens[split:]]
    return np.concatenate([first, *rest])


@pytest.mark.parametrize("seed", [0, 1])
def test_llama_matches_transformers_f32(tmp_path, seed):
    cfg = TinyConfig()
    path = write_tiny_llama(tmp_path / "tiny.gguf", cfg, seed)
    ours = edgellm_logits(path, TOKENS, split=9)
    ref = hf_logits(cfg, seed, TOKENS)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-3)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0])
def test_llama_quantized_matches_transformers(tmp_path, qtype):
    """Quantized weights: equal to transformers running the same dequantized weights."""
    cfg = TinyConfig(qtype=qtype)
    path = write_tiny_llama(tmp_path / "tiny-q.gguf", cfg, seed=3)
    ours = edgellm_logits(path, TOKENS, split=4)
    ref = hf_logits(cfg, 3, TOKENS, round_trip=True)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-3)
