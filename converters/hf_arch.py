"""Hugging Face architectures -> GGUF: declarative name tables, a few explicit transforms, and
the ``{arch}.*`` metadata keys as llama.cpp's converter writes them.

Transforms: llama-style checkpoints keep Q/K rows in HF's half-split RoPE order, which ggml's
adjacent-pair (NORM) RoPE reads permuted per head; Gemma stores RMSNorm weights as w - 1 and
GGUF as w. Qwen2/Qwen3/Gemma 3 use NEOX RoPE in GGUF too, so they are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
#: per layer: HF suffix after ``model.layers.N.`` -> GGUF suffix after ``blk.N.``
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
#: Gemma 3 normalizes both sublayers' inputs and outputs
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
#: HF tensors that are not weights of the text model (rotary caches and the like)
IGNORED = re.compile(r"(\.rotary_emb\.inv_freq|^vision_|^multi_modal_projector|^model\.vision)")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ArchSpec:
    """How one HF architecture becomes GGUF."""

    hf_name: str  # config.json "architectures"[0]
    gguf_arch: str  # general.architecture
    layer_names: dict[str, str] = field(default_factory=lambda: LAYER_NAMES)
    permute_qk: bool = False  # llama-style RoPE: Q/K rows permuted for ggml's NORM mode
    norm_offset: bool = False  # Gemma: RMSNorm weights stored as w - 1
    required_config: tuple[str, ...] = ("hidden_size", "num_hidden_layers",
                                        "num_attention_heads", "intermediate_size",
                                        "vocab_size")
    extra_metadata: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def _gemma3_metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"attention.sliding_window": int(cfg.get("sliding_window") or 512)}
    if cfg.get("final_logit_softcapping"):
        out["final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
    if cfg.get("attn_logit_softcapping"):
        out["attn_logit_softcapping"] = float(cfg["attn_logit_softcapping"])
    return out


def _window_metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    window = cfg.get("sliding_window")
    return {"attention.sliding_window": int(window)} if window else {}


ARCHITECTURES: dict[str, ArchSpec] = {spec.hf_name: spec for spec in (
    ArchSpec("LlamaForCausalLM", "llama", permute_qk=True),
    ArchSpec("MistralForCausalLM", "llama", permute_qk=True, extra_metadata=_window_metadata),
    ArchSpec("Qwen2ForCausalLM", "qwen2"),
    ArchSpec("Qwen3ForCausalLM", "qwen3"),
    ArchSpec("Gemma3ForCausalLM", "gemma3", layer_names=GEMMA3_LAYER_NAMES, norm_offset=True,
             extra_metadata=_gemma3_metadata),
)}


def arch_spec(config: dict[str, Any]) -> ArchSpec:
    """The spec for a config's architecture, or a ValueError naming the supported ones."""
    archs = config.get("architectures") or []
    name = archs[0] if archs else config.get("model_type", "?")
    if name not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"unsupported architecture {name!r}; edgellm converts: {supported}")
    spec = ARCHITECTURES[name]
    missing = [k for k in spec.required_config if config.get(k) is None]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)} required for {name}")
    return spec


def gguf_name(spec: ArchSpec, hf_name: str) -> str | None:
    """The GGUF name of an HF tensor; None for tensors not converted (rotary caches)."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    m = _LAYER.match(hf_name)
    if m and m.group(2) in spec.layer_names:
        return f"blk.{m.group(1)}.{spec.layer_names[m.group(2)]}"
    if IGNORED.search(hf_name):
        return None
    raise ValueError(f"tensor {hf_name!r} has no GGUF name for {spec.hf_name}: the checkpoint "
                     "has parts edgellm does not convert")


def head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF half-split RoPE rows -> ggml's adjacent pairs, per head: (rows, ...) -> same shape."""
    shape = w.shape
    return (w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2)
            .reshape(shape))


def transform(spec: ArchSpec, cfg: dict[str, Any], name: str, w: np.ndarray) -> np.ndarray:
    """The explicit fix-ups of one tensor (GGUF name) on its way to the file."""
    if spec.permute_qk:
        if name.endswith("attn_q.weight") or name.endswith("attn_q.bias"):
            w = permute_rope_rows(w, int(cfg["num_attention_heads"]))
        elif name.endswith("attn_k.weight") or name.endswith("attn_k.bias"):
            w = permute_rope_rows(w, int(cfg.get("num_key_value_heads")
                                         or cfg["num_attention_heads"]))
    if spec.norm_offset and name.endswith("norm.weight"):
        w = w + np.float32(1.0)
    return w


