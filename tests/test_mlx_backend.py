"""The MLX backend (issue 16): the file's blocks mapped exactly onto MLX's affine layout, on
random blocks and on real tensors of the three model files; Q6_K's re-quantization within its
bound; the cache inside MLX forward passes; the real models against llama.cpp's references.

Every op against the numpy reference is tests/test_backend_conformance.py (which runs every
available backend, mlx included). MLX on a CPU (``mlx[cpu]`` on Linux) runs a 0.5B model at
about a token a second, so the real-model checks here use a few prompts; the full reference
checks on the three models are in the issue's note (and run from tests/test_models.py where
MLX has a GPU).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

import edgellm  # noqa: E402
from edgellm.converters.gguf_reader import read_gguf  # noqa: E402
from edgellm.converters.mlx_layout import (  # noqa: E402
    EXACT_BITS,
    dequantize_affine,
    pack_bits,
    requantize,
    to_affine,
    unpack_bits,
)
from edgellm.quants import Q, dequantize, type_size  # noqa: E402
from tests.reference_checks import MIN_TOP1_AGREEMENT, load_reference  # noqa: E402
from tests.test_backend_conformance import random_tensor  # noqa: E402
from tests.tiny_models import TinyConfig, write_tiny_llama  # noqa: E402

MODELS = ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m", "qwen2.5-coder-1.5b-instruct"]


def mlx_values(a) -> np.ndarray:
    """What MLX's own kernel dequantizes an AffineWeight to (f32 scales: exact widening)."""
    return np.array(mx.dequantize(mx.array(a.packed), mx.array(a.scales.astype(np.float32)),
                                  mx.array(a.biases.astype(np.float32)),
                                  group_size=a.group_size, bits=a.bits))


