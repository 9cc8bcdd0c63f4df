"""GGUF -> an MLX model folder that ``mlx_lm.load`` opens, without a round trip through f16.

The folder is what mlx-lm's own converter writes: ``model.safetensors`` with Hugging Face
tensor names (``model.layers.N.self_attn.q_proj.weight/scales/biases``), ``config.json`` with
a ``quantization`` entry (the most common bit width as default, one entry per module whose
width differs, ``false`` for a matrix kept dense), and the tokenizer with its chat template.

Weights go through ``mlx_layout.to_affine``, the same mapping the MLX backend uses: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K stay quantized exactly as in the file; Q6_K becomes
8-bit groups of 32 (no exact form; see mlx_layout). Scales and biases are written as float32
here, also for the legacy types whose scales are float16 values: mlx-lm's quantized embedding
dequantizes in its scales' dtype, and float32 activations keep the K-quants exact and match
the MLX backend. Gemma's RMSNorm weights are stored with the +1 folded in by GGUF; mlx-lm
adds 1 itself, so 1 is taken off here.

The tokenizer comes from the GGUF metadata through ``transformers`` (which mlx-lm needs
anyway). The folder is written under a temporary name beside the destination and renamed
when complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgellm.config import ModelArgs
from edgellm.converters.gguf_reader import QTensor, read_gguf
from edgellm.converters.mlx_layout import GROUP, to_affine

#: GGUF block tensor -> HF module, per architecture (mlx-lm's model_type)
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_FFN_NORM = {"qwen2": "post_attention_layernorm", "gemma3": "pre_feedforward_layernorm"}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
MODEL_TYPES = {"qwen2": "qwen2", "gemma3": "gemma3_text"}

Progress = Callable[[int, int], None]  # (tensors done, tensors in all)


@dataclass
class ExportReport:
    """What was written: the folder, bytes, and how each tensor was kept."""

    path: Path
    nbytes: int = 0
    kept: Counter = field(default_factory=Counter)  # "Q4_K -> 4-bit exact" -> tensors

    def lines(self) -> list[str]:
        mix = ", ".join(f"{k}: {n}" for k, n in sorted(self.kept.items()))
        return [f"wrote {self.path}: {self.nbytes / 1e6:.1f} MB of weights", f"tensors: {mix}"]


def hf_name(gguf_name: str, arch: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (and so on)."""
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if match:
        layer, part, kind = match.groups()
        names = {**_BLOCK_NAMES, "ffn_norm": _FFN_NORM[arch]}
        if arch == "gemma3":
            names.update(_GEMMA_NORMS)
        if part not in names:
            raise ValueError(f"no MLX name for tensor {gguf_name!r}")
        return f"model.layers.{layer}.{names[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in _TOP_NAMES:
        raise ValueError(f"no MLX name for tensor {gguf_name!r}")
    return f"{_TOP_NAMES[stem]}.{kind}"


def _config(args: ModelArgs, metadata: dict, tied: bool) -> dict:
    """The model's config.json (without the quantization entry)."""
    arch = args.architecture
    config = {
        "model_type": MODEL_TYPES[arch],
        "hidden_size": args.d_model, "num_hidden_layers": args.n_layers,
        "intermediate_size": args.d_ff, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps, "vocab_size": args.vocab_size,
        "max_position_embeddings": args.context_length, "rope_theta": args.rope_theta,
        "tie_word_embeddings": tied,
    }
    if args.rope_scale != 1.0:
        config["rope_scaling"] = {"type": "linear", "factor": args.rope_scale}
    if arch == "qwen2":
        config["architectures"] = ["Qwen2ForCausalLM"]
    elif arch == "gemma3":
        from edgellm.models.gemma3 import GLOBAL_EVERY, LOCAL_ROPE_THETA

        config.update(architectures=["Gemma3ForCausalLM"], sliding_window=args.sliding_window,
                      sliding_window_pattern=GLOBAL_EVERY, rope_local_base_freq=LOCAL_ROPE_THETA,
                      query_pre_attn_scalar=args.head_dim,
                      final_logit_softcapping=args.final_logit_softcap or None)
    for key, hf_key in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                        ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in metadata:
            config[hf_key] = int(metadata[key])
    return config


