"""The budgeted cache inside real forward passes: tiny random models (fast) and Gemma 3's
512-token window rings against llama.cpp on 2048 tokens of GPL-3 (a real model).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import edgellm
from edgellm.cache import ContextOverflow
from edgellm.generate import stream_generate
from edgellm.sampling import SamplingParams
from tests.tiny_models import TinyConfig, write_tiny_llama

RNG = np.random.default_rng(7)
TOKENS = [1, *RNG.integers(3, 300, size=99).tolist()]  # BOS, then 99 random ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(n_layers) -> a loaded tiny random Llama on the numpy backend."""
    made = {}

    def get(n_layers: int = 2):
        if n_layers not in made:
            path = tmp_path_factory.mktemp("tiny") / f"tiny{n_layers}.gguf"
            write_tiny_llama(path, TinyConfig(n_layers=n_layers), seed=3)
            made[n_layers] = edgellm.load(path, backend="numpy")
        return made[n_layers]

    return get


def run(model, cache, tokens, batch: int) -> np.ndarray:
    """All logits (n, vocab) of ``tokens`` fed ``batch`` at a time."""
    return np.concatenate([model.net.forward(np.array(tokens[i:i + batch]), cache,
                                             all_logits=True)
                           for i in range(0, len(tokens), batch)])


def test_rotate_decode_is_streaming_llm(tiny):
    """One layer, so keys depend on token and position only: decoding through a rotating
    cache must give the logits of re-running [sinks + recent window] at compact positions
    0..budget-1 from scratch, as StreamingLLM defines it.
    """
    model, budget, keep = tiny(1), 16, 4
    cache = model.make_cache(budget, policy="rotate", keep=keep, dtype="float32")
    ours = run(model, cache, TOKENS[:40], batch=1)
    for p in (budget, 25, 39):  # wrapped positions
        window = TOKENS[:keep] + TOKENS[p - (budget - keep) + 1:p + 1]
        fresh = model.make_cache(budget, dtype="float32")
        ref = model.net.forward(np.array(window), fresh)[-1]
        np.testing.assert_allclose(ours[p], ref, atol=2e-4, rtol=1e-4)


def test_rotate_before_the_budget_is_plain_attention(tiny):
    model = tiny(2)
    plain = run(model, model.make_cache(64, dtype="float32"), TOKENS[:32], batch=5)
    rot = run(model, model.make_cache(32, policy="rotate", dtype="float32"), TOKENS[:32], 7)
    np.testing.assert_allclose(rot, plain, atol=1e-4)


def test_rotate_batches_agree_with_decode(tiny):
    """Each query of a batch gets the sinks re-based for it: batches equal decoding."""
    model = tiny(2)
    dec = run(model, model.make_cache(24, policy="rotate", dtype="float32"), TOKENS, 1)
    bat = run(model, model.make_cache(24, policy="rotate", dtype="float32"), TOKENS, 8)
    np.testing.assert_allclose(bat, dec, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 5, 64, 100])
def test_native_window_ring_equals_window_mask(tiny, batch):
    """Mistral-style sliding window: a ring of window+reserve slots, however it is fed,
    gives the logits of a linear cache holding everything with the window mask.
    """
    model = tiny(2)
    net_args = model.net.args
    model.net.args = dataclasses.replace(net_args, sliding_window=8)
    try:
        ring = model.make_cache(128, dtype="float32", reserve=4)
        assert all(layer.plan.is_ring and layer.plan.slots == 12 for layer in ring.layers)
        linear = model.make_cache(128, dtype="float32", reserve=200)
        assert not linear.layers[0].plan.is_ring
        np.testing.assert_allclose(run(model, ring, TOKENS, batch),
                                   run(model, linear, TOKENS, 100), atol=1e-4)
    finally:
        model.net.args = net_args


def test_trim_after_wrap_in_a_model(tiny):
    """Speculative rollback after the ring wrapped: trimming rejected tokens restores the
    cache so that what follows matches never having fed them."""
    model = tiny(2)
    ref_cache = model.make_cache(16, policy="rotate", dtype="float32", reserve=8)
    ref = run(model, ref_cache, TOKENS[:50], 1)
    cache = model.make_cache(16, policy="rotate", dtype="float32", reserve=8)
    run(model, cache, TOKENS[:40], 1)
    model.net.forward(np.array(TOKENS[60:66]), cache, all_logits=True)  # 6 drafts, rejected
    cache.trim(6)
    rest = run(model, cache, TOKENS[40:50], 1)
    np.testing.assert_allclose(rest, ref[40:50], atol=1e-4)


def test_error_policy_prefill_longer_than_budget_refuses(tiny):
    model = tiny(2)
    cache = model.make_cache(16)
    with pytest.raises(ContextOverflow, match="budget of 16 tokens"):
        model.net.forward(np.array(TOKENS[:17]), cache)
    assert cache.offset == 0
    rot = model.make_cache(16, policy="rotate")
    model.net.forward(np.array(TOKENS[:40]), rot)  # rotate: a long prefill is fine
    assert rot.offset == 40 and rot.evicted == 25


