"""ModelArgs: the hyper-parameters of a model, read from the file's metadata (never its name)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
        arch = metadata.get("general.architecture")
        if not arch:
            raise ValueError("model file has no general.architecture: not a model GGUF?")

        def get(key: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"model file lacks required metadata {arch}.{key}")
            return value

        d_model = int(get("embedding_length"))
        n_heads = int(get("attention.head_count"))
        n_kv = get("attention.head_count_kv", n_heads)
        if not isinstance(n_kv, int):  # per-layer arrays: only uniform heads are supported
            if len(set(int(x) for x in n_kv)) != 1:
                raise ValueError("per-layer KV head counts differ: not supported")
            n_kv = int(n_kv[0])
        head_dim = int(metadata.get(f"{arch}.attention.key_length", d_model // n_heads))
        vocab = metadata.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(metadata.get("tokenizer.ggml.tokens", ()))
        rope_scale = 1.0
        if metadata.get(f"{arch}.rope.scaling.type") == "linear":
            rope_scale = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
        args = cls(
            architecture=arch,
            n_layers=int(get("block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            d_ff=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            context_length=int(get("context_length", 2048)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_dims=int(get("rope.dimension_count", head_dim)),
            rope_scale=rope_scale,
            sliding_window=int(get("attention.sliding_window", 0)),
            attn_logit_softcap=float(get("attn_logit_softcapping", 0.0)),
            final_logit_softcap=float(get("final_logit_softcapping", 0.0)),
        )
        if n_heads % args.n_kv_heads:
            raise ValueError(f"{n_heads} query heads are not a multiple of "
                             f"{args.n_kv_heads} KV heads")
        return args
