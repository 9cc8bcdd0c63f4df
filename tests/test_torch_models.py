"""The torch backend on whole models.

CPU torch (always, where torch is installed): the three real models' decode path (the prompt
in one pass, then each greedy token alone, as generation runs) teacher-forced against
llama.cpp's greedy outputs, with the bounds of tests/test_cpu_models.py: top-1 equal at >= 97%
of positions and at every position whose reference margin is >= 1.0. (tests/test_models.py
runs every backend, torch included, over prompt + greedy ids in one pass.)

A tiny model: prompt slices and decode steps through graphs.py (CUDA graphs on a GPU; the
same static-buffer steps run eagerly on the CPU) equal plain steps, across padding, speculative
rollbacks, fresh caches (graphs adopted) and wrapping ring caches; the GPU path (triton
kernels, in the interpreter without a GPU) follows CPU torch.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # the triton path runs in the interpreter (before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import edgellm  # noqa: E402
from tests.reference_checks import MIN_TOP1_AGREEMENT, load_reference  # noqa: E402
from tests.test_cpu_models import decode_agreement  # noqa: E402

# prompts per model (of 8): CPU torch runs f32 weights, so the 1.5B gets fewer
ENTRIES = {"qwen2.5-coder-0.5b-instruct": 6, "gemma-3-270m": 8, "qwen2.5-coder-1.5b-instruct": 3}
CUDA = torch.cuda.is_available()
# Known shortfall (open): Gemma 3 under 8-bit activations is chaotic (see tests/test_models.py).
# CPU torch in llama.cpp's arithmetic agrees on its decode path at 345/356 (96.9%; 341 in plain
# f32), as numpy-ggml and the cpu backend do in one pass; an xfail only when it falls below.
# (The 1.5B's decode path: 108/111 in llama.cpp's arithmetic, 107 in plain f32.)
KNOWN_SHORT = {
    "gemma-3-270m": "torch's decode path agrees at 345/356 on Gemma (< 97%), misses < 1.0",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENTRIES))
def test_decode_teacher_forced_matches_llama_cpp(model_path, name):
    model_path(name)
    model = edgellm.load(name, backend="torch")
    matches, positions, worst = decode_agreement(model, load_reference(name), ENTRIES[name])
    print(f"{name} [torch/{model.net.backend.device}]: {matches}/{positions}, "
          f"largest missed margin {worst:.3f}")
    assert worst < 1.0
    if matches / positions < MIN_TOP1_AGREEMENT and name in KNOWN_SHORT:
        pytest.xfail(KNOWN_SHORT[name])
    assert matches / positions >= MIN_TOP1_AGREEMENT


def _tiny_net(tmp_path, qtype, backend, window: int = 0, small: bool = False,
              layers: int | None = None, v_qtype=None):
    """A tiny random Llama (d 256, 3 layers, GQA; ``small``: d 64, 1 layer; ``layers``
    overrides) of ``qtype`` blocks (V of ``v_qtype`` where given) on ``backend``;
    ``window``: every layer a sliding-window layer of that size."""
    from dataclasses import replace

    from edgellm.converters.gguf_reader import read_gguf
    from edgellm.models import build_model
    from tests.tiny_models import TinyConfig, write_tiny_llama

    cfg = TinyConfig(d_model=64 if small else 256, n_heads=4, n_kv_heads=2,
                     d_ff=128 if small else 512, n_layers=layers or (1 if small else 3),
                     qtype=qtype, qtypes=(("attn_v", v_qtype),) if v_qtype else ())
    v_name = f"-v-{v_qtype.name}" if v_qtype else ""
    path = tmp_path / f"tiny-{qtype.name}{v_name}{'-small' if small else ''}-{cfg.n_layers}.gguf"
    if not path.exists():
        write_tiny_llama(path, cfg)
    gguf = read_gguf(path)
    net = build_model(gguf.metadata, gguf.tensors, backend)
    if window:
        net.args = replace(net.args, sliding_window=window)
    return net


def _assert_same_books(caches, expected) -> None:
    """Each cache's layers hold the books of its counterpart's (offset, slot positions)."""
    for c, e in zip(caches, expected, strict=True):
        for layer, layer_e in zip(c.layers, e.layers, strict=True):
            assert layer.offset == layer_e.offset
            assert np.array_equal(layer.slot_pos, layer_e.slot_pos)


def _decode(net, cache, tokens):
    return np.stack([net.forward(np.array([t]), cache)[0] for t in tokens])


def _graph_backend(triton: bool = False):
    """CUDA with graphs captured, or (no GPU) CPU torch running the same static-buffer
    steps eagerly: everything of graphs.py but the capture itself (``triton``: through the
    GPU path's kernels, in the interpreter)."""
    from edgellm.backends.torch import TorchBackend

    if triton and not CUDA:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton's interpreter was not enabled before triton was imported")
        pytest.importorskip("triton")
        return TorchBackend(device="cpu", triton=True, graphs=True)
    return TorchBackend(graphs=True)


@pytest.mark.parametrize("qtype_name,window,triton", [
    ("Q8_0", 0, False), ("Q4_0", 0, False), ("Q5_0", 5, False), ("Q5_0", 5, True)])
def test_graph_steps_equal_plain_steps(tmp_path, qtype_name, window, triton):
    """Steps through graphs.py equal Model.forward's own steps: prompt slices padded to their
    bucket (in place, and over the rows before the write plus the new ones: rings shorter
    than the bucket, a linear layer shorter than it), decode across a speculative rollback,
    a second turn's prompt, a fresh cache (which adopts the graphs: no second capture), and
    (window) ring caches that wrap, with a second, differently planned group of layers. Each
    bucket's first step is warmed up first, as a capture's is (``StepGraphs._warm_up``): a
    warm-up that kept its KV writes made the second turn's step, the first over a wrapped
    ring's old rows plus the new ones, attend over its own new keys (an H200 and here)."""
    from edgellm.backends.torch import graphs as graphs_module
    from edgellm.cache import CacheConfig
    from edgellm.quants import Q

    backend = _graph_backend(triton)
    net = _tiny_net(tmp_path, Q[qtype_name], backend, window, small=triton,  # interpreter
                    layers=2 if triton else None)
    if window:  # layers 0, 2 windowed (ring of window + reserve), layer 1 global
        net.layer_window = lambda i: 0 if i == 1 else window
    # CUDA's f16 GEMMs (above 8 tokens) round differently for another row count, and 8-bit
    # activations amplify that (test_triton_path_follows_cpu_torch): there, slices that take
    # the GEMM fill their bucket exactly; <= 8 tokens (the mat-vec: the same arithmetic at any
    # row count) and every slice on the CPU are padded
    prompt = [1, 5, 9, 200, 7, 3] if window else [1 + (11 * i) % 250
                                                  for i in range(64 if CUDA else 70)]
    turn = [17, 4, 33, 98, 2, 61] if window else [3 + (5 * i) % 250
                                                  for i in range(16 if CUDA else 20)]
    if triton and not CUDA:  # the interpreter's mat-vec over 8 rows is slow: slices of 9
        # (a 9-slot ring's worth) pad to 16 and take the GEMM; decode steps run the mat-vec
        prompt, turn = prompt + [40, 41, 42], turn + [50, 51, 52]
    steps = [11 + (7 * i) % 250 for i in range(4 if triton else 40 if window else 8)]
    graphs = backend.graphs
    config = CacheConfig(max_tokens=80 if window else 104, reserve=4)  # 104 < a bucket

    def run(use_graphs: bool, trim: int = 3):
        backend.graphs = graphs if use_graphs else None
        cache = net.make_cache(config=config)
        out = [net.forward(np.array(prompt), cache), _decode(net, cache, steps)]
        cache.trim(trim)  # a speculative rollback, then other tokens
        out += [_decode(net, cache, steps[:trim]), net.forward(np.array(turn), cache),
                _decode(net, cache, steps[:2])]
        backend.graphs = graphs
        return np.concatenate(out), cache

    eager, eager_cache = run(False)
    replayed, cache = run(True)
    g = graphs._graphs[id(net)][0]
    sizes = sorted({size for size, _ in g.buckets})
    assert sizes == sorted({1, *(graphs_module.bucket_for(len(p)) for p in (prompt, turn))})
    modes = {mode for b in g.buckets.values() for _, _, mode in b.mask_spans}
    if window or not CUDA:  # some steps in place, some over old rows + new ones (an exact
        assert modes == {True, False}  # bucket fits a linear layer in place)
    if window:
        assert len({layer.plan for layer in cache.layers}) == 2
        assert cache.layers[0].plan.is_ring and cache.offset > cache.layers[0].plan.slots
    np.testing.assert_allclose(replayed, eager, rtol=1e-4, atol=1e-4)  # RoPE: device f64
    assert np.array_equal(replayed.argmax(-1), eager.argmax(-1))
    for mine, theirs in zip(cache.layers, eager_cache.layers, strict=True):
        assert np.array_equal(mine.slot_pos, theirs.slot_pos) and mine.offset == theirs.offset
    for b in g.buckets.values():  # each group's span ends at the last slot its mask shows
        for gi, (start, width, _) in enumerate(b.mask_spans):
            mask = b.host.masks[start:start + b.size * width].view(b.size, width).numpy()
            span = int(b.host.i64[graphs_module._span_index(b.size, len(g.groups), gi)])
            assert mask[:, span - 1].any() and not mask[:, span:].any()
    if triton:  # (the interpreter is slow; adoption is the same without it)
        return
    del cache
    again, _ = run(True)  # a fresh cache adopts the graphs of the one just dropped
    np.testing.assert_array_equal(again, replayed)
    assert graphs.captures == (len(g.buckets) if graphs.capture else 0)


def test_a_cache_and_its_graphs_share_one_storage(tmp_path):
    """A KV cache is never held twice: a cache's first graph takes the cache's own storage
    (made with the graphs' spare row), a new cache after it is made in the storage of the
    graph whose cache is gone (zeroed, and adopted at its first step with nothing copied),
    a cache made while that graph is claimed gets its own, and a cache that adopts an
    orphan after its prompt ran eagerly copies its rows in. Each replays as its eager twin
    does."""
    import gc

    from edgellm.backends.torch.backend import KVStorage
    from edgellm.cache import CacheConfig
    from edgellm.quants import Q

    backend = _graph_backend()
    graphs = backend.graphs
    net = _tiny_net(tmp_path, Q.Q8_0, backend, layers=2)
    config = CacheConfig(max_tokens=48)
    prompt, steps = np.array([1 + (11 * i) % 250 for i in range(16)]), [11, 40, 7]

    def pointers(cache):  # (and the storage still converts what is written into it)
        assert all(isinstance(t, KVStorage) for layer in cache.layers
                   for t in (layer.store.keys, layer.store.values))
        return [(layer.store.keys.data_ptr(), layer.store.values.data_ptr())
                for layer in cache.layers]

    def run(cache, tokens=prompt):
        return np.concatenate([net.forward(tokens, cache), _decode(net, cache, steps)])

    backend.graphs = None
    eager = run(net.make_cache(config=config))
    backend.graphs = graphs

    first = net.make_cache(config=config)
    made = pointers(first)
    np.testing.assert_allclose(run(first), eager, rtol=1e-4, atol=1e-4)
    [g] = graphs._graphs[id(net)]
    assert [(k.data_ptr(), v.data_ptr()) for k, v in g.stores] == made == pointers(first)

    del first
    gc.collect()
    second = net.make_cache(config=config)  # in g's storage, emptied
    assert pointers(second) == made
    assert all(not layer.store.keys.any() and not layer.store.values.any()
               for layer in second.layers)
    third = net.make_cache(config=config)  # g is claimed by the second: its own storage
    assert not set(sum(pointers(third), ())) & set(sum(made, ()))
    np.testing.assert_allclose(run(second), eager, rtol=1e-4, atol=1e-4)
    assert graphs._graphs[id(net)] == [g] and g.owner() is second

    backend.graphs = None  # the third's prompt (not the second's), eagerly: its rows in
    other = prompt[::-1].copy()  # its own storage
    expected = run(net.make_cache(config=config), other)
    stepped = net.forward(other, third)
    backend.graphs = graphs
    del second
    gc.collect()
    # its first decode step adopts g: the prompt's rows are copied into g's storage
    np.testing.assert_allclose(np.concatenate([stepped, _decode(net, third, steps)]),
                               expected, rtol=1e-4, atol=1e-4)
    assert graphs._graphs[id(net)] == [g] and pointers(third) == made

    del third
    gc.collect()
    unstepped = net.make_cache(config=config)
    del unstepped  # a claim ends with its cache
    gc.collect()
    assert pointers(net.make_cache(config=config)) == made


def test_orphaned_graphs_make_room_first_and_stay_few(tmp_path, monkeypatch):
    """Graphs whose cache is gone (orphans, each holding that cache's storage for the next
    cache of its layout) are the first to go when a graph needs room, oldest first, and
    at most MAX_ORPHANS_PER_MODEL of them stay; live caches' graphs go only after them."""
    import gc

    from edgellm.backends.torch import graphs as graphs_module
    from edgellm.quants import Q

    monkeypatch.setattr(graphs_module, "MAX_GRAPHS_PER_MODEL", 3)
    monkeypatch.setattr(graphs_module, "MAX_ORPHANS_PER_MODEL", 1)
    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend, small=True)
    graphs = backend.graphs

    def stepped(budget):  # a cache of its own layout (budget), through its graphs
        cache = net.make_cache(budget)
        net.forward(np.array([1, 2, 3]), cache)
        return cache

    def layouts():
        return [g.signature[0][1][0] for g in graphs._graphs[id(net)]]  # (slots)

    for budget in (40, 48, 56):  # each dropped after its step
        stepped(budget)
        gc.collect()
    assert layouts() == [48, 56]  # 40's orphan made room for 56's graph (one orphan kept)
    live = [stepped(64), stepped(72)]
    assert layouts() == [56, 64, 72]  # 48's orphan went first, then one stays
    live.append(stepped(80))  # full: the orphan goes, not a live cache's graphs
    assert layouts() == [64, 72, 80]
    assert [g.owner() for g in graphs._graphs[id(net)]] == live


