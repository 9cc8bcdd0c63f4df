"""The converter's quantizers and type recipes, without any model framework.

Q8_0/Q4_0/Q5_0/Q5_1 must be bit-identical to gguf-py's numpy quantizers (which are tested
against ggml's C reference); the K-quants must decode (gguf-py's dequantizers) close to the
input, beat plain min/max rounding, and follow an importance matrix. The recipe must assign
Qwen2.5-0.5B's tensors the types llama-quantize gives them.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from edgellm.converters.quantize import quantize
from edgellm.converters.recipe import Recipe, out_type


def sample(rows: int = 64, cols: int = 512, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * rng.uniform(0.01, 3.0, (rows, 1))
    x[0, :64] = 0.0  # an all-zero block
    x[1, 5] = 40.0  # an outlier
    x[2] = np.abs(x[2])  # all positive (minimum clamps at 0)
    return x.astype(np.float32)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q5_1])
def test_block_quantizers_are_bit_identical_to_ggml_reference(qtype):
    for seed in range(3):
        x = sample(seed=seed)
        np.testing.assert_array_equal(quantize(x, qtype), gguf_quants.quantize(x, qtype))


@pytest.mark.parametrize("qtype,max_rel_rmse", [(Q.Q4_K, 0.12), (Q.Q5_K, 0.06),
                                                 (Q.Q6_K, 0.03)])
def test_k_quants_decode_close_and_beat_plain_rounding(qtype, max_rel_rmse):
    x = sample(cols=1024)
    back = gguf_quants.dequantize(quantize(x, qtype), qtype)
    err = np.sqrt(((back - x) ** 2).mean(axis=1))
    rms = np.sqrt((x ** 2).mean(axis=1)) + 1e-12
    assert (err / rms)[3:].max() < max_rel_rmse
    assert np.all(back[0, :64] == 0)
    # plain asymmetric rounding of each 32-value group at the same bit count, unsearched
    bits = {Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}[qtype]
    g = x.reshape(-1, 32)
    lo, hi = np.minimum(g.min(1, keepdims=True), 0), g.max(1, keepdims=True)
    step = (hi - lo) / (2 ** bits - 1)
    plain = (np.round((g - lo) / np.where(step == 0, 1, step)) * step + lo).reshape(x.shape)
    assert ((back - x) ** 2).mean() < ((plain - x) ** 2).mean()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q5_0, Q.Q5_1])
def test_importance_matrix_lowers_the_weighted_error(qtype):
    x = sample(cols=1024, seed=5)
    importance = np.random.default_rng(1).uniform(0.01, 1.0, 1024).astype(np.float32) ** 4
    plain = gguf_quants.dequantize(quantize(x, qtype), qtype)
    weighted = gguf_quants.dequantize(quantize(x, qtype, imatrix=importance), qtype)
    assert (((weighted - x) ** 2) * importance).sum() < (((plain - x) ** 2) * importance).sum()


def _search_weights(x: np.ndarray, importance: np.ndarray) -> np.ndarray:
    """The weights the K-quant search uses with an importance matrix, (rows, cols):
    importance * sqrt(sigma^2 + x^2), sigma^2 twice the super-block's mean square."""
    rows, cols = x.shape
    sb = x.reshape(rows, -1, 256)
    sigma2 = 2 * (sb * sb).mean(-1, keepdims=True)
    return (importance.reshape(1, -1, 256) * np.sqrt(sigma2 + sb * sb)).reshape(rows, cols)


def _k4_error(x: np.ndarray, w: np.ndarray, d: np.ndarray, dm: np.ndarray, nmax: int):
    """Weighted error of 32-value sub-blocks x (..., 32) stored as d * q - dm, q nearest."""
    safe = np.where(d > 0, d, 1.0)
    q = np.where(d > 0, np.clip(np.rint((x + dm) / safe), 0, nmax), 0)
    return (w * (d * q - dm - x) ** 2).sum(-1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K])
def test_k_quant_scales_are_a_local_optimum_under_an_imatrix(qtype):
    """With an importance matrix, no sub-block's stored 6-bit (scale, min) pair gains by a
    step of +-1 in either: the scales are searched against the weighted error of the values
    as stored (ggml rounds each fitted scale to its 6-bit level once, and a neighbour does
    better in ~1 sub-block of 10)."""
    from edgellm.converters.mlx_layout import _k_quant

    x = sample(cols=1024, seed=7).astype(np.float64)
    importance = np.random.default_rng(2).uniform(0.05, 1.0, 1024) ** 3
    data = quantize(x.astype(np.float32), qtype, imatrix=importance.astype(np.float32))
    rows = x.shape[0]
    blocks = data.reshape(rows, -1, {Q.Q4_K: 144, Q.Q5_K: 176}[qtype])
    _, scale, bias = _k_quant(blocks, qtype)  # (rows, subs): d*ls and -dmin*lm
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float64)  # (rows, nb, 1)
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float64)
    d, dmin = np.repeat(d, 8, axis=1)[..., 0], np.repeat(dmin, 8, axis=1)[..., 0]
    ls = np.rint(scale / np.where(d > 0, d, 1)).astype(int)
    lm = np.rint(-bias / np.where(dmin > 0, dmin, 1)).astype(int)
    nmax = {Q.Q4_K: 15, Q.Q5_K: 31}[qtype]
    xs = x.reshape(rows, -1, 32)
    w = _search_weights(x, importance).reshape(xs.shape)
    stored = _k4_error(xs, w, (d * ls)[..., None], (dmin * lm)[..., None], nmax)
    live = d > 0  # (rows, subs): super-blocks with a scale
    for ds in (-1, 0, 1):
        for dm in (-1, 0, 1):
            s, m = np.clip(ls + ds, 0, 63), np.clip(lm + dm, 0, 63)
            other = _k4_error(xs, w, (d * s)[..., None], (dmin * m)[..., None], nmax)
            better = live & (other < stored * (1 - 1e-4) - 1e-12)
            assert not better.any(), f"{np.count_nonzero(better)} sub-blocks gain by ({ds}, {dm})"


