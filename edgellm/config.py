"""ModelArgs: the hyper-parameters of a model, read from the file's metadata (never its name)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_MISSING = object()


def _describe(value: Any) -> str:
    if isinstance(value, str | bytes):
        return f"a string {value[:20]!r}"
    if isinstance(value, Sequence | np.ndarray):
        return f"an array of {len(value)}"
    return f"{type(value).__name__} {value!r:.20}"


def meta_int(metadata: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    """An integer metadata value (any GGUF integer type), ``default`` when absent; a
    ValueError naming the key when it has another type (a crafted file's array or string)."""
    value = metadata.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise ValueError(f"model file lacks required metadata {key}")
        return default
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise ValueError(f"model metadata {key} should be an integer, not {_describe(value)}: "
                         "the file is corrupt")
    return int(value)


def meta_float(metadata: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    """A finite number from the metadata (integers accepted), ``default`` when absent."""
    value = metadata.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise ValueError(f"model file lacks required metadata {key}")
        return default
    if isinstance(value, bool | np.bool_) or not isinstance(
            value, int | float | np.integer | np.floating) or not math.isfinite(value):
        raise ValueError(f"model metadata {key} should be a finite number, not "
                         f"{_describe(value)}: the file is corrupt")
    return float(value)


def meta_str(metadata: dict[str, Any], key: str, default: Any = _MISSING) -> Any:
    """A string from the metadata, ``default`` when absent."""
    value = metadata.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise ValueError(f"model file lacks required metadata {key}")
        return default
    if not isinstance(value, str):
        raise ValueError(f"model metadata {key} should be a string, not {_describe(value)}: "
                         "the file is corrupt")
    return value


@dataclass(frozen=True)
class ModelArgs:
    """Architecture hyper-parameters shared by every decoder-only model here.

    Per-architecture quirks (Gemma's sliding-window pattern, its local RoPE base) are derived
    by the architecture's own file from these plus its defaults.
    """

    architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_dims: int = 0  # 0 = the whole head
    rope_scale: float = 1.0  # linear scaling factor (positions divided by it)
    sliding_window: int = 0  # 0 = none
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> ModelArgs:
        """Read ``{arch}.*`` keys of a GGUF; missing optional keys take the usual defaults."""
        arch = meta_str(metadata, "general.architecture", "")
        if not arch:
            raise ValueError("model file has no general.architecture: not a model GGUF?")

        def get_int(key: str, default: Any = _MISSING) -> int:
            return meta_int(metadata, f"{arch}.{key}", default)

        def get_float(key: str, default: Any = _MISSING) -> float:
            return meta_float(metadata, f"{arch}.{key}", default)

        d_model = get_int("embedding_length")
        n_heads = get_int("attention.head_count")
        if n_heads <= 0 or d_model <= 0:
            raise ValueError(f"model metadata {arch}.attention.head_count = {n_heads} and "
                             f"{arch}.embedding_length = {d_model} must be positive")
        n_kv = metadata.get(f"{arch}.attention.head_count_kv", n_heads)
        if isinstance(n_kv, Sequence | np.ndarray) and not isinstance(n_kv, str):
            # per-layer arrays: only uniform heads are supported
            per_layer = {meta_int({"kv": x}, "kv") if isinstance(x, int | np.integer) else -1
                         for x in n_kv}
            if len(per_layer) != 1 or -1 in per_layer:
                raise ValueError("per-layer KV head counts differ or are not integers: "
                                 "not supported")
            n_kv = per_layer.pop()
        else:
            n_kv = get_int("attention.head_count_kv", n_heads)
        if n_kv <= 0:
            raise ValueError(f"model metadata {arch}.attention.head_count_kv = {n_kv} must be "
                             "positive")
        head_dim = get_int("attention.key_length", d_model // n_heads)
        vocab = metadata.get(f"{arch}.vocab_size")
        if vocab is None:
            tokens = metadata.get("tokenizer.ggml.tokens", ())
            if isinstance(tokens, str) or not isinstance(tokens, Sequence):
                raise ValueError("model metadata tokenizer.ggml.tokens should be an array of "
                                 f"strings, not {_describe(tokens)}: the file is corrupt")
            vocab = len(tokens)
        else:
            vocab = get_int("vocab_size")
        rope_scale = 1.0
        if metadata.get(f"{arch}.rope.scaling.type") == "linear":
            rope_scale = get_float("rope.scaling.factor", 1.0)
        args = cls(
            architecture=arch,
            n_layers=get_int("block_count"),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            d_ff=get_int("feed_forward_length"),
            vocab_size=vocab,
            context_length=get_int("context_length", 2048),
            norm_eps=get_float("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=get_float("rope.freq_base", 10000.0),
            rope_dims=get_int("rope.dimension_count", head_dim),
            rope_scale=rope_scale,
            sliding_window=get_int("attention.sliding_window", 0),
            attn_logit_softcap=get_float("attn_logit_softcapping", 0.0),
            final_logit_softcap=get_float("final_logit_softcapping", 0.0),
        )
        if n_heads % args.n_kv_heads:
            raise ValueError(f"{n_heads} query heads are not a multiple of "
                             f"{args.n_kv_heads} KV heads")
        return args