def test_threads_sharing_a_models_graphs_get_their_solo_steps(tmp_path):
    """Two threads stepping their own caches through one model's graphs at once (``generate``
    on a shared Model: one through ``forward``, one through the device's greedy stream)
    get the steps each gets alone: the graphs' shared buffers (logits, step inputs) serve
    one thread's step at a time (``StepGraphs._lock``)."""
    import threading

    from edgellm.quants import Q

    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend, layers=2)
    prompt = np.array([1 + (7 * i) % 250 for i in range(16)])
    steps = [3 + (5 * i) % 250 for i in range(40)]

    def by_forward():
        cache = net.make_cache(96)
        return np.concatenate([net.forward(prompt, cache), _decode(net, cache, steps)])

    def by_stream():
        cache = net.make_cache(96)
        net.forward(prompt[:9], cache)
        tokens = net.greedy_tokens(int(prompt[9]), cache)
        out = [next(tokens) for _ in range(40)]
        tokens.close()
        return out

    alone = [by_forward(), by_stream()]
    together: list = [None, None]

    def run(i, fn):
        together[i] = fn()

    threads = [threading.Thread(target=run, args=(i, fn))
               for i, fn in enumerate((by_forward, by_stream))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    np.testing.assert_array_equal(together[0], alone[0])
    assert together[1] == alone[1]


@pytest.mark.skipif(not CUDA, reason="captures CUDA graphs")
def test_another_threads_cuda_calls_during_our_capture_fail_neither(tmp_path, monkeypatch,
                                                                     caplog):
    """An embedding app's thread allocating device memory (a size never cached: cudaMalloc)
    and waiting for its own stream while one of our steps is being captured: its calls
    succeed, our captures hold (no step falls back to eager) and the logits are the ones
    the same steps give captured alone. A global capture, torch's default, forbids such
    calls in every thread: the app's call fails or voids our capture
    (``StepGraphs._record``'s thread-local capture)."""
    import logging
    import threading

    from edgellm.quants import Q

    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend, layers=2)
    graphs = backend.graphs
    prompt = np.array([1 + (7 * i) % 250 for i in range(9)])

    def steps(cache):
        return np.concatenate([net.forward(prompt, cache), _decode(net, cache, [5, 17, 42])])

    kept = net.make_cache(96)  # (kept alive: the next cache captures its own graphs)
    alone = steps(kept)
    app_stream = torch.cuda.Stream()
    errors: list[BaseException] = []
    allocated: list[int] = []

    def app_calls():
        try:
            with torch.cuda.stream(app_stream):
                block = torch.empty((64 + 2 * len(allocated)) << 20, dtype=torch.uint8,
                                    device="cuda")
                block.fill_(1)
                app_stream.synchronize()
                allocated.append(block.numel())
        except Exception as exc:  # noqa: BLE001 - what a global capture makes of it
            errors.append(exc)

    real_record = graphs._record

    def record_beside_the_app(warm_up, work):
        def work_after_the_apps_calls():  # (inside the capture: it has begun)
            app = threading.Thread(target=app_calls)
            app.start()
            app.join(timeout=60)
            return work()

        return real_record(warm_up, work_after_the_apps_calls)

    monkeypatch.setattr(graphs, "_record", record_beside_the_app)
    with caplog.at_level(logging.WARNING):
        together = steps(net.make_cache(96))
    assert not errors, errors
    assert len(allocated) >= 2  # (the prompt's bucket and decode's each captured)
    assert not [r for r in caplog.records if "capture" in r.getMessage()]
    np.testing.assert_array_equal(together, alone)


def test_streams_of_two_caches_taken_in_turns_get_their_solo_tokens(tmp_path):
    """Two caches' device streams (greedy, and sampled on the device) taken a token at a
    time in turns, so each step run ahead reads its token from the step before after the
    other cache's graphs replayed: each gets the tokens it gets alone. (On CUDA a
    captured step's outputs from the graphs' shared pool could lie in the scratch of the
    other graph, captured before it, whose replay then overwrote them: ``_outputs``.)"""
    from edgellm.quants import Q
    from edgellm.sampling import SamplingParams

    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend, layers=2)
    prompts = [np.array([1 + (7 * i) % 250 for i in range(9)]),
               np.array([5 + (11 * i) % 250 for i in range(13)])]
    params = SamplingParams(seed=7, temperature=0.9, top_k=40)

    def stream(prompt, sampled: bool):
        cache = net.make_cache(96)
        net.forward(prompt[:-1], cache)
        if sampled:
            return cache, net.sampled_tokens(int(prompt[-1]), cache, params,
                                             np.random.default_rng(7))
        return cache, net.greedy_tokens(int(prompt[-1]), cache)

    for sampled in (False, True):
        alone = []
        for prompt in prompts:
            cache, tokens = stream(prompt, sampled)
            alone.append([next(tokens) for _ in range(24)])
            tokens.close()
        pairs = [stream(prompt, sampled) for prompt in prompts]
        in_turns: list[list[int]] = [[], []]
        for _ in range(24):
            for i, (_, tokens) in enumerate(pairs):
                in_turns[i].append(next(tokens))
        for _, tokens in pairs:
            tokens.close()
        assert in_turns == alone, f"sampled={sampled}"


@pytest.mark.skipif(CUDA, reason="counts the eager twin's launches (on CUDA: one replay)")
@pytest.mark.parametrize("unfuse,extra", [("", None), ("glu", "_then_q8_kernel"),
                                          ("kv_write", "_store_kv_kernel"),
                                          ("attention_blocks", "_quantize_kernel"),
                                          ("rope", "_rope_qk_kernel")])