def test_q6_k_scales_are_a_local_optimum_under_an_imatrix():
    """With an importance matrix, no 16-value group of Q6_K gains by a step of +-1 in its int8
    scale (error weighted by the matrix, the values re-levelled)."""
    x = sample(cols=1024, seed=9).astype(np.float64)
    importance = np.random.default_rng(3).uniform(0.05, 1.0, 1024) ** 3
    data = quantize(x.astype(np.float32), Q.Q6_K, imatrix=importance.astype(np.float32))
    rows = x.shape[0]
    blocks = data.reshape(rows, -1, 210)
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float64)  # (rows, nb, 1)
    sc = blocks[..., 192:208].view(np.int8).astype(np.float64)  # (rows, nb, 16)
    xs = x.reshape(rows, -1, 16, 16)
    w = np.broadcast_to(importance.reshape(1, -1, 16, 16), xs.shape)

    def error(scale):  # (rows, nb, 16): groups stored as scale * q, q nearest in [-32, 31]
        step = (d * scale)[..., None]
        q = np.clip(np.rint(xs / np.where(step == 0, 1, step)), -32, 31)
        return (w * (step * q - xs) ** 2).sum(-1)

    stored = error(sc)
    for step in (-1, 1):
        other = error(np.clip(sc + step, -128, 127))
        better = (d > 0) & (other < stored * (1 - 1e-4) - 1e-12)
        assert not better.any(), f"{np.count_nonzero(better)} groups gain by {step}"


@pytest.mark.parametrize("qtype,nmax", [(Q.Q4_0, 8), (Q.Q5_0, 16)])
def test_weighted_legacy_levels_are_nearest_to_the_stored_scale(qtype, nmax):
    """With an importance matrix, every value's level is its nearest for the scale as stored
    (f16), as the plain path's rounding gives: the search's levels are re-chosen for it."""
    x = sample(cols=1024, seed=3)
    importance = np.random.default_rng(4).uniform(0.05, 1.0, 1024).astype(np.float32) ** 3
    data = quantize(x, qtype, imatrix=importance)
    blocks = data.reshape(x.shape[0], -1, {Q.Q4_0: 18, Q.Q5_0: 22}[qtype])
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # (rows, nb, 1)
    back = gguf_quants.dequantize(data, qtype).reshape(blocks.shape[0], blocks.shape[1], 32)
    q = np.rint(back / np.where(d == 0, 1, d))
    nearest = np.clip(np.rint(x.reshape(q.shape) / np.where(d == 0, 1, d)), -nmax, nmax - 1)
    assert np.array_equal(np.where(d == 0, 0, q), np.where(d == 0, 0, nearest))


def test_quantizer_refuses_partial_blocks_and_unknown_types():
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        quantize(np.zeros((2, 896), np.float32), Q.Q4_K)
    with pytest.raises(ValueError, match="no quantizer for IQ2_XXS"):
        quantize(np.zeros((2, 256), np.float32), Q.IQ2_XXS)


def qwen05_tensors() -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-0.5B's GGUF tensors in convert_hf_to_gguf's order (HF names sorted)."""
    d, ff, kv, vocab = 896, 4864, 128, 151936
    layer = {"input_layernorm.weight": ("attn_norm.weight", (d,)),
             "mlp.down_proj.weight": ("ffn_down.weight", (d, ff)),
             "mlp.gate_proj.weight": ("ffn_gate.weight", (ff, d)),
             "mlp.up_proj.weight": ("ffn_up.weight", (ff, d)),
             "post_attention_layernorm.weight": ("ffn_norm.weight", (d,)),
             "self_attn.k_proj.bias": ("attn_k.bias", (kv,)),
             "self_attn.k_proj.weight": ("attn_k.weight", (kv, d)),
             "self_attn.o_proj.weight": ("attn_output.weight", (d, d)),
             "self_attn.q_proj.bias": ("attn_q.bias", (d,)),
             "self_attn.q_proj.weight": ("attn_q.weight", (d, d)),
             "self_attn.v_proj.bias": ("attn_v.bias", (kv,)),
             "self_attn.v_proj.weight": ("attn_v.weight", (kv, d))}
    hf = {"lm_head.weight": ("output.weight", (vocab, d)),
          "model.embed_tokens.weight": ("token_embd.weight", (vocab, d)),
          "model.norm.weight": ("output_norm.weight", (d,))}
    for i in range(24):
        hf.update({f"model.layers.{i}.{k}": (f"blk.{i}.{g}", s) for k, (g, s) in layer.items()})
    return [hf[k] for k in sorted(hf)]


def test_q4_k_m_recipe_matches_llama_quantize_on_qwen05():
    tensors = qwen05_tensors()
    recipe = Recipe(out_type("q4_k_m"), [n for n, _ in tensors])
    types = {n: recipe.choose(n, s) for n, s in tensors}
    counts: dict[str, int] = {}
    for qtype, _ in types.values():
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    # llama-quantize's q4_k_m of the same model (its file's type histogram)
    assert counts == {"F32": 121, "Q5_0": 133, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12}
    assert sum(note is not None for _, note in types.values()) == 145
    assert types["output.weight"] == (Q.Q8_0, None)  # the output rule's own choice at 896
    assert types["blk.0.ffn_down.weight"][0] == Q.Q6_K  # 4864 columns: whole blocks
    assert types["blk.0.attn_q.weight"][0] == Q.Q5_0  # Q4_K falls back at 896
