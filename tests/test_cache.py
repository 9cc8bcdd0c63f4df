"""The budgeted KV cache: layouts, masks, rings, rollback and policies (pure numpy, fast).

A ring or rotating layer must attend exactly as dense attention over the whole history
with the visibility rule applied (query p sees key j iff j <= p, p - j < window, and when
rotating j < keep or p - j < budget - keep), however the tokens are batched.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgellm.backends.numpy_backend import NumpyBackend
from edgellm.cache import (
    CacheConfig,
    ContextOverflow,
    LayerCache,
    LayerSpec,
    build_cache,
    dequantize_q8_0,
    parse_bytes,
    plan_cache,
    plan_layer,
    quantize_q8_0,
)

B = NumpyBackend()
KVH, HD, H = 2, 32, 4


def dense_rule(q_pos, k_pos, window=0, keep=0, span=0):
    q, j = q_pos[:, None], k_pos[None, :]
    visible = j <= q
    if window:
        visible &= q - j < window
    if span:
        visible &= (j < keep) | (q - j < span)
    return visible


def run_layer(layer: LayerCache, chunks: list[int], seed: int = 0):
    """Feed random q/k/v in chunks; return (ours, dense reference) attention outputs."""
    rng = np.random.default_rng(seed)
    total = sum(chunks)
    q = rng.standard_normal((total, H, HD)).astype(np.float32)
    k = rng.standard_normal((total, KVH, HD)).astype(np.float32)
    v = rng.standard_normal((total, KVH, HD)).astype(np.float32)
    p = layer.plan
    pos = np.arange(total)
    ref = B.attention(q, k, v, dense_rule(pos, pos, p.window, p.keep, p.span), 0.2)
    outs, at = [], 0
    for n in chunks:
        keys, values, mask = layer.update_and_fetch(k[at:at + n], v[at:at + n])
        assert mask.shape == (n, keys.shape[0])
        outs.append(B.attention(q[at:at + n], keys, values, mask, 0.2))
        at += n
    return np.concatenate(outs), ref


def layer(window=0, tokens=16, policy="error", keep=0, reserve=4, dtype="float32"):
    config = CacheConfig(max_tokens=tokens, policy=policy, keep=keep, reserve=reserve,
                         dtype=dtype)
    spec = LayerSpec(KVH, HD, window)
    return LayerCache(B, spec, plan_layer(spec, tokens, config), dtype)


CHUNKINGS = {
    "decode": [1] * 40,
    "small-batches": [3, 5, 2, 7, 1, 4, 6, 3, 5, 4],  # crosses the ring's end mid-update
    "prefill-longer-than-window": [29, 1, 1, 9],
    "one-long-prefill": [40],
    "reserve-sized": [5, 5, 5, 5, 5, 5, 5, 5],  # exactly reserve + 1: in place
    "first-prompt-fills-the-ring": [11, 1, 6, 3],  # > reserve + 1 before the first wrap
}


@pytest.mark.parametrize("chunks", CHUNKINGS.values(), ids=CHUNKINGS.keys())
@pytest.mark.parametrize("kind", ["window-ring", "rotate", "rotate-no-sinks", "linear"])
def test_ring_attends_like_dense_attention(kind, chunks):
    lc = {
        "window-ring": lambda: layer(window=8, tokens=64),
        "rotate": lambda: layer(tokens=12, policy="rotate", keep=3),
        "rotate-no-sinks": lambda: layer(tokens=12, policy="rotate", keep=0),
        "linear": lambda: layer(tokens=64),
    }[kind]()
    ours, ref = run_layer(lc, chunks)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


@pytest.mark.parametrize("policy", ["error", "rotate"])
def test_a_ring_first_prompt_attends_over_its_own_rows_only(policy):
    """Before the first wrap a prompt longer than the reserve overwrites nothing: it is
    stored first and attends over the slots filled so far (not the whole ring followed by
    the new rows, twice the keys); after the wrap the same size takes the old path."""
    lc = (layer(window=8, tokens=64) if policy == "error" else
          layer(tokens=12, policy=policy, keep=3))
    assert lc.plan.is_ring and 11 > lc.plan.max_inplace and 11 <= lc.plan.slots
    rows = np.ones((11, KVH, HD), np.float32)
    keys, _, mask = lc.update_and_fetch(rows, rows)
    assert keys.shape[0] == 11 and mask.shape == (11, 11)
    keys, _, mask = lc.update_and_fetch(rows, rows)  # wraps: the rows before, then the new
    assert keys.shape[0] == lc.plan.slots + 11


def test_window_layer_is_a_ring_of_window_plus_reserve():
    lc = layer(window=8, tokens=4096, reserve=4)
    assert lc.plan.slots == 12 and lc.plan.is_ring
    assert lc.store.keys.shape == (12, KVH, HD)


def test_trim_after_wrap_restores_the_evicted_tokens():
    chunks = [1] * 30
    lc, ref_lc = layer(window=8, reserve=4), layer(window=8, reserve=4)
    rng = np.random.default_rng(1)
    junk = rng.standard_normal((5, KVH, HD)).astype(np.float32)
    ours, ref = [], []
    ks = rng.standard_normal((30, KVH, HD)).astype(np.float32)
    q = rng.standard_normal((30, H, HD)).astype(np.float32)
    for i, _ in enumerate(chunks):
        if i in (12, 20):  # speculate 5 tokens past a wrapped ring, then reject them all
            lc.update_and_fetch(junk, junk)
            assert lc.max_trim() >= 5
            assert lc.trim(5) == 5
        for cache, out in ((lc, ours), (ref_lc, ref)):
            keys, values, mask = cache.update_and_fetch(ks[i:i + 1], ks[i:i + 1])
            out.append(B.attention(q[i:i + 1], keys, values, mask, 0.2))
    np.testing.assert_allclose(np.concatenate(ours), np.concatenate(ref), atol=1e-6)


def test_trim_beyond_the_reserve_is_refused_and_changes_nothing():
    lc = layer(window=8, reserve=2)
    k = np.ones((30, KVH, HD), np.float32)
    for i in range(30):
        lc.update_and_fetch(k[i:i + 1], k[i:i + 1])
    assert lc.max_trim() == 3  # reserve + 1
    with pytest.raises(ValueError, match="roll back"):
        lc.trim(4)
    assert lc.offset == 30


def specs(n_layers=3, window=0):
    return [LayerSpec(KVH, HD, window if i % 2 == 0 else 0) for i in range(n_layers)]


def test_error_policy_refuses_at_the_budget_without_changing_state():
    cache = build_cache(B, specs(), CacheConfig(max_tokens=10, dtype="float32"))
    cache.begin(10)
    for lc in cache.layers:
        lc.update_and_fetch(np.zeros((10, KVH, HD), np.float32), np.zeros((10, KVH, HD)))
    assert not cache.fits(1)
    with pytest.raises(ContextOverflow, match=r"budget of 10 tokens.*--policy rotate"):
        cache.begin(1)
    assert cache.offset == 10


def test_rotate_policy_goes_on_in_constant_memory():
    cache = build_cache(B, specs(window=4), CacheConfig(max_tokens=8, policy="rotate", keep=2,
                                                        reserve=2))
    nbytes = cache.nbytes
    for _ in range(50):
        cache.begin(3)
        for lc in cache.layers:
            lc.update_and_fetch(np.ones((3, KVH, HD), np.float32), np.ones((3, KVH, HD)))
    assert cache.nbytes == nbytes and cache.offset == 150
    assert cache.evicted == 150 + 1 - 8
    assert cache.fits(10**6)


def test_byte_budget_becomes_the_most_tokens_that_fit():
    config = CacheConfig(max_bytes=parse_bytes("64KiB"), dtype="float16")
    plan = plan_cache(specs(2), config, default_tokens=10**6)
    per_token = 2 * 2 * KVH * HD * 2  # 2 layers, k+v, f16
    assert plan.tokens == 64 * 1024 // per_token
    assert plan.nbytes <= 64 * 1024
    with pytest.raises(ValueError, match="too small"):
        plan_cache(specs(2), CacheConfig(max_bytes=10))


def test_f16_is_the_default_and_nbytes_is_exact():
    cache = build_cache(B, specs(2), CacheConfig(max_tokens=100))
    assert cache.layers[0].store.keys.dtype == np.float16
    assert cache.nbytes == cache.plan.nbytes == 2 * 100 * 2 * KVH * HD * 2


def test_q8_0_storage_round_trips_closely():
    x = np.random.default_rng(2).standard_normal((5, KVH, HD)).astype(np.float32)
    q, d = quantize_q8_0(x)
    assert q.dtype == np.int8 and d.shape == (5, KVH, HD // 32)
    np.testing.assert_allclose(dequantize_q8_0(q, d), x, atol=np.abs(x).max() / 127)
    ours, ref = run_layer(layer(window=8, dtype="q8_0"), [9, 1, 1, 5])
    np.testing.assert_allclose(ours, ref, atol=0.05)


def test_bad_choices_are_clear_errors():
    with pytest.raises(ValueError, match="policy"):
        CacheConfig(policy="drop")
    with pytest.raises(ValueError, match="dtype"):
        CacheConfig(dtype="int4")
    with pytest.raises(ValueError, match="--keep"):
        plan_layer(LayerSpec(KVH, HD), 4, CacheConfig(policy="rotate", keep=4))
    assert parse_bytes("256MB") == 256_000_000 and parse_bytes("1GiB") == 2**30
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")