def test_decode_step_launches(tmp_path, monkeypatch, unfuse, extra):
    """A graph's decode step on the GPU path (here its eager twin in the interpreter) is 7
    triton launches a layer when Q, K and V share a type, and no torch arithmetic between
    them: the Q+K+V mat-vec rotates Q and K (no RoPE launch), the chained blocks' residual
    launches apply the next norm (no add, no norm launch), attention writes the output
    projection's blocks (no quantize launch) and stores the step's keys and values (no KV
    write launch), and the gate+up mat-vec applies the GLU and writes the down
    projection's blocks (no GLU launch). Around the layers: the embedding row, the first
    norm, the output mat-vec. Each fusion that EDGELLM_UNFUSE turns off costs one launch a
    layer, the kernel it had saved."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from edgellm.backends.torch import kernels
    from edgellm.quants import Q

    monkeypatch.setenv("EDGELLM_FUSE_LAUNCHES", "1")
    monkeypatch.setenv("EDGELLM_FUSE_QUANTIZE", "1")
    monkeypatch.setenv("EDGELLM_UNFUSE", unfuse)
    backend = _graph_backend(triton=True)
    layers = 3
    net = _tiny_net(tmp_path, Q.Q8_0, backend, small=True, layers=layers)
    cache = net.make_cache(64)
    net.forward(np.arange(1, 17), cache)
    net.forward(np.array([4]), cache)  # the decode bucket's first step: warm-up runs too
    launched = _count_launches(monkeypatch, kernels)
    arithmetic: list[str] = []

    class Arithmetic(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # (a norm or residual add in torch; the RoPE angles' one mul a step is allowed)
            if func.__name__.split(".")[0] in ("add", "div", "rsqrt", "pow", "mean"):
                arithmetic.append(func.__name__)
            return func(*args, **(kwargs or {}))

    launched.clear()
    with Arithmetic():
        net.forward(np.array([5]), cache)
    assert not arithmetic, arithmetic
    # (one _then_q8_kernel before the layers: the first norm)
    fused_away = {"_quantize_kernel": 0, "_store_kv_kernel": 0, "_then_q8_kernel": 1,
                  "_rope_qk_kernel": 0}
    for name, count in fused_away.items():
        assert launched.count(name) == count + (layers if name == extra else 0), launched
    assert launched.count("_qmv_glu_kernel") == (0 if unfuse == "glu" else layers), launched
    assert len(launched) == (7 + bool(extra)) * layers + 3, launched


@pytest.mark.skipif(CUDA, reason="counts the eager twin's launches (on CUDA: one replay)")
def test_decode_step_joins_v_of_another_type(tmp_path, monkeypatch):
    """V in another block type than Q and K (Q5_0 beside Q8_0; Q6_K beside Q4_K in half the
    1.5B's layers): a graph's decode step (its eager twin in the interpreter) still takes 7
    launches a layer, the Q+K stack (rotating Q and K) and V in one
    (``_qmv_joined_kernel``); with EDGELLM_UNFUSE=join 8, the two mat-vecs apart. The
    logits are the same bits."""
    from edgellm.backends.torch import kernels
    from edgellm.quants import Q

    layers, logits = 3, []
    for unfuse in ("", "join"):
        monkeypatch.setenv("EDGELLM_UNFUSE", unfuse)
        backend = _graph_backend(triton=True)
        net = _tiny_net(tmp_path, Q.Q8_0, backend, small=True, layers=layers,
                        v_qtype=Q.Q5_0)
        cache = net.make_cache(64)
        net.forward(np.arange(1, 17), cache)
        net.forward(np.array([4]), cache)  # the decode bucket's first step: warm-up runs too
        with monkeypatch.context() as patch:
            launched = _count_launches(patch, kernels)
            logits.append(net.forward(np.array([5]), cache))
        joined = launched.count("_qmv_joined_kernel")
        assert joined == (0 if unfuse else layers), launched
        assert launched.count("_rope_qk_kernel") == 0, launched
        assert len(launched) == (8 if unfuse else 7) * layers + 3, launched
    np.testing.assert_array_equal(logits[0], logits[1])


@pytest.mark.skipif(CUDA, reason="counts eager launches in the interpreter")
def test_eager_decode_takes_attentions_blocks(tmp_path, monkeypatch):
    """An eager decode step (no graphs: the model's one-token attention_append) hands the
    output projection the 8-bit blocks attention's launch wrote: no quantize launch, and
    the same logits as the graph step's eager twin."""
    from edgellm.backends.torch import kernels
    from edgellm.quants import Q

    backend = _graph_backend(triton=True)
    net = _tiny_net(tmp_path, Q.Q8_0, backend, small=True, layers=2)
    outs = []
    for graphs in (None, backend.graphs):
        backend.graphs = graphs
        cache = net.make_cache(64)
        net.forward(np.arange(1, 17), cache)
        with monkeypatch.context() as patch:
            launched = _count_launches(patch, kernels)
            outs.append(net.forward(np.array([5]), cache))
        if graphs is None:
            assert "_quantize_kernel" not in launched, launched
    np.testing.assert_array_equal(outs[0], outs[1])


def test_unknown_fusion_names_are_refused(monkeypatch):
    """EDGELLM_UNFUSE names only the fusions there are (a typo would A/B nothing)."""
    from edgellm.backends.torch import TorchBackend

    monkeypatch.setenv("EDGELLM_UNFUSE", "glu,kv_writes")
    with pytest.raises(ValueError, match="unknown fusion kv_writes"):
        TorchBackend(device="cpu")


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper GPU or later")
@pytest.mark.parametrize("mode", [1, 2], ids=["wait", "prefetch"])
def test_dependent_launches_change_no_bits(tmp_path, monkeypatch, mode):
    """Programmatic dependent launches (EDGELLM_PDL=1: each kernel may start before the one
    before it ends, and waits for it in ``kernels._await_inputs``; 2: the mat-vecs ask L2
    for their weights first) give the same bits as plain launches: a prompt, decode steps
    replayed from graphs captured each way, and eager steps. A kernel that touched the
    previous launch's output before its wait would race, and differ here sooner or later."""
    from edgellm.backends.torch import kernels
    from edgellm.quants import Q

    prompt, steps = [1 + (11 * i) % 250 for i in range(64)], [3, 77, 150, 9] * 8
    outs = []
    for pdl in (0, mode, mode):
        monkeypatch.setattr(kernels, "_pdl_devices", {})
        monkeypatch.setenv("EDGELLM_PDL", str(pdl))
        backend = _graph_backend()
        if len(outs) == 2:
            backend.graphs = None  # eager steps
        net = _tiny_net(tmp_path, Q.Q5_0, backend)
        cache = net.make_cache(max_tokens=128)
        outs.append(np.concatenate([net.forward(np.array(prompt), cache),
                                    _decode(net, cache, steps)]))
        assert kernels._pdl(torch.device("cuda", torch.cuda.current_device())) == pdl
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_allclose(outs[2], outs[0], rtol=1e-4, atol=1e-4)  # (eager: T differs)


def _count_launches(patch, kernels) -> list[str]:
    """Every ``kernels.*_kernel`` wrapped (through ``patch``, a monkeypatch) to record its
    launches by name in the list returned."""
    launched: list[str] = []
    for name in [n for n in dir(kernels) if n.endswith("_kernel")]:
        patch.setattr(kernels, name, _Counted(getattr(kernels, name), name, launched))
    return launched


class _Counted:
    """A triton kernel whose launches (``kernel[grid](...)``) are recorded by name."""

    def __init__(self, kernel, name: str, launched: list):
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize("window", [0, 5])
def test_greedy_tokens_on_the_device_equal_host_argmax(tmp_path, window):
    """Model.greedy_tokens through graphs.py (argmax on the device, each step queued before
    the one before is read back) gives the tokens of forward + the host's argmax, and once
    closed leaves the cache as they do: the step run ahead is taken back out, so a later
    step's logits are the same. Also at the cache's end (the last free slot is never run
    ahead into) and, with a window, across a ring's wrap."""
    from edgellm.cache import CacheConfig
    from edgellm.quants import Q

    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend, window)
    graphs = backend.graphs
    config = CacheConfig(max_tokens=24, reserve=4)

    def run(use_graphs: bool, n: int):
        backend.graphs = graphs if use_graphs else None
        try:
            cache = net.make_cache(config=config)
            first = int(net.forward(np.array([1, 5, 9, 200]), cache)[0].argmax())
            steps = net.greedy_tokens(first, cache)
            tokens = [next(steps) for _ in range(n)]
            steps.close()
            books = [(layer.slot_pos.copy(), layer.offset) for layer in cache.layers]
            after = net.forward(np.array([7]), cache) if cache.fits(1) else None
            return tokens, books, after
        finally:
            backend.graphs = graphs

    for n in (1, 3, 19):  # 19: the prompt's 4 + 19 fill 23 of 24 slots; the last is left
        host = run(False, n)
        device = run(True, n)
        assert device[0] == host[0]
        for (pos, off), (pos_h, off_h) in zip(device[1], host[1], strict=True):
            assert off == off_h and np.array_equal(pos, pos_h)
        if host[2] is None:
            assert device[2] is None
        else:
            np.testing.assert_allclose(device[2], host[2], rtol=1e-4, atol=1e-4)
    if window:
        assert net.make_cache(config=config).layers[0].plan.is_ring


def test_stream_generate_greedy_uses_device_argmax(tmp_path, monkeypatch):
    """A greedy reply (no penalties) takes its tokens from Model.greedy_tokens, gives the
    tokens the host's sampler does, and leaves a chat's cache where the host path leaves it."""
    from edgellm.generate import generate_step
    from edgellm.quants import Q
    from edgellm.sampling import SamplingParams

    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend)
    calls = []
    real = net.greedy_tokens
    monkeypatch.setattr(net, "greedy_tokens", lambda *a: calls.append(a) or real(*a))
    greedy = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                               logit_bias={3: 0.0})  # changes nothing, but is not argmax-only
    assert greedy.argmax_only and not penalised.argmax_only
    out = []
    for params in (greedy, penalised):
        cache = net.make_cache(64)
        steps = generate_step([1, 5, 9, 200], net, cache, params)
        out.append(([next(steps)[0] for _ in range(6)], cache))
        steps.close()
    (tokens, cache), (tokens_host, cache_host) = out
    assert len(calls) == 1 and tokens == tokens_host
    assert cache.offset == cache_host.offset == 4 + 5


