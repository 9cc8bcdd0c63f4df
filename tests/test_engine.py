"""The batching engine on a real model: batched forward passes are bit-identical to single
ones, a request's output does not depend on its batch, prefix reuse, cancellation, queue
limits and errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import edgellm
from edgellm.backends import available_backends
from edgellm.engine import Engine, PromptTooLong, QueueFull, Request
from edgellm.generate import stream_generate
from edgellm.sampling import SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif("cpu" not in available_backends(), reason="no cpu backend")]

GREEDY = SamplingParams(temperature=0, max_tokens=12)
TEXTS = ["def fib(n):", "The capital of France is", "import numpy as np\nx = np.",
         "# quicksort in python\n", "SELECT name FROM", "class Stack:"]


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"])
def model(request, model_path):
    model_path(request.param)
    return edgellm.load(request.param, backend="cpu", threads=2)


@pytest.fixture(scope="module")
def qwen(model_path):
    model_path("qwen2.5-coder-0.5b-instruct")
    return edgellm.load("qwen2.5-coder-0.5b-instruct", backend="cpu", threads=2)


def alone(model, ids, params):
    return [r.token for r in stream_generate(model, ids, params)]


def test_forward_batch_is_bit_identical_to_forward(model):
    """Prefill chunks and decode tokens of several sequences in one pass give each sequence
    exactly the logits its own forward passes give (Gemma: window-ring layers too)."""
    prompts = [model.encode(t) for t in TEXTS[:3]]
    single = []
    for ids in prompts:
        cache = model.make_cache(128)
        first = model.net.forward(np.asarray(ids[:3]), cache)[-1]
        rest = model.net.forward(np.asarray(ids[3:]), cache)[-1] if len(ids) > 3 else first
        step = model.net.forward(np.asarray([int(rest.argmax())]), cache)[-1]
        single.append((first, rest, step))
    caches = [model.make_cache(128) for _ in prompts]
    firsts = model.net.forward_batch([(ids[:3], c) for ids, c in zip(prompts, caches, strict=True)])
    long_ones = [j for j, ids in enumerate(prompts) if len(ids) > 3]
    rests = model.net.forward_batch([(prompts[j][3:], caches[j]) for j in long_ones])
    rest = {j: r for j, r in zip(long_ones, rests, strict=True)}
    for j in range(len(prompts)):
        rest.setdefault(j, firsts[j])
    # a decode step of all three, with logits asked for only two of them
    steps = model.net.forward_batch(
        [(np.asarray([int(rest[j].argmax())]), caches[j]) for j in range(len(prompts))],
        want_logits=[True, False, True])
    assert steps[1] is None
    for j, (first, r, step) in enumerate(single):
        assert np.array_equal(firsts[j], first)
        assert np.array_equal(rest[j], r)
        if j != 1:
            assert np.array_equal(steps[j], step)


def test_concurrent_greedy_equals_alone(model):
    prompts = [model.encode(t) for t in TEXTS]
    want = [alone(model, ids, GREEDY) for ids in prompts]
    with Engine(model, ctx=256, max_seqs=4, prefill_chunk=7) as engine:  # queueing + chunks
        handles = [engine.submit(Request(ids, GREEDY)) for ids in prompts]
        got = [h.result(timeout=300) for h in handles]
    for completion, tokens in zip(got, want, strict=True):
        assert completion.tokens == tokens
        assert completion.finish_reason in ("length", "stop")
        assert completion.usage.completion_tokens == len(tokens)


def test_seeded_sampling_repeats_whatever_the_batch(qwen):
    wide = {"temperature": 1.2, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 10}
    params = SamplingParams(seed=11, **wide)
    ids = qwen.encode("Once upon a time")
    with Engine(qwen, ctx=256, max_seqs=4) as engine:
        solo = engine.submit(Request(ids, params)).result(timeout=120)
        handles = [engine.submit(Request(ids, params))]
        handles += [engine.submit(Request(qwen.encode(t), params)) for t in TEXTS[:3]]
        batched = handles[0].result(timeout=120)
        other_seed = engine.submit(Request(ids, SamplingParams(seed=12, **wide))).result()
    assert solo.tokens == batched.tokens
    assert solo.tokens == alone(qwen, ids, params)  # the same sampler as stream_generate
    assert other_seed.tokens != solo.tokens


def test_a_burst_of_requests_prefills_in_one_step(qwen, monkeypatch):
    """Requests that reach an idle engine together start in the same step: their prompts
    prefill in one pass and they decode in step (no stream a step or two ahead)."""
    import edgellm.engine as engine_module

    monkeypatch.setattr(engine_module, "COALESCE_MAX_S", 5.0)  # a slow CI box stays in time
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with Engine(qwen, ctx=256, max_seqs=4, coalesce_s=0.5) as engine:
        handles = []
        for t in TEXTS[:4]:  # arriving 50 ms apart, as a server parses them one by one
            handles.append(engine.submit(Request(qwen.encode(t), params)))
            time.sleep(0.05)
        done = [h.result(timeout=120) for h in handles]
        steps = engine.stats().steps
    assert all(c.usage.completion_tokens == 4 for c in done)
    assert steps == 4  # one prefill step that samples every first token, three decode steps
    with pytest.raises(ValueError, match="coalesce_s"):
        Engine(qwen, ctx=64, max_seqs=1, coalesce_s=-1, start=False)


def test_prefix_reuse_prefills_only_the_new_part(qwen):
    turn1 = qwen.encode(qwen.apply_chat_template([{"role": "user", "content": "Hi, who are you?"}]))
    with Engine(qwen, ctx=512, max_seqs=2) as engine:
        first = engine.submit(Request(turn1, GREEDY)).result(timeout=120)
        turn2 = qwen.encode(qwen.apply_chat_template([
            {"role": "user", "content": "Hi, who are you?"},
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "And what can you do?"}]))
        second = engine.submit(Request(turn2, GREEDY)).result(timeout=120)
        assert engine.stats().cached_tokens == second.usage.cached_tokens
    assert second.usage.cached_tokens >= len(turn1)  # the first turn was not prefilled again
    assert second.tokens == alone(qwen, turn2, GREEDY)  # and the reply is unchanged by it


def test_cancel_frees_the_slot_within_one_step(qwen):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    with Engine(qwen, ctx=512, max_seqs=2) as engine:
        handle = engine.submit(Request(qwen.encode(TEXTS[0]), params))
        other = engine.submit(Request(qwen.encode(TEXTS[1]), GREEDY))
        seen = 0
        for event in handle:
            seen += 1
            if seen == 3:
                handle.cancel()
            if event.done:
                break
        assert event.finish_reason == "cancelled"
        assert seen <= 5  # at most one more step ran for it after the cancel
        assert other.result(timeout=60).finish_reason in ("length", "stop")
        stats = engine.stats()
        assert stats.cancel_steps_max <= 1
        assert stats.slots_free == 2 and stats.slots_active == 0


def test_queue_limit_and_budget_errors(qwen):
    engine = Engine(qwen, ctx=64, max_seqs=1, max_queue=1, start=False)
    try:
        ids = qwen.encode(TEXTS[0])
        engine.submit(Request(ids, GREEDY))  # takes the slot
        engine.submit(Request(ids, GREEDY))  # waits
        with pytest.raises(QueueFull):
            engine.submit(Request(ids, GREEDY))
        with pytest.raises(PromptTooLong):
            engine.submit(Request(list(range(64)), GREEDY))
        with pytest.raises(ValueError):
            engine.submit(Request([qwen.args.vocab_size + 5], GREEDY))
    finally:
        engine.close()
    with pytest.raises(ValueError, match="KV budget"):
        Engine(qwen, ctx=4096, kv_budget=1 << 20)


def test_stop_strings_logprobs_and_zero_tokens(qwen):
    ids = qwen.encode("1, 2, 3, 4, 5,")
    with Engine(qwen, ctx=256, max_seqs=2) as engine:
        stopped = engine.submit(Request(ids, SamplingParams(temperature=0, max_tokens=30,
                                                            stop=(" 8",)))).result()
        scored = engine.submit(Request(ids, GREEDY, logprobs=3)).result()
        empty = engine.submit(Request(ids, SamplingParams(max_tokens=0))).result()
    assert stopped.finish_reason == "stop" and " 8" not in stopped.text
    assert stopped.text.startswith(" 6, 7,")
    assert len(scored.logprobs) == len(scored.tokens)
    for lp, token in zip(scored.logprobs, scored.tokens, strict=True):
        assert lp.token == token and lp.logprob <= 0
        assert [t for t, _ in lp.top][0] == token  # greedy: the top token is the one taken
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert empty.tokens == [] and empty.finish_reason == "length"


def test_a_failed_pass_ends_its_requests_and_the_engine_keeps_serving(qwen, monkeypatch):
    engine = Engine(qwen, ctx=256, max_seqs=2)
    real = qwen.net.forward_batch
    calls = {"n": 0}
    lock = threading.Lock()

    def flaky(batch, want=None):
        with lock:
            calls["n"] += 1
            if calls["n"] == 2:
                raise MemoryError("simulated")
        return real(batch, want)

    monkeypatch.setattr(qwen.net, "forward_batch", flaky)
    try:
        failed = engine.submit(Request(qwen.encode(TEXTS[0]), GREEDY)).result(timeout=60)
        assert failed.finish_reason == "error" and "simulated" in failed.error
        ok = engine.submit(Request(qwen.encode(TEXTS[0]), GREEDY)).result(timeout=60)
        assert ok.finish_reason == "length"
        assert ok.tokens == alone(qwen, qwen.encode(TEXTS[0]), GREEDY)
    finally:
        engine.close()