def test_every_overflow_is_reported_by_stream_generate(tiny):
    model = tiny(2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    records = list(stream_generate(model, TOKENS[:5], params, cache=model.make_cache(16)))
    assert records[-1].finish_reason == "context"
    rot = model.make_cache(16, policy="rotate", keep=2)
    records = list(stream_generate(model, TOKENS[:5], params, cache=rot))
    assert records[-1].finish_reason == "length" and records[-1].generation_tokens == 30
    events = [r.extra["context"] for r in records if "context" in r.extra]
    assert events and events[-1]["policy"] == "rotate" and events[-1]["keep"] == 2
    assert events[-1]["evicted"] == rot.offset + 1 - 16


def test_cache_bytes_are_known_before_allocation(tiny):
    model = tiny(2)
    plan = model.cache_plan(100)
    assert model.make_cache(100).nbytes == plan.nbytes
    assert "KV cache: 100 tokens" in plan.describe()


# The reference is llama.cpp (CPU, 2 threads) with flash attention off, f16 KV cache and a
# full-size SWA cache, fed 512 tokens per decode call: that reproduces it at 2048/2048
# (threads, n_ubatch 256..2048 and n_ctx 4096 change nothing). llama.cpp's other equally
# valid settings do not: flash attention on (its CPU default, "auto") agrees at 94.6%, an
# f32 KV cache 95.4%, the small SWA cache 97.7%, one token per decode call 95.6% (the first
# two miss up to margin 0.78). Gemma 3 under llama.cpp's 8-bit activation rounding is
# chaotic: a last-bit difference (summation order, one f16 rounding) moves whole int8 steps
# downstream. Our numpy-ggml with its matmuls summed in f64 instead of f32 agrees with itself
# at only 94.6% over 1024 tokens, while plain f32 numpy (no 8-bit steps) does not move at
# all. So ~95% is the floor for anything not bit-identical to that llama.cpp build, and 99%
# is out of reach. Measured here (per 512 block): numpy 1959/2048 = 95.7% (96.5, 95.7, 94.9,
# 95.5), worst missed margin 0.556; numpy-ggml 95.0%, worst 0.781; cpu 95.0%, worst 0.556.
# The first block never reaches past the window, so the gap is numerics, not the rings.
MIN_LONG_AGREEMENT = 0.95
MAX_LONG_MISSED_MARGIN = 0.6


@pytest.mark.slow
def test_gemma3_beyond_its_window_matches_llama_cpp(model_path, reference_dir):
    """2048 tokens of GPL-3, teacher-forced in 512-token batches, with the local layers in
    512-slot rings (no rollback reserve) that wrap three times.
    """
    ref = json.loads((reference_dir / "gemma3.long-gpl3.json").read_text())
    model = edgellm.load(model_path("gemma-3-270m"), backend="numpy")
    cache = model.make_cache(2048, reserve=0)
    rings = [layer.plan for layer in cache.layers if layer.plan.is_ring]
    assert len(rings) == 15 and all(p.slots == 512 and p.span == 512 for p in rings)
    ids = ref["ids"]
    ours = np.concatenate([model.net.forward(np.array(ids[i:i + 512]), cache,
                                             all_logits=True).argmax(-1)
                           for i in range(0, len(ids), 512)])
    top1, margin = np.array(ref["top1"]), np.array(ref["margin"])
    same = ours == top1
    assert same.mean() >= MIN_LONG_AGREEMENT, same.mean()
    assert same[margin >= MAX_LONG_MISSED_MARGIN].all(), np.flatnonzero(~same & (margin >= 0.6))


def test_perplexity_command_chunked_and_streaming(tiny, tmp_path, capsys):
    from edgellm.apps.perplexity import main

    path = tiny(2).path
    text = tmp_path / "text.txt"
    text.write_text("hello world the hello " * 40)
    assert main(["-m", str(path), "--backend", "numpy", "-f", str(text), "--ctx", "16",
                 "--json"]) == 0
    chunked = json.loads(capsys.readouterr().out)
    assert chunked["mode"] == "chunked" and chunked["scored"] == chunked["chunks"] * 7
    assert main(["-m", str(path), "--backend", "numpy", "-f", str(text), "--ctx", "16",
                 "--stream", "--policy", "rotate", "--keep", "2", "--batch", "8",
                 "--json"]) == 0
    stream = json.loads(capsys.readouterr().out)
    assert stream["mode"] == "stream" and stream["evicted"] > 0 and stream["ppl"] > 1
    assert stream["scored"] == stream["tokens"]


def test_streaming_perplexity_is_batch_independent(tiny):
    from edgellm.cache import CacheConfig
    from edgellm.perplexity import streaming_perplexity

    config = CacheConfig(max_tokens=16, policy="rotate", keep=2, dtype="float32")
    one = streaming_perplexity(tiny(2), TOKENS[:60], config, batch=1)
    many = streaming_perplexity(tiny(2), TOKENS[:60], config, batch=13)
    assert one.scored == many.scored == 59
    assert abs(one.ppl - many.ppl) < 1e-4 * one.ppl