@pytest.mark.parametrize("window", [0, 5])
def test_sampled_tokens_on_the_device_equal_host_sampling(tmp_path, monkeypatch, window):
    """A sampled reply whose chain the device can draw (top-k up to its candidates,
    penalties over up to PENALTY_WINDOW tokens, up to SAMPLE_BIASES biases; greedy with
    penalties or bias too) takes its tokens from Model.sampled_tokens after the first: the
    tokens the host's sampler draws, seed for seed (one uniform a token from the same
    generator), for several chains, and the cache where the host path leaves it once
    closed (the step run ahead taken back out). The penalties change the tokens. A chain
    the device cannot draw (top-k off or past the candidates, a longer window or the
    whole history, too many biases) samples on the host."""
    from edgellm.generate import generate_step
    from edgellm.quants import Q
    from edgellm.sampling import SamplingParams

    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend, window)
    graphs = backend.graphs
    drawn_on_device = []  # (params, whether graphs.sample took them) per reply

    def spy(model, token, cache, params, rng, evict=True, context=None):
        steps = real(model, token, cache, params, rng, evict, context)
        drawn_on_device.append((params, steps is not None))
        return steps

    real = graphs.sample
    monkeypatch.setattr(graphs, "sample", spy)
    chains = [SamplingParams(seed=1), SamplingParams(seed=2, temperature=1.5, top_k=64,
                                                     top_p=1.0, min_p=0.0),
              SamplingParams(seed=3, temperature=0.7, top_k=5, top_p=0.5, min_p=0.1),
              SamplingParams(seed=4, top_k=1)]
    penalised = [SamplingParams(temperature=0, repetition_penalty=1.5, penalty_last_n=3),
                 SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=0.5,
                                logit_bias={7: 3.0, 299: -100.0}),
                 SamplingParams(seed=1, repetition_penalty=0.8, frequency_penalty=-0.4,
                                penalty_last_n=1),
                 SamplingParams(seed=1, presence_penalty=1.5, logit_bias={44: 2.5}),
                 SamplingParams(seed=2, top_k=64, repetition_penalty=1.3, penalty_last_n=64,
                                logit_bias={t: 0.5 for t in range(128)})]
    chains += penalised
    replies = []
    for params in chains + [SamplingParams(temperature=0)]:
        out = []
        for use_graphs in (True, False):
            backend.graphs = graphs if use_graphs else None
            cache = net.make_cache(64)
            steps = generate_step([1, 5, 9, 200], net, cache, params)
            tokens = [next(steps)[0] for _ in range(12)]
            steps.close()
            out.append((tokens, cache.offset))
        backend.graphs = graphs
        (device, offset), (host, offset_host) = out
        assert device == host and offset == offset_host == 4 + 11
        replies.append(device)
    assert drawn_on_device == [(params, True) for params in chains]
    assert replies[0] != replies[-1]  # (the default chain's draws are not the argmax's)
    # (the penalties and biases change what is drawn: greedy's tokens, seed 1's draws)
    assert replies[-1] not in replies[-6:-4] and replies[0] not in replies[-4:-2]
    host_only = [SamplingParams(seed=1, top_k=0), SamplingParams(seed=1, top_k=65),
                 SamplingParams(seed=1, repetition_penalty=1.1, penalty_last_n=-1),
                 SamplingParams(seed=1, repetition_penalty=1.1, penalty_last_n=65),
                 SamplingParams(seed=1, logit_bias={t: 0.5 for t in range(129)})]
    for params in host_only:
        steps = generate_step([1, 5, 9, 200], net, net.make_cache(64), params)
        [next(steps) for _ in range(3)]
        steps.close()
    assert drawn_on_device[len(chains):] == [(params, False) for params in host_only]


def test_one_sequence_batches_replay_graphs_without_evicting(tmp_path, monkeypatch):
    """Model.forward_batch of one sequence (an engine serving one user) runs through the
    backend's graphs: the logits of the eager batch path, for a prompt chunk and decode
    steps. Past MAX_GRAPHS_PER_MODEL an engine's cache still gets graphs of its own and
    evicts none (its slots never capture again by turns, and none runs eagerly); a cache
    stepped directly (``Model.forward``) evicts the oldest."""
    from edgellm.backends.torch import graphs as graphs_module
    from edgellm.quants import Q

    monkeypatch.setattr(graphs_module, "MAX_GRAPHS_PER_MODEL", 2)
    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend)
    graphs = backend.graphs
    steps = [[1, 5, 9, 200, 7], [3], [44], [8]]

    def run(cache, use_graphs: bool):
        backend.graphs = graphs if use_graphs else None
        try:
            return [net.forward_batch([(np.array(t), cache)], [True])[0] for t in steps]
        finally:
            backend.graphs = graphs

    caches = [net.make_cache(64) for _ in range(3)]
    eager = run(net.make_cache(64), False)
    for cache in caches:
        got = run(cache, True)
        np.testing.assert_allclose(np.stack(got), np.stack(eager), rtol=1e-4, atol=1e-4)
        assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in eager]
    owners = [g.owner() for g in graphs._graphs[id(net)]]
    assert owners == caches  # the third past the cap of 2, evicting neither
    direct = net.make_cache(64)
    net.forward(np.array([3]), direct)
    assert [g.owner() for g in graphs._graphs[id(net)]] == [*caches[1:], direct]


def test_prompt_chunks_without_logits_replay_as_eager_steps(tmp_path):
    """A lone sequence's prompt in chunks through Model.forward_batch, its logits wanted
    only at the last chunk (an engine's prefill), then a decode step: the logits and the
    books of the eager path. Each chunk's step is waited for before the next refills its
    bucket's pinned inputs (``StepGraphs.queue_step``): on a GPU a step not waited for
    could read the next chunk's inputs."""
    from edgellm.quants import Q

    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend)
    graphs = backend.graphs
    chunks = [np.array([1 + (13 * i + 7 * j) % 250 for i in range(8)]) for j in range(6)]

    def run(use_graphs: bool):
        backend.graphs = graphs if use_graphs else None
        try:
            cache = net.make_cache(96)
            out = [net.forward_batch([(c, cache)], [j == len(chunks) - 1])[0]
                   for j, c in enumerate(chunks)]
            out.append(net.forward_batch([(np.array([5]), cache)], [True])[0])
            return out, cache
        finally:
            backend.graphs = graphs

    (got, cache), (eager, eager_cache) = run(True), run(False)
    assert graphs._graphs[id(net)][0].owner() is cache  # (replayed, not eager)
    assert all(x is None for x in got[:-2]) and all(x is None for x in eager[:-2])
    np.testing.assert_allclose(np.stack(got[-2:]), np.stack(eager[-2:]), rtol=1e-4,
                               atol=1e-4)
    assert cache.offset == eager_cache.offset == 49


def test_batches_replay_each_sequences_graphs(tmp_path, monkeypatch):
    """A batch of several sequences (the engine's concurrent users) replays each one's own
    graphs, one after another, where every cache can run as graphs (past
    MAX_GRAPHS_PER_MODEL too, evicting none): the logits of the eager batch (a prompt
    chunk beside a decode token, then decode steps), each cache's books as after the
    eager batch. Where one cache cannot run as graphs (a Q8_0 cache), the whole batch
    runs eagerly, and a batch that overflows a cache raises before any cache is
    written. (Batch graphs off, as EDGELLM_BATCH_GRAPHS=0 sets them: with them, a decode
    step of a set replays one graph of it, ``test_decode_batches_replay_one_graph_of_their
    _set``; a prompt beside decode tokens still takes this path.)"""
    from edgellm.backends.torch import graphs as graphs_module
    from edgellm.cache import CacheConfig, ContextOverflow
    from edgellm.quants import Q

    monkeypatch.setattr(graphs_module, "MAX_GRAPHS_PER_MODEL", 2)
    monkeypatch.setattr(graphs_module, "BATCH_GRAPHS", False)
    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend)
    graphs = backend.graphs
    replays = []
    real = graphs.queue_step
    monkeypatch.setattr(graphs, "queue_step",
                        lambda *a, **k: replays.append(a[2]) or real(*a, **k))
    steps = [([1, 5, 9, 200, 7], [3, 8]), ([44], [2]), ([8], [61])]

    def run(caches, use_graphs: bool):
        backend.graphs = graphs if use_graphs else None
        try:
            return [net.forward_batch([(np.array(t), c) for t, c in zip(step, caches, strict=True)],
                                      [True] * len(caches)) for step in steps]
        finally:
            backend.graphs = graphs

    eager_caches = [net.make_cache(64) for _ in range(2)]
    eager = run(eager_caches, False)
    caches = [net.make_cache(64) for _ in range(2)]
    got = run(caches, True)
    assert replays == caches * len(steps)  # (each step: both sequences' graphs)
    for g, e in zip(got, eager, strict=True):
        np.testing.assert_allclose(np.stack(g), np.stack(e), rtol=1e-4, atol=1e-4)
        assert [int(x.argmax()) for x in g] == [int(x.argmax()) for x in e]
    for c, e in zip(caches, eager_caches, strict=True):
        for layer, layer_e in zip(c.layers, e.layers, strict=True):
            assert layer.offset == layer_e.offset
            assert np.array_equal(layer.slot_pos, layer_e.slot_pos)
    # a sequence whose logits are not wanted (a prompt's chunk before its last) gets None
    pairs = [(np.array([9]), caches[0]), (np.array([12]), caches[1])]
    got = net.forward_batch(pairs, [False, True])
    backend.graphs = None
    expected = net.forward_batch([(t, e) for (t, _), e in zip(pairs, eager_caches, strict=True)],
                                 [False, True])
    backend.graphs = graphs
    assert got[0] is None and expected[0] is None
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-4, atol=1e-4)
    # the two graphs share what one replay at a time allows: the logits and each bucket's
    # device inputs (the host sets are each bucket's own)
    first, second = graphs._graphs[id(net)]
    assert first.buckets.keys() == second.buckets.keys()
    for key, b in first.buckets.items():
        other = second.buckets[key]
        assert b.logits is other.logits
        assert b.dev_i64 is other.dev_i64 and b.dev_masks is other.dev_masks
        assert b.host.i64.data_ptr() != other.host.i64.data_ptr()
    replays.clear()
    third = net.make_cache(64)  # past the cap of 2: graphs of its own, evicting none
    net.forward_batch([(np.array([4]), caches[0]), (np.array([1, 2]), third)])
    assert replays == [caches[0], third] and len(graphs._graphs[id(net)]) == 3
    replays.clear()
    quantized = net.make_cache(config=CacheConfig(max_tokens=64, dtype="q8_0"))
    mixed = net.forward_batch([(np.array([5]), caches[1]), (np.array([1, 2]), quantized)])
    assert replays == [] and all(x is not None for x in mixed)  # (no graphs: all eager)
    before = [c.offset for c in caches]  # (9 and 6 of 64)
    with pytest.raises(ContextOverflow):  # (both could replay: the first is not run)
        net.forward_batch([(np.array([4]), caches[1]), (np.arange(57), caches[0])])
    assert replays == [] and [c.offset for c in caches] == before


