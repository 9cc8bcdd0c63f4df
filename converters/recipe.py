"""Which GGUF type each tensor gets, per output type: llama.cpp's rules, so files compare.

Float types and q8_0 follow ``convert_hf_to_gguf.py``: vectors stay F32, every 2-D weight
takes the type (F16 where its rows are not whole blocks). q4_0, q5_0 and the ``_k_m``/``q6_k``
mixes follow ``llama-quantize``: the output matrix (and a tied embedding) Q6_K, or Q8_0 when
its width is not a whole number of the type's blocks; under q4_k_m/q5_k_m a share of
``attn_v`` and ``ffn_down`` matrices (the first and last eighth of the layers, and every
third between) Q6_K; then a 256-block type that does not fit a width falls back (Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0, else F16), and every fallback is reported.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

Q = GGMLQuantizationType


@dataclass(frozen=True)
class OutType:
    name: str
    base: GGMLQuantizationType  # the type most matrices get
    file_type: LlamaFileType
    mix: bool  # llama-quantize's per-tensor rules (else convert_hf_to_gguf's)


OUT_TYPES: dict[str, OutType] = {t.name: t for t in (
    OutType("f32", Q.F32, LlamaFileType.ALL_F32, False),
    OutType("f16", Q.F16, LlamaFileType.MOSTLY_F16, False),
    OutType("bf16", Q.BF16, LlamaFileType.MOSTLY_BF16, False),
    OutType("q8_0", Q.Q8_0, LlamaFileType.MOSTLY_Q8_0, False),
    OutType("q4_0", Q.Q4_0, LlamaFileType.MOSTLY_Q4_0, True),
    OutType("q5_0", Q.Q5_0, LlamaFileType.MOSTLY_Q5_0, True),
    OutType("q4_k_m", Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M, True),
    OutType("q5_k_m", Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_M, True),
    OutType("q6_k", Q.Q6_K, LlamaFileType.MOSTLY_Q6_K, True),
)}

_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def out_type(name: str) -> OutType:
    key = name.lower()
    if key not in OUT_TYPES:
        raise ValueError(f"unknown output type {name!r}; choose one of {', '.join(OUT_TYPES)}")
    return OUT_TYPES[key]


def block_of(qtype: GGMLQuantizationType) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def use_more_bits(i: int, n: int) -> bool:
    """The first and last eighth of n, and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def layer_of(name: str) -> int:
    """N of ``blk.N.*``."""
    return int(name.split(".")[1])


class Recipe:
    """Assigns types per tensor. llama-quantize counts attn_v/ffn_down in the order its model
    loader lists them, which is by layer number: the count is the layer's index."""

    def __init__(self, kind: OutType, names: list[str]):
        self.kind = kind
        self.tied = "output.weight" not in names
        self.n_attn_v = sum("attn_v.weight" in n for n in names)
        self.n_ffn_down = sum("ffn_down" in n for n in names)

    def choose(self, name: str, shape: tuple[int, ...]) -> tuple[GGMLQuantizationType, str | None]:
        """(type, note): note says why a tensor fell back from the type it should have had."""
        quantizable = len(shape) >= 2 and name.endswith("weight")
        if not self.kind.mix:
            if not quantizable:
                return Q.F32, None
            if shape[-1] % block_of(self.kind.base):
                return Q.F16, (f"{shape[-1]} columns are not whole {self.kind.base.name} "
                               "blocks -> F16")
            return self.kind.base, None
        if not quantizable or "_norm.weight" in name:
            return Q.F32, None
        wanted = self._mix_type(name, shape)
        return self._fallback(wanted, shape[-1])

    def _mix_type(self, name: str, shape: tuple[int, ...]) -> GGMLQuantizationType:
        kind, t = self.kind.name, self.kind.base
        if name == "output.weight" or (self.tied and name == "token_embd.weight"):
            if shape[-1] % block_of(t):
                return Q.Q8_0
            return Q.Q6_K if t != Q.Q8_0 else t
        if "attn_v.weight" in name:
            if kind in ("q4_k_m", "q5_k_m") and use_more_bits(layer_of(name), self.n_attn_v):
                t = Q.Q6_K
        elif "ffn_down" in name:
            if kind in ("q4_k_m", "q5_k_m") and use_more_bits(layer_of(name), self.n_ffn_down):
                t = Q.Q6_K
        return t

    @staticmethod
    def _fallback(wanted: GGMLQuantizationType,
                  n_cols: int) -> tuple[GGMLQuantizationType, str | None]:
        if n_cols % block_of(wanted) == 0:
            return wanted, None
        got = _FALLBACK.get(wanted, wanted)
        if n_cols % block_of(got):
            got = Q.F16
        return got, (f"{n_cols} columns are not whole {wanted.name} blocks "
                     f"({block_of(wanted)}) -> {got.name}")
