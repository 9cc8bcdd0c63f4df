"""The Python API across threads: one Model shared by many threads (requests go through its
engine and each gets its solo output), cancellation from another thread (a reply within one
token, a long prompt within one slice), the token and load-progress callbacks, and close()
giving the memory back."""

from __future__ import annotations

import threading
import time

import pytest

from edgellm.api import load
from edgellm.sampling import SamplingParams

pytestmark = pytest.mark.slow

QWEN = "qwen2.5-coder-0.5b-instruct"
GREEDY = SamplingParams(temperature=0, max_tokens=16)
QUESTIONS = ["Write a haiku about the sea.", "What is 17 times 3?",
             "Write a C function that reverses a string.",
             "Name the planets of the solar system."]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def qwen(model_path):
    model = load(model_path(QWEN), context_length=2560)
    model.start_engine(max_seqs=4)
    yield model
    model.close()


def test_four_threads_on_one_model_get_their_solo_outputs(qwen):
    solo = [qwen.complete_chat(chat(q), GREEDY).tokens for q in QUESTIONS]
    together: list[list[int] | None] = [None] * 4
    most_active = 0

    def worker(i: int) -> None:
        together[i] = qwen.complete_chat(chat(QUESTIONS[i]), GREEDY).tokens

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        most_active = max(most_active, qwen.engine.stats().slots_active)
        time.sleep(0.001)
    assert together == solo and all(solo)
    assert most_active >= 2  # decoded together, not one after another


def test_cancel_from_another_thread_stops_within_one_token(qwen):
    before = qwen.complete_chat(chat(QUESTIONS[1]), GREEDY).tokens
    handle = qwen.submit_chat(chat("Write a long story about a lighthouse keeper."),
                              SamplingParams(temperature=0, max_tokens=400))
    third_token = threading.Event()
    canceller = threading.Thread(target=lambda: third_token.wait() and handle.cancel())
    canceller.start()
    events = []
    for event in handle:
        events.append(event)
        if len(events) == 3:
            third_token.set()
    canceller.join()
    assert events[-1].finish_reason == "cancelled"
    assert len(events) < 100
    assert qwen.engine.stats().cancel_steps_max <= 1  # at most the step in flight ran
    assert qwen.complete_chat(chat(QUESTIONS[1]), GREEDY).tokens == before  # still usable


def test_cancel_stops_a_long_prefill_within_one_slice(qwen):
    before = qwen.complete_chat(chat(QUESTIONS[1]), GREEDY).tokens
    text = "Summarize this: " + " ".join("lamp." if i % 10 == 9 else "lamp" for i in range(2000))
    prompt = qwen.encode(qwen.apply_chat_template(chat(text)))
    assert len(prompt) >= 2000
    start = qwen.engine.stats().prompt_tokens
    handle = qwen.submit(prompt, SamplingParams(temperature=0, max_tokens=4))
    while qwen.engine.stats().prompt_tokens == start:  # the first slice has run
        time.sleep(0.002)
    at_cancel = qwen.engine.stats().prompt_tokens - start
    handle.cancel()
    events = list(handle)
    ran = qwen.engine.stats().prompt_tokens - start
    assert [e.finish_reason for e in events] == ["cancelled"]
    assert qwen.engine.stats().cancel_steps_max <= 1
    assert ran - at_cancel <= 512 and ran < len(prompt)
    assert qwen.complete_chat(chat(QUESTIONS[1]), GREEDY).tokens == before


def test_token_callback_sees_every_event_in_order(qwen):
    seen = []
    reply = qwen.complete("def fibonacci(n):", GREEDY, on_token=seen.append)
    assert [e.token for e in seen if e.token is not None] == reply.tokens
    assert "".join(e.text for e in seen) == reply.text
    assert seen[-1].finish_reason == reply.finish_reason == "length"

    def stop_at_two(event):
        if len(stopped) == 2:
            raise KeyboardInterrupt  # the caller stops: the request is cancelled
        stopped.append(event)

    stopped: list = []
    with pytest.raises(KeyboardInterrupt):
        qwen.complete("def fibonacci(n):", SamplingParams(temperature=0, max_tokens=200),
                      on_token=stop_at_two)
    assert qwen.engine.wait_idle(30)  # the cancelled request left its slot


def test_load_progress_and_close(model_path):
    steps: list[tuple[float, str]] = []
    with load(model_path("gemma-3-270m"), progress=lambda f, s: steps.append((f, s))) as model:
        assert model.complete("Hello", SamplingParams(temperature=0, max_tokens=2)).tokens
    fractions = [f for f, _ in steps]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert {"file", "weights", "tokenizer", "done"} <= {s for _, s in steps}
    assert model.closed and model.net is None
    with pytest.raises(ValueError, match="closed"):
        model.submit("Hello")

    def refuse(fraction: float, stage: str) -> None:
        if stage == "weights":
            raise InterruptedError("stop loading")

    with pytest.raises(InterruptedError):
        load(model_path("gemma-3-270m"), progress=refuse)


def test_stream_generate_cancel_stops_a_long_prefill_within_one_slice(qwen):
    from edgellm.generate import generate, stream_generate

    before = generate(qwen, "def fibonacci(n):", GREEDY)
    text = "Summarize this: " + " ".join("lamp." if i % 10 == 9 else "lamp" for i in range(2000))
    ids = qwen.encode(text)
    assert len(ids) >= 2000
    cache = qwen.make_cache(2560)
    cancel, started = threading.Event(), threading.Event()
    slices: list[bool] = []  # per forward call: was the cancel already set when it began
    forward = qwen.net.forward

    def counting(tokens, *args, **kwargs):
        slices.append(cancel.is_set())
        started.set()
        return forward(tokens, *args, **kwargs)

    canceller = threading.Thread(target=lambda: started.wait() and cancel.set())
    qwen.net.forward = counting  # this instance only, for this test
    try:
        canceller.start()
        responses = list(stream_generate(qwen, ids, GREEDY, cache=cache, cancel=cancel))
    finally:
        del qwen.net.forward
        canceller.join()
    assert [r.finish_reason for r in responses] == ["cancelled"]
    assert sum(slices) <= 1 and len(slices) < -(-len(ids) // 512)  # stopped within one slice
    assert cache.offset == 0  # the cache is as it was before the prompt
    assert generate(qwen, "def fibonacci(n):", GREEDY) == before