def _rope_params(cfg: dict[str, Any]) -> tuple[float | None, dict[str, Any], str]:
    """(rope theta, scaling parameters, scaling kind) from either config spelling."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type (Gemma 3)
        theta = params["full_attention"].get("rope_theta", theta)
        params = params["full_attention"]
    kind = params.get("rope_type", params.get("type", "default")) if params else "default"
    return theta, params, str(kind or "default").lower()


def rope_metadata(spec: ArchSpec, cfg: dict[str, Any]) -> dict[str, Any]:
    """rope.freq_base and linear scaling (Llama 3 scaling is a tensor: ``generated_tensors``);
    other RoPE scalings are refused, not dropped."""
    theta, params, kind = _rope_params(cfg)
    out: dict[str, Any] = {}
    if theta is not None:
        out["rope.freq_base"] = float(theta)
    if kind == "linear":
        out["rope.scaling.type"] = "linear"
        out["rope.scaling.factor"] = float(params["factor"])
    elif kind == "llama3" and spec.gguf_arch != "llama":
        raise ValueError(f"Llama 3 RoPE scaling on {spec.hf_name} is not supported by edgellm "
                         "convert (only llama-architecture models read rope_freqs)")
    elif kind not in ("default", "llama3"):
        raise ValueError(f"RoPE scaling {kind!r} is not supported by edgellm convert yet")
    return out


def llama3_rope_factors(cfg: dict[str, Any]) -> np.ndarray:
    """Llama 3's per-frequency RoPE divisors, f32 (head_dim // 2,): 1 for wavelengths under
    ``original_max / high_freq_factor``, ``factor`` above ``original_max / low_freq_factor``,
    and a smooth blend between. ggml divides each rotation frequency by its entry."""
    theta, params, _ = _rope_params(cfg)
    dim = head_dim(cfg)
    freqs = 1.0 / (float(theta or 10000.0) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    f32 = np.float32  # in f32 throughout, as llama.cpp's converter computes them
    factor = f32(params.get("factor", 8.0))
    low, high = f32(params.get("low_freq_factor", 1.0)), f32(params.get("high_freq_factor", 4.0))
    old_context = f32(params.get("original_max_position_embeddings", 8192))
    wavelen = f32(2 * np.pi) / freqs
    with np.errstate(divide="ignore", invalid="ignore"):  # high == low: no blend band
        smooth = (old_context / wavelen - low) / (high - low)
        blended = f32(1) / ((f32(1) - smooth) / factor + smooth)
    out = np.where(wavelen < old_context / high, f32(1),
                   np.where(wavelen > old_context / low, factor, blended))
    return out.astype(np.float32)


def generated_tensors(spec: ArchSpec, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Tensors the file needs that the checkpoint does not hold (GGUF name -> f32 values);
    llama.cpp's converter writes them before the checkpoint's own."""
    if _rope_params(cfg)[2] == "llama3" and spec.gguf_arch == "llama":
        return {"rope_freqs.weight": llama3_rope_factors(cfg)}
    return {}


def model_metadata(spec: ArchSpec, cfg: dict[str, Any]) -> dict[str, Any]:
    """``{arch}.*`` keys (without the prefix), in llama.cpp's order."""
    n_heads = int(cfg["num_attention_heads"])
    out: dict[str, Any] = {
        "block_count": int(cfg["num_hidden_layers"]),
        "context_length": int(cfg.get("max_position_embeddings") or 2048),
        "embedding_length": int(cfg["hidden_size"]),
        "feed_forward_length": int(cfg["intermediate_size"]),
        "attention.head_count": n_heads,
        "attention.head_count_kv": int(cfg.get("num_key_value_heads") or n_heads),
    }
    out.update(rope_metadata(spec, cfg))
    out["attention.layer_norm_rms_epsilon"] = float(cfg.get("rms_norm_eps", 1e-6))
    if cfg.get("head_dim"):
        out["attention.key_length"] = int(cfg["head_dim"])
        out["attention.value_length"] = int(cfg["head_dim"])
    if spec.extra_metadata:
        out.update(spec.extra_metadata(cfg))
    return out


def check_shapes(spec: ArchSpec, cfg: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor the runtime needs is present with the shape the config implies."""
    d, n_layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    hd, n_heads = head_dim(cfg), int(cfg["num_attention_heads"])
    n_kv, d_ff = int(cfg.get("num_key_value_heads") or n_heads), int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    expected = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,)}
    if "output.weight" in shapes:
        expected["output.weight"] = (vocab, d)
    for i in range(n_layers):
        p = f"blk.{i}."
        expected.update({
            p + "attn_q.weight": (n_heads * hd, d), p + "attn_k.weight": (n_kv * hd, d),
            p + "attn_v.weight": (n_kv * hd, d), p + "attn_output.weight": (d, n_heads * hd),
            p + "ffn_gate.weight": (d_ff, d), p + "ffn_up.weight": (d_ff, d),
            p + "ffn_down.weight": (d, d_ff), p + "attn_norm.weight": (d,),
            p + "ffn_norm.weight": (d,),
        })
    for name, shape in expected.items():
        if name not in shapes:
            raise ValueError(f"checkpoint lacks the tensor for {name} ({spec.hf_name}, "
                             f"{n_layers} layers per config.json); re-download the folder")
        if tuple(shapes[name]) != shape:
            raise ValueError(f"tensor for {name} has shape {list(shapes[name])}, config.json "
                             f"implies {list(shape)}: config and weights do not match")