@pytest.mark.parametrize("triton", [False, True])
def test_decode_batches_replay_one_graph_of_their_set(tmp_path, monkeypatch, triton):
    """Decode steps of several caches (the engine's concurrent users, a token each) replay
    one graph of their set (``StepGraphs.queue_batch``: the tokens through the mat-vecs
    together, each attending over its own cache: on the GPU path's kernels in one launch a
    layer), in any order of the batch: the logits
    and books of the eager batch, with ring layers that wrap beside a global one (two
    groups of layers). No sequence's own graph replays a decode step. Not ``triton`` (the
    interpreter is slow there: two sequences, two steps): a subset of the set gets a
    graph of its own, the least recently used going past MAX_BATCH_GRAPHS_PER_MODEL, and
    a member's graph evicted takes the set's batch graph with it, the set capturing anew
    over the member's new graph."""
    from edgellm.backends.torch import graphs as graphs_module
    from edgellm.cache import CacheConfig
    from edgellm.quants import Q

    monkeypatch.setattr(graphs_module, "MAX_BATCH_GRAPHS_PER_MODEL", 1)
    monkeypatch.setattr(graphs_module, "MAX_GRAPHS_PER_MODEL", 3)
    backend = _graph_backend(triton)
    window = 5
    net = _tiny_net(tmp_path, Q.Q5_0 if triton else Q.Q8_0, backend, window, small=triton,
                    layers=2 if triton else None)
    net.layer_window = lambda i: 0 if i == 1 else window  # ring, global(, ring)
    config = CacheConfig(max_tokens=64, reserve=4)  # rings of 9 slots
    graphs = backend.graphs
    singles, apart = [], []
    real = graphs.queue_step
    monkeypatch.setattr(graphs, "queue_step",
                        lambda *a, **k: singles.append(a[2]) or real(*a, **k))
    real_attention = backend.attention
    monkeypatch.setattr(backend, "attention", lambda *a, **k: apart.append(
        k.get("apart") is not None) or real_attention(*a, **k))
    prompts = [[1, 5, 9], [3, 8, 2, 7, 11, 6], [44]][:2 if triton else 3]
    # the sequences of each step, in the batch's order: the set in turns of order, then
    # two of them (a batch graph of their own, which drops the set's), then the set again
    plan = ([(0, 1), (1, 0)] if triton
            else [(0, 1, 2), (2, 0, 1), (1, 2, 0)] * 3 + [(0, 2), (2, 0), (1, 0, 2)])

    def steps(caches, tokens, order_list):
        out = []
        for order in order_list:
            got = net.forward_batch([(np.array([tokens[j]]), caches[j]) for j in order])
            out.append(dict(zip(order, got, strict=True)))
            tokens.update((j, int(x.argmax())) for j, x in out[-1].items())
        return out

    def run(use_graphs: bool):
        backend.graphs = graphs if use_graphs else None
        try:
            caches = [net.make_cache(config=config) for _ in prompts]
            tokens = {j: int(net.forward_batch([(np.array(p), c)])[0].argmax())
                      for j, (p, c) in enumerate(zip(prompts, caches, strict=True))}
            return steps(caches, tokens, plan), caches, tokens
        finally:
            backend.graphs = graphs

    def same(got, expected):
        for g, e in zip(got, expected, strict=True):
            assert g.keys() == e.keys()
            for j in g:
                np.testing.assert_allclose(g[j], e[j], rtol=1e-4, atol=1e-4)
                assert int(g[j].argmax()) == int(e[j].argmax())

    (got, caches, tokens), (eager, eager_caches, eager_tokens) = run(True), run(False)
    same(got, eager)
    _assert_same_books(caches, eager_caches)
    assert singles == caches  # (their prompts only)
    # the GPU path's kernels: a layer's rows in one launch, each over its own cache
    assert any(apart) == (backend.kernels is not None)
    batches = graphs._batches[id(net)]
    assert len(batches) == 1  # the last set's (the cap of 1 dropped the subset's)
    (last,) = batches.values()
    assert sorted(id(g.owner()) for g in last.members) == sorted(map(id, caches))
    n, n_groups = last.size, len(last.mask_spans)
    for gi, (start, width, _) in enumerate(last.mask_spans):  # each row's span: its mask's
        masks = last.host.masks[start:start + n * width].view(n, width).numpy()
        at = graphs_module._batch_index(n, n_groups, "spans", gi)
        for j, span in enumerate(last.host.i64[at:at + n].tolist()):
            assert masks[j, span - 1] and not masks[j, span:].any()
    if triton:
        return
    assert caches[0].layers[0].plan.is_ring and len({layer.plan for layer in caches[0].layers}) == 2
    assert caches[0].layers[0].offset > caches[0].layers[0].plan.slots  # (the ring wrapped)
    direct = net.make_cache(config=config)  # stepped directly at a cap of 3: evicts caches[0]'s
    net.forward(np.array([3]), direct)
    assert batches == {} and caches[0] not in [g.owner() for g in graphs._graphs[id(net)]]
    more = [(0, 1, 2), (2, 1, 0)]
    got = steps(caches, tokens, more)
    backend.graphs = None
    expected = steps(eager_caches, eager_tokens, more)
    backend.graphs = graphs
    same(got, expected)
    _assert_same_books(caches, eager_caches)
    (again,) = batches.values()
    assert again is not last and caches[0] in [g.owner() for g in again.members]


def test_decode_tokens_past_a_batch_graph_and_beside_a_prompt(tmp_path, monkeypatch):
    """A step with more decode tokens than a batch graph holds (MAX_BATCH_SEQUENCES: 2
    here) and a joining request's prompt chunk: the decode tokens replay batch graphs of
    up to 2 in their caches' order, the one left over and the prompt their own caches'
    graphs, all queued before any is waited for; the eager batch's logits and books."""
    from edgellm.backends.torch import graphs as graphs_module
    from edgellm.quants import Q

    monkeypatch.setattr(graphs_module, "MAX_BATCH_SEQUENCES", 2)
    backend = _graph_backend()
    net = _tiny_net(tmp_path, Q.Q8_0, backend)
    graphs = backend.graphs
    singles, batched = [], []
    real_step, real_batch = graphs.queue_step, graphs.queue_batch
    monkeypatch.setattr(graphs, "queue_step",
                        lambda *a, **k: singles.append(a[2]) or real_step(*a, **k))

    def spy_batch(*a, **k):
        wait = real_batch(*a, **k)
        batched.extend([len(a[2])] if wait is not None else [])
        return wait

    monkeypatch.setattr(graphs, "queue_batch", spy_batch)
    prompts = [[1, 5, 9], [3, 8, 2, 7], [44], [6, 6], [90, 12, 3, 4, 5]]

    def run(use_graphs: bool):
        backend.graphs = graphs if use_graphs else None
        try:
            caches = [net.make_cache(64) for _ in range(6)]
            tokens = [int(net.forward_batch([(np.array(p), c)])[0].argmax())
                      for p, c in zip(prompts, caches[:5], strict=True)]
            joining = net.forward_batch(
                [(np.array([t]), c) for t, c in zip(tokens, caches[:5], strict=True)]
                + [(np.array([7, 9, 11]), caches[5])])
            tokens = [int(x.argmax()) for x in joining]
            six = net.forward_batch([(np.array([t]), c) for t, c in zip(tokens, caches,
                                                                         strict=True)])
            return joining + six, caches
        finally:
            backend.graphs = graphs

    (got, caches), (eager, eager_caches) = run(True), run(False)
    for g, e in zip(got, eager, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)
        assert int(g.argmax()) == int(e.argmax())
    for c, e in zip(caches, eager_caches, strict=True):
        assert c.offset == e.offset
        for layer, layer_e in zip(c.layers, e.layers, strict=True):
            assert np.array_equal(layer.slot_pos, layer_e.slot_pos)
    assert batched == [2, 2] + [2, 2, 2]  # pairs in their caches' order (``cache_sets``)
    left_over = max(caches[:5], key=id)  # (the last of the five in that order)
    assert singles == caches[:5] + [left_over, caches[5]]  # prompts; a lone one, the joiner