def assert_bit_exact(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Identical f32 bit patterns, but for the sign of zero: the oracle's d * (q - 8) is -0.0
    where d < 0 and q = 8, MLX's d * q - 8 d is +0.0 (equal numbers; no sum can tell)."""
    assert got.shape == want.shape, what
    got, want = got + np.float32(0.0), want + np.float32(0.0)  # -0.0 + 0.0 = +0.0
    same = got.view(np.uint32) == want.view(np.uint32)
    assert same.all(), f"{what}: {np.count_nonzero(~same)} values differ"


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_pack_bits_is_mlx_bit_stream(bits):
    """Our packing is the stream MLX's dequantize reads (scale 1, bias 0 gives q back)."""
    q = np.random.default_rng(bits).integers(0, 1 << bits, (3, 128)).astype(np.uint8)
    packed = pack_bits(q, bits)
    assert packed.shape == (3, 128 * bits // 32) and packed.dtype == np.uint32
    assert np.array_equal(unpack_bits(packed, bits, 128), q)
    ones, zeros = mx.ones((3, 4)), mx.zeros((3, 4))
    got = np.array(mx.dequantize(mx.array(packed), ones, zeros, group_size=32, bits=bits))
    assert np.array_equal(got, q.astype(np.float32))


@pytest.mark.parametrize("qtype", list(EXACT_BITS), ids=lambda q: q.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_mapping_on_random_blocks(qtype, seed):
    """Random bytes in every field (f16 scales random too, negative ones included)."""
    t = random_tensor(qtype, 37, 512, seed=seed)
    raw = t.data.reshape(37, -1, type_size(qtype)).copy()
    rng = np.random.default_rng(seed + 10)
    for off in (0, 2) if qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K) else (0,):
        signed = rng.uniform(-0.05, 0.05, raw.shape[:2]).astype(np.float16)
        raw[..., off:off + 2] = signed.view(np.uint8).reshape(*raw.shape[:2], 2)
    data = raw.reshape(37, -1)
    want = dequantize(data, qtype).reshape(37, 512)
    a = to_affine(data, qtype, 37, 512)
    assert a.exact and a.bits == EXACT_BITS[qtype]
    assert_bit_exact(dequantize_affine(a), want, f"{qtype.name} (numpy)")
    assert_bit_exact(mlx_values(a), want, f"{qtype.name} (mx.dequantize)")


def _sample_rows(t, max_values: int = 1 << 20) -> np.ndarray:
    """A tensor's blocks (rows, row_bytes): all rows when small, else 3 slices of rows."""
    data = t.data.reshape(-1, t.data.shape[-1])
    rows = data.shape[0]
    take = max(16, max_values // t.shape[-1] // 3)
    if rows <= 3 * take:
        return data
    return np.concatenate([data[:take], data[rows // 2:rows // 2 + take], data[-take:]])


@functools.lru_cache(maxsize=3)
def _file(name: str, path: str):
    return read_gguf(path)


@pytest.mark.parametrize("name", MODELS)
def test_exact_mapping_on_real_tensors(model_path, name):
    """Every exactly mapped type in the file, on up to 3 tensors of each role (first, middle
    and last layer), large tensors on 3 slices of rows: MLX's dequantize gives the numpy
    oracle's values bit for bit."""
    gguf = _file(name, str(model_path(name)))
    by_role: dict[tuple, list] = {}
    for tname, t in gguf.tensors.items():
        if t.qtype in EXACT_BITS:
            role = (t.qtype, tname.split(".")[-2] if tname.startswith("blk.") else tname)
            by_role.setdefault(role, []).append(t)
    assert by_role, "no exactly mapped tensors"
    checked = set()
    for (qtype, _), tensors in by_role.items():
        for t in {id(x): x for x in (tensors[0], tensors[len(tensors) // 2], tensors[-1])}.values():
            data = _sample_rows(t)
            a = to_affine(data, qtype, data.shape[0], t.shape[-1])
            want = dequantize(data, qtype).reshape(data.shape[0], t.shape[-1])
            assert_bit_exact(mlx_values(a), want, t.name)
            checked.add(qtype)
    print(f"{name}: bit-exact on {sorted(q.name for q in checked)}")


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_q6_k_requantization_error_is_bounded(model_path, name):
    """Q6_K -> 8 bits per 32: every value within half a step (f32 rounding aside), and so
    within 64/510 (~1/8) of the larger of its group's two Q6_K sub-block steps (d * |sc|):
    the two sub-blocks' values span at most 64 such steps, cut into 255."""
    gguf = _file(name, str(model_path(name)))
    tensors = [t for t in gguf.tensors.values() if t.qtype == Q.Q6_K]
    assert tensors
    for t in tensors[:: max(1, len(tensors) // 4)]:
        data = _sample_rows(t, 1 << 19)
        rows, cols = data.shape[0], t.shape[-1]
        exact = dequantize(data, Q.Q6_K).reshape(rows, cols)
        a = to_affine(data, Q.Q6_K, rows, cols)
        assert not a.exact and a.bits == 8
        err = np.abs(mlx_values(a) - exact).reshape(rows, cols // 32, 32).max(-1)
        blocks = data.reshape(rows, -1, 210)
        d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)  # (rows, nb, 1)
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)  # (rows, nb, 16)
        step = np.abs(d * sc).reshape(rows, -1, 2).max(-1)  # (rows, groups of 32)
        assert np.all(err <= a.scales * 0.5 * (1 + 1e-4) + 1e-12), t.name
        assert np.all(err <= step * (64 / 510) * (1 + 1e-4) + 1e-12), t.name


@pytest.mark.parametrize("qtype,block", [(Q.Q8_0, 32), (Q.Q5_0, 32), (Q.Q4_K, 256),
                                         (Q.Q6_K, 256)], ids=lambda v: getattr(v, "name", v))
def test_activation_rounding_is_numpy_ggmls(qtype, block):
    """The 8-bit activation rounding (Q8_0 per 32, Q8_K per 256 against K-quants) gives
    numpy-ggml's values exactly: blocks of zeros, an outlier in the thousands, tiny and large
    magnitudes, ties at the largest value of either sign."""
    from edgellm.backends.mlx.backend import round_activations
    from edgellm.backends.numpy_backend import round_activations_like_ggml

    rng = np.random.default_rng(block)
    for scale in (1e-4, 1.0, 300.0):
        x = (rng.standard_normal((6, 1024)) * scale).astype(np.float32)
        x[0, :256] = 0.0
        x[1, 7] = 4000.0 * scale
        x[2, 3], x[2, 9] = -2.0 * scale, 2.0 * scale  # equal magnitudes: the first one wins
        x[3] = np.round(x[3] * 4) / 4  # exact quarters: ties in the scaled values
        want = round_activations_like_ggml(x, qtype)
        got = np.array(round_activations(mx.array(x), block))
        assert_bit_exact(got, want, f"{qtype.name} x{scale}")


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_0, Q.Q4_K], ids=lambda q: q.name)
def test_rounded_matmul_is_numpy_ggmls(qtype):
    """With activations rounded, a matmul is numpy-ggml's up to f32 summation order; each
    projection of ``matmuls`` is its own ``matmul``."""
    from edgellm.backends import get_backend

    rounding = get_backend("mlx", round_activations=True)
    ref = get_backend("numpy-ggml")
    tensor = random_tensor(qtype, 96, 512, seed=4)
    x = (np.random.default_rng(5).standard_normal((5, 512)) * 3).astype(np.float32)
    want = ref.matmul(x, ref.prepare(tensor))
    w = rounding.prepare(tensor)
    got = np.array(rounding.matmul(mx.array(x), w))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    both = rounding.matmuls(mx.array(x), (w, w))
    assert all(np.array_equal(np.array(b), got) for b in both)


def test_dense_and_odd_types_still_load():
    """F32/F16 matrices stay dense; a type without an affine form (Q2_K) is re-quantized."""
    dense = random_tensor(Q.F16, 8, 64)
    assert to_affine(dense.data, Q.F16, 8, 64) is None
    values = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    a = requantize(values)
    assert np.abs(dequantize_affine(a) - values).max() <= a.scales.max() / 2 * 1.0001


# -- the cache inside MLX forward passes (tiny random models: fast) -------------------------
TOKENS = [1, *np.random.default_rng(7).integers(3, 300, size=79).tolist()]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The same tiny Q8_0 Llama on numpy and on mlx, both with float activations."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_llama(path, TinyConfig(n_layers=2, qtype=Q.Q8_0), seed=3)
    mlx_model = edgellm.load(path, backend="mlx")
    assert not mlx_model.backend.round_activations  # the default
    return edgellm.load(path, backend="numpy"), mlx_model


def _run(model, cache, batch: int) -> np.ndarray:
    return np.concatenate([model.net.forward(np.array(TOKENS[i:i + batch]), cache,
                                             all_logits=True)
                           for i in range(0, len(TOKENS), batch)])


@pytest.mark.parametrize("policy,dtype,batch", [("error", "float16", 1), ("error", "float32", 7),
                                                ("rotate", "float16", 1),
                                                ("rotate", "float32", 8)])
def test_cache_in_mlx_forward_matches_numpy(tiny_pair, policy, dtype, batch):
    """Linear and rotating caches (sinks re-based, rings wrapped) as MLX arrays: the logits
    of decode and of batches equal the numpy reference's."""
    ref_model, mlx_model = tiny_pair
    budget = 24 if policy == "rotate" else 128
    want = _run(ref_model, ref_model.make_cache(budget, policy=policy, dtype=dtype), batch)
    cache = mlx_model.make_cache(budget, policy=policy, dtype=dtype)
    assert isinstance(cache.layers[0].store.keys, mx.array)
    got = _run(mlx_model, cache, batch)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)


def test_trim_after_wrap_on_mlx(tiny_pair):
    _, model = tiny_pair
    ref = _run(model, model.make_cache(16, policy="rotate", dtype="float32", reserve=8), 1)
    cache = model.make_cache(16, policy="rotate", dtype="float32", reserve=8)
    for i in range(40):
        model.net.forward(np.array([TOKENS[i]]), cache)
    model.net.forward(np.array(TOKENS[60:66]), cache, all_logits=True)  # rejected drafts
    cache.trim(6)
    rest = np.concatenate([model.net.forward(np.array([t]), cache) for t in TOKENS[40:50]])
    np.testing.assert_allclose(rest, ref[40:50], atol=1e-4)


# -- real models (a few prompts: MLX on a CPU is slow; in this order, each model loads once) --
@functools.lru_cache(maxsize=1)
def _loaded(name: str):
    return edgellm.load(name, backend="mlx")


@pytest.mark.slow
def test_device_memory_within_budget(model_path):
    """MLX's active memory after loading is at most 1.3x the GGUF file (weights, norms; the
    untied embedding table stays in the file's mapping)."""
    name = "gemma-3-270m"
    size = model_path(name).stat().st_size
    model = _loaded(name)
    used = model.backend.device_memory()["active"]
    print(f"{name}: MLX active {used / 2**20:.0f} MiB, GGUF {size / 2**20:.0f} MiB")
    assert used <= 1.3 * size


@pytest.mark.slow
@pytest.mark.parametrize("name,entries", [("gemma-3-270m", 2), ("qwen2.5-coder-0.5b-instruct", 2)])
def test_decode_on_mlx_matches_llama_cpp(model_path, name, entries):
    """The prompt in one pass, then each greedy token alone (the decode path), against
    llama.cpp's top-1: every position the reference is sure of (margin >= 1) agrees, and
    the rate meets the bar of every backend."""
    from tests.test_cpu_models import decode_agreement

    model_path(name)
    model = _loaded(name)
    matches, positions, worst = decode_agreement(model, load_reference(name), entries)
    print(f"{name} [mlx]: {matches}/{positions}, largest missed margin {worst:.3f}")
    assert worst < 1.0
    assert matches / positions >= MIN_TOP1_AGREEMENT


@pytest.mark.slow
def test_first_position_of_the_1_5b_on_mlx_matches_llama_cpp(model_path):
    """Qwen2.5-1.5B's first position, where its activations reach the thousands and llama.cpp's
    CPU (which made the reference) rounds them to 8-bit blocks: with MLX rounding them alike
    (``EDGELLM_MLX_ROUND_ACTIVATIONS=1``) the prompt and continuation of the entry whose first
    position llama.cpp is surest of (margin 3.4) agree, position 0 included. (In float, as
    HF transformers and the numpy reference, position 0 predicts otherwise.)"""
    from tests.reference_checks import teacher_forced_agreement

    name = "qwen2.5-coder-1.5b-instruct"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGELLM_MLX_ROUND_ACTIVATIONS", "1")
        model = edgellm.load(model_path(name), backend="mlx")
    assert model.backend.round_activations
    reference = load_reference(name)
    entry = max(reference["generate"], key=lambda e: e["prompt_top20"][0][0][1]
                - e["prompt_top20"][0][1][1])
    agreement = teacher_forced_agreement(model, {"generate": [entry]})
    print(f"{name} [mlx]: {agreement.matches}/{agreement.positions}, misses {agreement.misses}")
    assert all(pos != 0 for _, pos, _ in agreement.misses)
    assert agreement.max_missed_margin < 1.0
    assert agreement.rate >= MIN_TOP1_AGREEMENT


# -- export: GGUF -> an MLX folder that mlx-lm loads -----------------------------------------
EXPORT_PROMPTS = ["def fibonacci(n):", "<|im_start|>user\nWrite a haiku about rust.<|im_end|>\n"
                  "<|im_start|>assistant\n"]
EXPORT_TOKENS = 6


@pytest.mark.slow
def test_export_loads_in_mlx_lm_and_greedy_equals_ours(model_path, tmp_path):
    """The 0.5B exported (Q5_0 and Q4_K exact, Q8_0 exact, Q6_K as 8 bits): mlx_lm.load opens
    it, its tokenizer gives our ids, and its greedy tokens equal the MLX backend's."""
    mlx_lm = pytest.importorskip("mlx_lm")
    pytest.importorskip("transformers")
    import json

    from mlx_lm.generate import generate_step as mlx_lm_generate_step

    from edgellm.converters.mlx_export import export_mlx
    from edgellm.generate import generate_step
    from edgellm.sampling import SamplingParams

    src = model_path("qwen2.5-coder-0.5b-instruct")
    out = tmp_path / "q05-mlx"
    report = export_mlx(src, out)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant["bits"] == 5 and quant["group_size"] == 32  # Q5_0 is most of the file
    assert quant["lm_head"] == {"group_size": 32, "bits": 8}  # Q8_0
    assert quant["model.layers.0.mlp.down_proj"]["bits"] in (4, 8)  # Q4_K or Q6_K
    assert report.kept["Q4_K -> 4-bit exact"] and report.kept["Q6_K -> 8-bit re-quantized"]
    theirs_model, theirs_tok = mlx_lm.load(str(out))
    ours = _loaded("qwen2.5-coder-0.5b-instruct")
    for prompt in EXPORT_PROMPTS:
        ids = ours.encode(prompt)
        assert theirs_tok.encode(prompt) == ids
        steps = mlx_lm_generate_step(mx.array(ids), theirs_model, max_tokens=EXPORT_TOKENS,
                                     sampler=lambda logits: mx.argmax(logits, axis=-1))
        theirs = [int(tok) for tok, _ in steps]
        cache = ours.make_cache(len(ids) + EXPORT_TOKENS + 8, dtype="float32")
        mine = generate_step(ids, ours.net, cache, SamplingParams(temperature=0))
        assert [next(mine)[0] for _ in range(EXPORT_TOKENS)] == theirs, prompt


def test_batched_forward_on_mlx_equals_each_alone(tiny_pair):
    """The engine's one pass over several sequences (forward_batch) runs on MLX too, and
    each sequence's logits are those of its own forward pass."""
    _, model = tiny_pair
    seqs = [TOKENS[:9], TOKENS[20:23], TOKENS[40:41]]
    alone = [model.net.forward(np.array(s), model.make_cache(64))[-1] for s in seqs]
    batch = [(np.array(s), model.make_cache(64)) for s in seqs]
    for got, want in zip(model.net.forward_batch(batch), alone, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