def _export_tensor(t: QTensor, name: str, arch: str, out: dict, quant: dict,
                   report: ExportReport) -> None:
    """One GGUF tensor into ``out`` (HF names -> arrays) and its module's bits into quant."""
    module, _, kind = name.rpartition(".")
    matrix = len(t.shape) == 2 and kind == "weight"
    affine = to_affine(t.data, t.qtype, t.shape[0], t.shape[-1]) if matrix else None
    if affine is None:
        values = np.ascontiguousarray(t.dequantize(), dtype=np.float32)
        if arch == "gemma3" and kind == "weight" and len(t.shape) == 1 and "norm" in name:
            values = values - np.float32(1.0)  # mlx-lm's Gemma RMSNorm multiplies by 1 + w
        out[name] = values
        if matrix:
            quant[module] = False
        report.kept[f"{t.qtype.name} -> float32"] += 1
        return
    out[name] = affine.packed
    out[f"{module}.scales"] = affine.scales.astype(np.float32)
    out[f"{module}.biases"] = affine.biases.astype(np.float32)
    quant[module] = affine.bits
    how = "exact" if affine.exact else "re-quantized"
    report.kept[f"{t.qtype.name} -> {affine.bits}-bit {how}"] += 1


def _quantization_entry(bits_of: dict) -> dict:
    """mlx-lm's quantization entry: a default width and one entry per module that differs."""
    widths = Counter(b for b in bits_of.values() if b)
    default = widths.most_common(1)[0][0] if widths else 8
    entry: dict = {"group_size": GROUP, "bits": default}
    for module, bits in sorted(bits_of.items()):
        if bits is False:
            entry[module] = False
        elif bits != default:
            entry[module] = {"group_size": GROUP, "bits": bits}
    return entry


def _write_tokenizer(gguf_path: Path, folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template, from the GGUF metadata."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise RuntimeError("exporting to MLX needs transformers for the tokenizer "
                           "(pip install 'edgellm[mlx]' mlx-lm)") from exc
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(folder))


def export_mlx(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
               progress: Progress | None = None) -> ExportReport:
    """Write the MLX folder for a GGUF model file; returns what was written.

    Raises ValueError for an architecture mlx-lm's names are not known for here, or a
    destination that exists and is not empty (nothing is written then)."""
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir} exists and is not an empty folder: choose a new one")
    gguf = read_gguf(gguf_path)
    args = ModelArgs.from_metadata(gguf.metadata)
    if args.architecture not in MODEL_TYPES:
        raise ValueError(f"exporting {args.architecture!r} to MLX is not supported "
                         f"(supported: {', '.join(sorted(MODEL_TYPES))})")
    tied = "output.weight" not in gguf.tensors
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp",
                                    dir=out_dir.parent))
    try:
        report = ExportReport(out_dir)
        weights: dict[str, np.ndarray] = {}
        bits_of: dict = {}
        names = [n for n in gguf.tensors if n != "rope_freqs.weight"]
        for i, name in enumerate(names):
            _export_tensor(gguf.tensors[name], hf_name(name, args.architecture),
                           args.architecture, weights, bits_of, report)
            if progress:
                progress(i + 1, len(names))
        report.nbytes = sum(int(a.nbytes) for a in weights.values())
        save_file(weights, str(staging / "model.safetensors"), metadata={"format": "mlx"})
        del weights
        config = _config(args, gguf.metadata, tied)
        config["quantization"] = config["quantization_config"] = _quantization_entry(bits_of)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        _write_tokenizer(gguf_path, staging)
        umask = os.umask(0)
        os.umask(umask)
        for f in staging.iterdir():  # mkdtemp's and safetensors' 0700/0600 -> as open() makes
            f.chmod(0o666 & ~umask)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        staging.chmod(0o777 & ~umask)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return report