@pytest.mark.parametrize("triton", [False, True])
def test_sets_of_one_size_rebind_a_batch_graph_not_make_another(tmp_path, monkeypatch,
                                                               triton):
    """Other caches decoding together, as many as a set before (an engine's requests come
    and go), take over that set's batch graph, once all its steps were read, rather than
    make (on a GPU: capture) another: on the GPU path (``triton``; on CUDA both) its offsets
    from the first set's storage refilled in place (what a captured graph reads), else its
    parts bound anew; two sets of one step each get their own. The eager batch's logits
    and books throughout; a graph captured over its members' own storage a part at a time
    is not rebound. (The eager steps: each sequence alone.)"""
    from edgellm.backends.torch import graphs as graphs_module
    from edgellm.quants import Q

    monkeypatch.setattr(graphs_module, "MAX_BATCH_SEQUENCES", 2)
    backend = _graph_backend(triton)
    net = _tiny_net(tmp_path, Q.Q5_0 if triton else Q.Q8_0, backend, small=triton,
                    layers=2 if triton else None)
    graphs = backend.graphs
    made = []
    real_new = graphs._new_batch
    monkeypatch.setattr(graphs, "_new_batch", lambda m: made.append(m) or real_new(m))

    def run(use_graphs: bool, plan: list | None = None):
        """The caches of each decode step: all four (two sets of two, in their caches'
        order: a, b and c, d), then pairs that no set before held (``plan``: as made)."""
        backend.graphs = graphs if use_graphs else None
        try:
            caches = [net.make_cache(64) for _ in range(4)]
            tokens = [int(net.forward_batch([(np.array([5 + j, 9]), c)])[0].argmax())
                      for j, c in enumerate(caches)]
            plan = plan or [(0, 1, 2, 3)]
            out = []
            while len(out) < len(plan):
                order = plan[len(out)]  # (eagerly a sequence at a time: a batch's row
                # count rounds CPU torch's dense matmuls otherwise, 8-bit activations more)
                pairs = [(np.array([tokens[j]]), caches[j]) for j in order]
                got = (net.forward_batch(pairs) if use_graphs
                       else [net.forward_batch([pair])[0] for pair in pairs])
                out.append(got)
                for j, x in zip(order, got, strict=True):
                    tokens[j] = int(x.argmax())
                if len(plan) == 1:
                    (a, b), (c, d) = graphs_module.cache_sets(caches)
                    plan += [(a, c), (d, b)] + ([] if triton else [(b, c), (c, a, d, b),
                                                                    (d, a)])
            return out, caches, plan
        finally:
            backend.graphs = graphs

    got, caches, plan = run(True)
    eager, eager_caches, _ = run(False, plan)
    for step, expected in zip(got, eager, strict=True):
        for g, e in zip(step, expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)
            assert int(g.argmax()) == int(e.argmax())
    _assert_same_books(caches, eager_caches)
    assert len(made) == 2  # the first step's two sets; every pair after rebound one
    batches = graphs._batches[id(net)]
    assert len(batches) == 2 and all(b.unread == 0 for b in batches.values())
    last = list(batches.values())[-1]
    owners = {id(g.owner()) for g in last.members}
    assert owners == {id(caches[j]) for j in plan[-1]}
    for layer in last.inputs[3]:  # each part over its member's own storage, no other's
        assert [p.keys.data_ptr() for p in layer.parts] == [
            g.stores[layer.layer][0].data_ptr() for g in last.members]
    if backend.kernels is not None:  # the anchor kept, each row's offset from it to its
        # member's storage
        assert last.anchor is made[1][0] and list(map(id, last.members)) != list(map(id, made[1]))
        base = last.anchor.stores[0][1]
        assert last.apart[0, 1].tolist() == [
            (g.stores[0][1].data_ptr() - base.data_ptr()) // base.element_size()
            for g in last.members]
        last.inputs[3][0].one_launch = False  # as if it had attended a part at a time
    else:
        assert last.anchor is last.members[0] and last.apart is None
    captured, last.graph = last.graph, last.graph or object()  # (CPU: as if captured)
    try:  # rebinding would leave the captured launches reading the old members' storage
        assert not graphs._rebind(last, tuple(reversed(last.members)))
    finally:
        last.graph = captured
    assert {id(g.owner()) for g in last.members} == owners


def test_a_batch_steps_draws_follow_their_sequences_into_other_rows():
    """A stream's step ahead takes the tokens the step before drew in its own rows' order
    (``_QueuedBatch.drawn_in``): the same order as is, another (a member's graph made again
    between the two steps) by sequence."""
    from edgellm.backends.torch import graphs as graphs_module

    queued = graphs_module._QueuedBatch(lambda: [], [2, 0, 1], torch.tensor([7, 8, 9]))
    assert queued.drawn_in([2, 0, 1]) is queued.drawn
    assert queued.drawn_in([0, 1, 2]).tolist() == [8, 9, 7]


def test_device_draw_equals_the_host_draw():
    """graphs._sample (top-k of the candidates, top-p, min-p, temperature, the draw by a
    uniform) picks the token the host's chain picks for the same uniform, on logits with
    ties at the k-th (as many as the candidates hold) and at the top, and returns the
    logits' maximum; over every row at once (a batch graph's draw) as over each alone, and
    GREEDY_KNOBS draw the argmax (the first of tied maxima)."""
    from edgellm.backends.torch import graphs as graphs_module
    from edgellm.sampling import SamplingParams, _in_play

    rng = np.random.default_rng(0)
    rows = []  # (logits, knobs, the host's token)
    for trial in range(300):
        logits = (rng.normal(size=1000) * rng.choice([0.3, 2.0, 8.0])).astype(np.float32)
        top_k = int(rng.choice([1, 2, 40, 64]))
        order = np.argsort(-logits)
        if trial % 3 == 0 and top_k <= 60:  # 4 more equal to the k-th, 1 more to the top
            logits[order[top_k:top_k + 4]] = logits[order[top_k - 1]]
            logits[order[1]] = logits[order[0]]
        params = SamplingParams(temperature=float(rng.choice([0.3, 0.8, 1.5])),
                                top_k=top_k,
                                top_p=float(rng.choice([0.3, 0.95, 1.0])),
                                min_p=float(rng.choice([0.0, 0.05, 0.2])))
        u = rng.random()
        ids, probs = _in_play(logits, params)
        running = np.cumsum(probs)
        want = int(ids[np.searchsorted(running / running[-1], u, side="right")])
        knobs = graphs_module._Draw(params, np.random.default_rng(0)).knobs()
        knobs[3] = u
        best, token = graphs_module._sample(torch.from_numpy(logits)[None],
                                            torch.tensor([knobs], dtype=torch.float64))
        assert int(token) == want and float(best) == logits.max()
        rows.append((logits, knobs, want))
    # every row at once (a batch graph's draw), and each row's argmax by GREEDY_KNOBS (the
    # first of tied maxima: a third of the rows tie at the top)
    logits = torch.from_numpy(np.stack([r[0] for r in rows]))
    best, tokens = graphs_module._sample(logits, torch.tensor([r[1] for r in rows],
                                                              dtype=torch.float64))
    assert tokens.tolist() == [r[2] for r in rows]
    assert np.array_equal(best.numpy(), logits.numpy().max(axis=1))
    greedy = torch.tensor([graphs_module.GREEDY_KNOBS] * len(rows), dtype=torch.float64)
    assert graphs_module._sample(logits, greedy)[1].tolist() == logits.numpy().argmax(1).tolist()


def test_device_penalties_equal_the_hosts_bit_for_bit():
    """graphs._processed (logit bias, then repetition, frequency and presence penalties
    over the window) gives the logits ``sampling.logits_processor`` gives, bit for bit, on
    logits with zeros of either sign, repeated tokens, windows of 1..64 shorter and longer
    than the history, the window's last token read on the device (the host has not read
    it: ``chained``) or known, ids past the vocabulary in the history (the host skips
    them), and rows without any (a batch's argmax rows): over each row alone and all at
    once."""
    from edgellm.backends.torch import graphs as graphs_module
    from edgellm.sampling import SamplingParams, logits_processor

    rng = np.random.default_rng(0)
    vocab, widths = 1000, graphs_module.PROCESSING_WIDTHS
    rows = []  # (logits, input token, ints, floats, the host's logits)
    for trial in range(200):
        logits = (rng.normal(size=vocab) * rng.choice([0.3, 2.0, 8.0])).astype(np.float32)
        logits[rng.integers(0, vocab, 5)], logits[rng.integers(0, vocab, 3)] = 0.0, -0.0
        context = [int(t) for t in rng.integers(0, 40, size=int(rng.integers(1, 100)))]
        if trial % 10 == 0:
            context[0] = vocab + 5  # (a tokenizer's id past the logits)
        bias = {int(t): float(rng.normal() * 5) for t in rng.integers(0, vocab, 4)}
        params = SamplingParams(
            repetition_penalty=float(rng.choice([1.0, 1.1, 0.7, 1.3])),
            frequency_penalty=float(rng.choice([0.0, 0.5, -0.3])),
            presence_penalty=float(rng.choice([0.0, 0.2, 1.1])),
            penalty_last_n=int(rng.choice([1, 2, 5, 64])),
            logit_bias=bias if trial % 3 else {})
        chained = trial % 2 == 1
        draw = graphs_module._Draw(params, np.random.default_rng(0),
                                   context[:-1] if chained else context)
        ints, floats = np.zeros(widths[0], np.int64), np.zeros(widths[1], np.float32)
        if draw.processes:
            draw.processing(chained, vocab, ints, floats)
        else:  # (as ``_fill_processing`` fills a row that changes nothing)
            graphs_module._unprocessed(ints, floats)
        host = logits_processor(params)(logits.copy(), context)
        got = graphs_module._processed(torch.from_numpy(logits)[None],
                                       torch.tensor([context[-1]]),
                                       torch.from_numpy(ints)[None],
                                       torch.from_numpy(floats)[None])[0].numpy()
        assert np.array_equal(got, host), trial
        rows.append((logits, context[-1], ints, floats, host))
    stacked = [torch.from_numpy(np.stack(column)) for column in zip(*rows, strict=True)]
    got = graphs_module._processed(*stacked[:4])
    assert np.array_equal(got.numpy(), stacked[4].numpy())
    assert sum(not np.array_equal(r[0], r[4]) for r in rows) > 150  # (they do change)


