"""A decode step's blocks in one backend call (``decode_blocks``) against the op path: the same
logits to the bit, alone and batched, and the op path wherever the fused call cannot run
(every block, or some: ring layers that wrapped between global ones)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

import edgellm
from edgellm.backends import available_backends
from tests.tiny_models import TinyConfig, write_tiny_llama

pytestmark = pytest.mark.skipif("cpu" not in available_backends(), reason="no CPU backend")


def decode_logits(net, fused: bool, kv_dtype: str = "float16") -> np.ndarray:
    """A prompt, 12 single-token steps, then 4 steps of 3 sequences batched."""
    plans = net.block_plans
    net._block_plans = plans if fused else [None] * len(plans)
    try:
        cache = net.make_cache(200, dtype=kv_dtype)
        out = [net.forward(np.arange(10, 40) % 250, cache)]
        out += [net.forward(np.array([(40 + i) % 250]), cache) for i in range(12)]
        caches = [net.make_cache(200, dtype=kv_dtype) for _ in range(3)]
        for j, c in enumerate(caches):
            net.forward(np.arange(50 + j, 70 + 3 * j) % 250, c)
        for i in range(4):
            out += net.forward_batch([(np.array([(90 + i + j) % 250]), c)
                                      for j, c in enumerate(caches)])
    finally:
        net._block_plans = plans
    return np.concatenate([o.reshape(-1) for o in out])


def assert_fused_is_op_path(net, kv_dtype="float16"):
    fused, ops = decode_logits(net, True, kv_dtype), decode_logits(net, False, kv_dtype)
    assert np.array_equal(fused.view(np.uint32), ops.view(np.uint32)), np.abs(fused - ops).max()


@pytest.mark.parametrize("name", ["gemma-3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_real_models_decode_the_same_bits_fused(model_path, name):
    """Gemma 3 (Q/K norms, norms after each sublayer, GeGLU, NEOX RoPE) and Qwen2.5 (Q/K/V
    biases, SwiGLU): every block takes the fused call, and the logits do not move."""
    with edgellm.load(model_path(name), backend="cpu") as model:
        net = model.net
        if net.backend.native is None or not net.backend.packing:
            pytest.skip("no packing C build here")
        assert all(plan is not None for plan in net.block_plans)
        assert_fused_is_op_path(net)


def test_a_llama_block_and_the_fallbacks(tmp_path):
    """A tiny Llama (adjacent-pair RoPE, no biases or extra norms) fuses to the same bits; an
    f32 KV cache is not the fused kernel's, so those steps run op by op, unchanged."""
    path = write_tiny_llama(tmp_path / "tiny.gguf",
                            TinyConfig(d_model=128, d_ff=256, qtype=GGMLQuantizationType.Q8_0))
    with edgellm.load(path, backend="cpu") as model:
        net = model.net
        if net.backend.native is None or not net.backend.packing:
            pytest.skip("no packing C build here")
        assert all(plan is not None for plan in net.block_plans)
        assert_fused_is_op_path(net)
        calls = []
        decode = net.backend.decode_blocks
        net.backend.decode_blocks = lambda *a: calls.append(decode(*a)) or calls[-1]
        assert_fused_is_op_path(net, kv_dtype="float32")
        assert calls and all(result is None for result in calls)


def test_runs_of_fused_blocks_between_wrapped_rings(tmp_path):
    """Layers 0, 2 and 3 windowed (rings of 6 + reserve), layer 1 global: before the rings
    wrap all four blocks go in one call; after, only the global one fuses (a run of one
    between op-path blocks), then none. The logits stay the op path's to the bit."""
    from dataclasses import replace

    from edgellm.cache import CacheConfig

    path = write_tiny_llama(tmp_path / "tiny4.gguf",
                            TinyConfig(d_model=128, d_ff=256, n_layers=4,
                                       qtype=GGMLQuantizationType.Q8_0))
    with edgellm.load(path, backend="cpu") as model:
        net = model.net
        if net.backend.native is None or not net.backend.packing:
            pytest.skip("no packing C build here")
        net.args = replace(net.args, sliding_window=6)
        net.layer_window = lambda i: 0 if i == 1 else 6
        runs = []
        decode = net.backend.decode_blocks
        net.backend.decode_blocks = lambda plans, *a: runs.append(len(plans)) or decode(plans,
                                                                                        *a)

        def logits(fused: bool):
            plans = net.block_plans
            net._block_plans = plans if fused else [None] * len(plans)
            try:
                cache = net.make_cache(config=CacheConfig(max_tokens=64, reserve=4))
                assert cache.layers[0].plan.is_ring and not cache.layers[1].plan.is_ring
                out = [net.forward(np.array([1, 2, 3]), cache)]
                out += [net.forward(np.array([(7 * i) % 250]), cache) for i in range(14)]
                return np.concatenate(out)
            finally:
                net._block_plans = plans

        fused, ops = logits(True), logits(False)
        assert np.array_equal(fused.view(np.uint32), ops.view(np.uint32))
        assert 4 in runs and 1 in runs  # all four at first; the global one alone after
