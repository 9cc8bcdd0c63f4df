"""Tiny random Llama models written as real GGUF files with gguf-py, for fast tests.

The weights are drawn in Hugging Face layout (``hf_weights``) and written the way llama.cpp's
converter writes Llama checkpoints: Q and K rows permuted for ggml's adjacent-pair RoPE. So
the same weights load into HF transformers' LlamaForCausalLM and into edgellm, and the two
must agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType

from edgellm.quants import quantize


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 300  # 3 specials + 256 byte tokens + 41 word pieces
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    context_length: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32
    #: (part of a tensor's name, its type) where it is not ``qtype`` (V of another type, as
    #: half the layers of llama.cpp's Q4_K_M files have it)
    qtypes: tuple[tuple[str, GGMLQuantizationType], ...] = ()

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# Single characters first, then merges whose halves are in the vocab, so SentencePiece-style
# BPE can reach every piece (e.g. "▁hel" + "lo" -> "▁hello").
WORDS = ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the", "▁h", "el", "▁hel", "lo",
         "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]


def tiny_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocab: <unk> <s> </s>, 256 byte tokens, then word pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    words = (WORDS * (1 + size // len(WORDS)))[: size - len(tokens)]
    for i, w in enumerate(words):
        tokens.append(w if w not in tokens else f"{w}{i}")
        types.append(TokenType.NORMAL)
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    return tokens, scores, [int(t) for t in types]


def hf_weights(cfg: TinyConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under HF LlamaForCausalLM names (float32)."""
    rng = np.random.default_rng(seed)
    d, hd = cfg.d_model, cfg.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(cfg.vocab_size, d),
         "model.norm.weight": norm(d), "lm_head.weight": mat(cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = mat(cfg.n_heads * hd, d)
        w[p + "self_attn.k_proj.weight"] = mat(cfg.n_kv_heads * hd, d)
        w[p + "self_attn.v_proj.weight"] = mat(cfg.n_kv_heads * hd, d)
        w[p + "self_attn.o_proj.weight"] = mat(d, cfg.n_heads * hd)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "mlp.gate_proj.weight"] = mat(cfg.d_ff, d)
        w[p + "mlp.up_proj.weight"] = mat(cfg.d_ff, d)
        w[p + "mlp.down_proj.weight"] = mat(d, cfg.d_ff)
    return w


def permute_for_ggml_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's half-split RoPE rows -> ggml's adjacent-pair order, per head."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_tensors(cfg: TinyConfig, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF names and layout -> GGUF names and layout."""
    out = {"token_embd.weight": hf["model.embed_tokens.weight"],
           "output_norm.weight": hf["model.norm.weight"], "output.weight": hf["lm_head.weight"]}
    for i in range(cfg.n_layers):
        for hf_part, gg_part in GGUF_NAMES.items():
            t = hf[f"model.layers.{i}.{hf_part}.weight"]
            if hf_part == "self_attn.q_proj":
                t = permute_for_ggml_rope(t, cfg.n_heads)
            elif hf_part == "self_attn.k_proj":
                t = permute_for_ggml_rope(t, cfg.n_kv_heads)
            out[f"blk.{i}.{gg_part}.weight"] = t
    return out


def write_tiny_llama(path: str | Path, cfg: TinyConfig = TinyConfig(), seed: int = 0) -> Path:
    """Write a complete, loadable tiny Llama GGUF (weights from ``hf_weights(cfg, seed)``)."""
    path = Path(path)
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-test")
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    tokens, scores, types = tiny_vocab(cfg.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    for name, t in gguf_tensors(cfg, hf_weights(cfg, seed)).items():
        qtype = next((q for part, q in cfg.qtypes if part in name), cfg.qtype)
        if t.ndim == 1 or qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