@pytest.mark.parametrize("gemm", ["dequantize", "fused", "tuned"],
                         ids=["dequantize-gemm", "fused-gemm", "tuned"])
def test_triton_path_follows_cpu_torch(tmp_path, monkeypatch, gemm):
    """The GPU path (packed planes, triton mat-vec for <= 8 tokens, dequantized GEMM tiles
    above, or the fused dequantize-GEMM, triton norms/RoPE/GLUs), here in triton's
    interpreter unless there is a GPU, against CPU torch's f32 weights: a 12-token prompt
    and 2 decode steps. ``tuned``: every shape takes the tuner's second candidate (another
    mat-vec tile, for the gate+up+GLU launch too, the fused GEMM, the flash prompt
    attention)."""
    from edgellm.backends.torch import TorchBackend, kernels, tuning
    from edgellm.quants import Q
    from tests.test_torch_tuning import PickingTuner

    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton's interpreter was not enabled before triton was imported")
    pytest.importorskip("triton")
    monkeypatch.setenv("EDGELLM_FUSED_GEMM", {"dequantize": "0", "fused": "1"}.get(gemm, ""))
    fast = TorchBackend(graphs=False) if CUDA else TorchBackend(device="cpu", triton=True)
    # every shape's second candidate: the tuned paths end to end (the others not launched)
    tuner = PickingTuner(1, launch_all=False)
    if gemm == "tuned":
        monkeypatch.setattr(tuning, "tuner_for", lambda device: tuner)
    assert fast.fused_gemm == ({"dequantize": False, "fused": True}.get(gemm))
    outs = []
    for backend in (fast, TorchBackend(device="cpu", ggml_numerics=False)):
        net = _tiny_net(tmp_path, Q.Q4_0, backend, small=not CUDA)  # (the interpreter is slow)
        cache = net.make_cache(64)
        logits = net.forward(np.array([1, *range(40, 51)]), cache, all_logits=True)
        outs.append(np.concatenate([logits, _decode(net, cache, [60, 61])]))
    fast_out, cpu = outs
    assert np.array_equal(fast_out.argmax(-1), cpu.argmax(-1))
    # the prefill GEMM in f16 on a GPU and in the fused kernel (the interpreter too); the
    # same f32 arithmetic in the interpreter's dequantize + GEMM
    if gemm == "tuned":  # the three kinds of choice were made, each the second candidate
        second = {"gemm": lambda key: kernels.GEMM_CANDIDATES[1],
                  "attention": lambda key: kernels.FLASH_TILES[0],
                  "matvec": lambda key: kernels.matvec_candidates(int(key.split(":")[3]))[1],
                  "matvec_glu": lambda key: kernels.matvec_candidates(int(key.split(":")[3]))[1]}
        assert {key.split(":")[0] for key in tuner._choices} == set(second)
        for key, choice in tuner._choices.items():
            assert choice == second[key.split(":")[0]](key), key
    f16 = CUDA or gemm != "dequantize"
    error = np.abs(fast_out - cpu).max() / np.abs(cpu).max()
    if f16 and error > 2e-2:
        # measured on an H200: 0.0241. The f16 GEMM's ~1e-3 moves some activations across an
        # 8-bit rounding step (1/127 of their block's peak) in the next layer; llama.cpp's
        # prefill multiplies int8 blocks exactly (MMQ), which this backend does not yet
        pytest.xfail(f"f16 prefill GEMM: logits {error:.4f} of their peak from CPU torch's")
    assert error <= (2e-2 if f16 else 1e-3)


def _tiny_model(tmp_path):
    """A tiny random Llama with its tokenizer (``tests.tiny_models``), loaded on CPU torch
    with graphs.py's steps (``_graph_backend``): what an engine serves on a GPU."""
    from edgellm.backends.torch.graphs import StepGraphs
    from tests.tiny_models import TinyConfig, write_tiny_llama

    path = tmp_path / "tiny-engine.gguf"
    write_tiny_llama(path, TinyConfig(d_model=128, n_layers=2))
    model = edgellm.load(str(path), backend="torch")
    if model.backend.graphs is None:
        model.backend.graphs = StepGraphs(model.backend)
    return model


def test_engine_streams_a_lone_sequence_from_the_device(tmp_path, monkeypatch):
    """An engine's lone decoding sequence takes its tokens from Model.sampled_tokens (the
    argmax, or the chain drawn, on the device, one step queued ahead): the tokens the host
    path gives (its graphs off), greedy and seeded sampling alike. A request that joins
    mid-stream (the two then decode as one batch graph), a cancel and each ending close
    the stream, which takes the step run ahead back out of the cache (a slot's ids stay
    its cache's contents), and every request's tokens are still its tokens alone; so are
    the host generator's draws after a stream (a lost uniform would change the joined
    run's tokens). Penalties over the device's window stream too; over the whole history,
    and logprobs, sample on the host."""
    from edgellm.engine import Engine, Request
    from edgellm.sampling import SamplingParams

    model = _tiny_model(tmp_path)
    graphs = model.backend.graphs
    opened = []  # the params of each stream opened
    real = model.net.sampled_tokens

    def spy(token, cache, params, rng, *, evict=True, context=None):
        stream = real(token, cache, params, rng, evict=evict, context=context)
        opened.append((params, stream is not None))
        return stream

    monkeypatch.setattr(model.net, "sampled_tokens", spy)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(seed=5, top_k=40, max_tokens=14, ignore_eos=True)
    penalised = SamplingParams(seed=6, top_k=40, repetition_penalty=1.3, max_tokens=6,
                               ignore_eos=True)
    whole = SamplingParams(seed=6, top_k=40, repetition_penalty=1.3, penalty_last_n=-1,
                           max_tokens=6, ignore_eos=True)  # (the whole history: the host)
    prompts = [[1, 40, 41, 42, 43], [1, 50, 60, 70], [1, 99, 98], [1, 99, 98]]

    def serve(requests, use_graphs: bool, join_at=None, cancel_at=None):
        """Each request's (tokens, finish reason); ``join_at``: the second is submitted
        once the first has that many tokens; ``cancel_at``: the first is cancelled then."""
        model.backend.graphs = graphs if use_graphs else None
        engine = Engine(model, ctx=64, max_seqs=2, start=False, prefault=False)
        try:
            handles = [engine.submit(requests[0])]
            events = []
            while not all(h.done for h in handles) or len(handles) < len(requests):
                engine.step()
                made = len(handles[0]._seq.generated)
                if len(handles) < len(requests) and (join_at is None or made >= join_at
                                                     or handles[0].done):
                    handles.append(engine.submit(requests[len(handles)]))
                if cancel_at is not None and made >= cancel_at:
                    handles[0].cancel()
                for slot in engine._scheduler.slots:
                    if slot.seq is None or slot.seq.stream is None:  # (a stream: one ahead)
                        events.append(slot.cache.offset == len(slot.ids))
            assert all(events)
            return [(c.tokens, c.finish_reason) for c in (h.result(0) for h in handles)]
        finally:
            engine.close()
            model.backend.graphs = graphs

    alone = {}
    for params, prompt in zip((greedy, sampled, penalised, whole), prompts, strict=True):
        request = Request(prompt, params)
        alone[id(params)] = serve([request], False)[0]
        opened.clear()
        assert serve([request], True)[0] == alone[id(params)]
        assert opened[:1] == [(params, params is not whole)]
    assert alone[id(greedy)][0] != alone[id(sampled)][0][:10]

    # a second request joins the first's stream (they decode together: one graph of the
    # two, ``StepGraphs.queue_batch``); then one is cancelled mid-stream
    opened.clear()
    batched = []
    real_batch = graphs.queue_batch
    monkeypatch.setattr(graphs, "queue_batch", lambda *a, **k: batched.append(
        real_batch(*a, **k)) or batched[-1])
    joined = serve([Request(prompts[1], sampled), Request(prompts[0], greedy)], True,
                   join_at=5)
    assert joined == [alone[id(sampled)], alone[id(greedy)]]
    assert opened[0] == (sampled, True)
    assert sum(step is not None for step in batched) >= 3
    tokens, reason = serve([Request(prompts[1], sampled)], True, cancel_at=4)[0]
    assert reason == "cancelled" and tokens == alone[id(sampled)][0][:len(tokens)]
    logprobs = serve([Request(prompts[0], greedy, logprobs=2)], True)[0]
    assert logprobs == alone[id(greedy)]


def test_engine_draws_concurrent_sequences_tokens_on_the_device(tmp_path, monkeypatch):
    """Several requests decoding at once, and nothing else to do, take their tokens from
    one stream of the set (``Model.sampled_batch_tokens``: a batch step a token, each drawn
    on the device by its own chain, the next step queued before these are read): greedy
    and seeded sampled requests get the tokens each gets alone on the host path (graphs
    off), no decode step bringing logits to the host. A request joining the set and a
    cancel close the stream, which takes the step run ahead back out of every member's
    cache (a slot's ids stay its cache's contents, bar that step), and every request's
    tokens are still its own. A penalised request among them draws on the device too, bar
    one whose penalties look back over its whole history, which sends their steps to the
    host's samplers. A sequence whose logits go NaN ends in an error that says so; the
    others go on."""
    from edgellm.sampling import SamplingParams

    model = _tiny_model(tmp_path)
    graphs = model.backend.graphs
    opened, nan_at = [], []  # each stream opened (or None); the step whose 2nd row is NaN
    real_open = model.net.sampled_batch_tokens

    def spy_open(*args, **kwargs):
        stream = real_open(*args, **kwargs)
        opened.append(stream)
        if stream is None or not nan_at:
            return stream

        def faulty():
            try:
                for step, rows in enumerate(stream):
                    if nan_at and step == nan_at[0]:  # (once: not in the stream after)
                        rows[1] = (rows[1][0], float("nan"))
                        nan_at.clear()
                    yield rows
            finally:
                stream.close()  # (closing this closes the stream: it trims its step ahead)

        return faulty()

    monkeypatch.setattr(model.net, "sampled_batch_tokens", spy_open)
    to_host = []  # logits brought to the host (by the step's bucket size)
    real_reader = graphs._logits_reader
    monkeypatch.setattr(graphs, "_logits_reader", lambda b, want: to_host.extend(
        [b.size] if want else []) or real_reader(b, want))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(seed=5, top_k=40, max_tokens=12, ignore_eos=True)
    warm = SamplingParams(seed=9, temperature=1.3, top_k=60, top_p=0.8, min_p=0.0,
                          max_tokens=8, ignore_eos=True)
    penalised = SamplingParams(seed=6, top_k=40, repetition_penalty=1.3, max_tokens=6,
                               ignore_eos=True, logit_bias={50: 1.5})
    whole = SamplingParams(seed=6, top_k=40, repetition_penalty=1.3, penalty_last_n=-1,
                           max_tokens=6, ignore_eos=True)
    prompts = [[1, 40, 41, 42, 43], [1, 50, 60, 70], [1, 99, 98]]

    def serve(params, use_graphs: bool, first: int = 0, join_at=None, cancel_at=None):
        return _serve_set(model, graphs, prompts, params, use_graphs, 3, first, join_at,
                          cancel_at)

    chains = [greedy, sampled, warm]
    alone = [serve([p], False, first=i)[0] for i, p in enumerate(chains)]
    opened.clear()
    assert serve(chains, True) == alone
    assert len(opened) >= 2 and all(s is not None for s in opened)  # (the 3, then 2)
    assert to_host == [8, 8, 8]  # each prompt's (its bucket of 8), for its first token: no
    # decode step's (a lone one's come from its device stream)
    opened.clear()
    assert serve(chains, True, join_at=3) == alone  # (2 stream, the 3rd joins: 3 stream)
    assert len(opened) >= 3
    cancelled = serve(chains, True, cancel_at=4)
    assert cancelled[0][1] == "cancelled" and cancelled[1:] == alone[1:]
    assert cancelled[0][0] == alone[0][0][:len(cancelled[0][0])]
    opened.clear()
    mixed = serve([greedy, penalised], True)
    assert mixed == [alone[0], serve([penalised], False, first=1)[0]]
    assert opened and all(s is not None for s in opened)  # (drawn on the device)
    opened.clear()
    mixed = serve([greedy, whole], True)
    assert mixed == [alone[0], serve([whole], False, first=1)[0]]
    assert opened and all(s is None for s in opened)  # (the host's samplers)
    nan_at.append(2)
    faulted = serve(chains, True)
    assert faulted[0] == alone[0] and faulted[2] == alone[2]
    tokens, reason, error = faulted[1]
    assert reason == "error" and error.startswith("NonFiniteLogits: ")  # (a lone stream's)
    assert "NaN or infinite" in error
    assert tokens == alone[1][0][:len(tokens)]


def _serve_set(model, graphs, prompts: list, params: list, use_graphs: bool, max_seqs: int,
               first: int = 0, join_at: int | None = None, cancel_at: int | None = None):
    """Each request's (tokens, finish reason, error) from an engine of ``max_seqs`` slots
    stepped by hand: params[i] on prompts[first + i], on ``graphs`` or (``use_graphs``
    False) the eager host path; ``join_at``: the last is submitted once the first has
    that many tokens; ``cancel_at``: the first is cancelled then. Every step, each slot's
    cache holds its ids (a device stream's members: and the step run ahead)."""
    from edgellm.engine import Engine, Request

    model.backend.graphs = graphs if use_graphs else None
    engine = Engine(model, ctx=64, max_seqs=max_seqs, start=False, prefault=False)
    requests = [Request(prompt, p) for prompt, p in zip(prompts[first:], params,
                                                        strict=False)]
    try:
        handles = [engine.submit(r) for r in requests[:-1 if join_at else None]]
        while not all(h.done for h in handles) or len(handles) < len(requests):
            engine.step()
            made = len(handles[0]._seq.generated)
            if len(handles) < len(requests) and (made >= join_at or handles[0].done):
                handles.append(engine.submit(requests[-1]))
            if cancel_at is not None and made >= cancel_at:
                handles[0].cancel()
            for slot in engine._scheduler.slots:
                ahead = slot.seq is not None and slot.seq.stream is not None
                assert slot.cache.offset == len(slot.ids) + ahead
        return [(c.tokens, c.finish_reason, c.error) for c in (h.result(0) for h in handles)]
    finally:
        engine.close()
        model.backend.graphs = graphs


def test_batch_sets_hold_what_the_batch_graphs_kept_hold():
    """Decoding sequences take as few batch graphs as hold them, sizes within one of each
    other (9: 5 and 4, not 8 and a lone one), and no more than a model keeps (past 64 the
    rest are left out, to step alone: more sets would capture some again every step)."""
    from edgellm.backends.torch.graphs import MAX_BATCH_GRAPHS_PER_MODEL, batch_sets

    assert batch_sets(0) == [] and batch_sets(1) == [range(0, 1)]
    assert batch_sets(8) == [range(0, 8)]
    assert batch_sets(9) == [range(0, 5), range(5, 9)]
    assert [len(s) for s in batch_sets(17)] == [6, 6, 5]
    for n in range(2, 200):
        sets = batch_sets(n)
        held = [j for s in sets for j in s]
        assert held == list(range(min(n, 64)))  # in order, each once
        assert len(sets) <= MAX_BATCH_GRAPHS_PER_MODEL
        assert 2 <= min(map(len, sets)) and max(map(len, sets)) - min(map(len, sets)) <= 1
        assert max(map(len, sets)) <= 8


def test_engine_streams_more_sequences_than_a_batch_graph_holds(tmp_path, monkeypatch):
    """More sequences decoding at once than one batch graph holds (MAX_BATCH_SEQUENCES: 3
    here) stream from the device as the batch graphs of their sets (5: 3 and 2), every set's
    step queued before the step before is read: each request gets the tokens it gets alone
    on the host path, no decode step brings logits to the host, and a request joining (4
    sets of 2 and 2, then 3 and 2) closes and reopens the stream. Past the sets a model
    keeps (MAX_BATCH_GRAPHS_PER_MODEL: 1 here) the set does not stream: it samples on the
    host, with the same tokens."""
    from dataclasses import replace

    from edgellm.backends.torch import graphs as graphs_module
    from edgellm.sampling import SamplingParams

    monkeypatch.setattr(graphs_module, "MAX_BATCH_SEQUENCES", 3)
    model = _tiny_model(tmp_path)
    graphs = model.backend.graphs
    opened, sets_queued, to_host = [], [], []
    real_open, real_sets = model.net.sampled_batch_tokens, graphs._queue_sets
    wide = []  # (sequences, opened) of each set of more than 3 asked to stream

    def spy_open(batch, *a, **k):
        opened.append(real_open(batch, *a, **k))
        wide.extend([(len(batch), opened[-1] is not None)] if len(batch) > 3 else [])
        return opened[-1]

    monkeypatch.setattr(model.net, "sampled_batch_tokens", spy_open)

    partitions = set()  # how the sets split five caches, each time five stream

    def spy_sets(model_, sets, tokens, caches, *a, **k):
        steps = real_sets(model_, sets, tokens, caches, *a, **k)
        sets_queued.append([len(s) for s in sets] if steps is not None else None)
        if len(caches) == 5:
            partitions.add(frozenset(frozenset(id(caches[j]) for j in s) for s in sets))
        return steps

    monkeypatch.setattr(graphs, "_queue_sets", spy_sets)
    real_reader = graphs._logits_reader
    monkeypatch.setattr(graphs, "_logits_reader", lambda b, want: to_host.extend(
        [b.size] if want else []) or real_reader(b, want))
    chains = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(seed=5, top_k=40, max_tokens=11, ignore_eos=True),
              SamplingParams(seed=9, temperature=1.3, top_k=60, top_p=0.8, min_p=0.0,
                             max_tokens=8, ignore_eos=True),
              SamplingParams(seed=2, top_k=20, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    prompts = [[1, 40, 41, 42, 43], [1, 50, 60, 70], [1, 99, 98], [1, 7, 8, 9], [1, 33]]

    def serve(params, use_graphs: bool, first: int = 0, join_at=None):
        return _serve_set(model, graphs, prompts, params, use_graphs, 5, first, join_at)

    alone = [serve([p], False, first=i)[0] for i, p in enumerate(chains)]
    assert serve(chains, True) == alone
    assert opened[0] is not None and sets_queued[0] == [3, 2]
    assert [3, 2] in sets_queued[1:]  # (the step run ahead, from the device's draws)
    assert to_host == [8] * 5  # each prompt's first token; no decode step's logits
    opened.clear()
    sets_queued.clear()
    assert serve(chains, True, join_at=3) == alone
    assert sets_queued[0] == [2, 2] and [3, 2] in sets_queued
    assert len(opened) >= 2 and opened[0] is not None

    assert (5, True) in wide

    # 8 requests through the 5 slots: each that ends gives its slot to the next, which the
    # scheduler lists last; the slots' caches still fall into the same two sets (batch
    # graphs captured once), and each request gets its tokens alone
    churn = [replace(p, max_tokens=n) for p, n in zip(chains * 2, (4, 20, 8, 20, 20, 20, 20, 20),
                                                      strict=False)]
    prompts += [[1, 12, 13], [1, 77, 78, 79], [1, 5]]
    churned_alone = [serve([p], False, first=i)[0] for i, p in enumerate(churn)]
    partitions.clear()
    assert serve(churn, True) == churned_alone
    assert len(partitions) == 1
    del prompts[5:]
    monkeypatch.setattr(graphs_module, "MAX_BATCH_GRAPHS_PER_MODEL", 1)
    wide.clear()
    to_host.clear()
    assert serve(chains, True) == alone
    assert wide and not any(streamed for _, streamed in wide)  # (the host's samplers,
    assert len(to_host) > 5  # with the logits of their decode steps; 3 or fewer stream)
