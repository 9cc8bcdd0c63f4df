"""ChatSession on a fake model: prompt-cache reuse, regen, cut replies, save/load, budget.

The fake net keeps the actual tokens in its cache and picks each next token from all of them,
so any mismatch between what the session thinks the cache holds and what it holds shows up
as a different reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from edgellm.cache import CacheConfig, ContextOverflow
from edgellm.chat import ChatSession, Notice, render_chat
from edgellm.generate import GenerationResponse
from edgellm.sampling import SamplingParams

VOCAB = 260
EOS = 256


class FakeCache:
    """Holds the token ids themselves, with the KVCache surface the session uses."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.nbytes = 0
        self.evicted = 0  # never rotates
        self.config = CacheConfig(policy="truncate-turns")

    @property
    def offset(self) -> int:
        return len(self.tokens)

    def fits(self, n: int) -> bool:
        return self.offset + n <= self.max_tokens

    def max_trim(self) -> int:
        return self.offset

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        del self.tokens[self.offset - n:]
        return n


@dataclass
class FakeNet:
    """Next token = a letter chosen by a hash of every token in the cache."""

    calls: list[int] = field(default_factory=list)  # batch size of each forward pass
    interrupt_at_call: int | None = None

    def forward(self, tokens: np.ndarray, cache: FakeCache) -> np.ndarray:
        self.calls.append(len(tokens))
        if len(self.calls) == self.interrupt_at_call:
            cache.tokens.extend(tokens.tolist()[:1])  # half-written, like a cut forward pass
            raise KeyboardInterrupt
        if cache.offset + len(tokens) > cache.max_tokens:
            raise ContextOverflow("full")
        cache.tokens.extend(int(t) for t in tokens)
        logits = np.zeros((len(tokens), VOCAB), dtype=np.float32)
        logits[-1, 97 + hash(tuple(cache.tokens)) % 26] = 5.0
        return logits


class FakeDetokenizer:
    def add(self, token: int) -> str:
        return chr(token)

    def flush(self) -> str:
        return ""


class FakeTokenizer:
    eos_ids = {EOS}

    def detokenizer(self) -> FakeDetokenizer:
        return FakeDetokenizer()


class FakeModel:
    """Characters are tokens; the ChatML fallback template."""

    name = "fake"
    path = "fake.gguf"
    backend = type("FakeBackend", (), {"name": "fake"})()

    def __init__(self, context: int = 4096):
        self.net = FakeNet()
        self.tokenizer = FakeTokenizer()
        self.context = context
        self.caches: list[FakeCache] = []

    def make_cache(self, max_tokens: int | None = None, policy: str = "error") -> FakeCache:
        self.caches.append(FakeCache(max_tokens or self.context))
        return self.caches[-1]

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def apply_chat_template(self, messages) -> str:
        return render_chat(None, messages)


GREEDY = SamplingParams(temperature=0, max_tokens=8)


def reply_text(events) -> str:
    return "".join(e.text for e in events if isinstance(e, GenerationResponse))


def rendered_ids(session: ChatSession) -> list[int]:
    return session.model.encode(session.model.apply_chat_template(session.conversation()))


def test_second_turn_prefills_only_the_new_tokens():
    model = FakeModel()
    session = ChatSession(model, GREEDY, system="be brief")
    first = reply_text(session.send("hello"))
    assert len(first) == 8 and session.messages[-1] == {"role": "assistant", "content": first}
    held_after_first = session.kv_used  # prompt + reply, less the last sampled token
    model.net.calls.clear()
    reply_text(session.send("and again"))
    stats = session.last_stats
    full = rendered_ids(session)  # the whole conversation, second reply included
    prompt = len(model.encode(model.apply_chat_template(session.conversation()[:-1])))
    assert stats.reused_tokens == held_after_first  # the first turn is not prefilled again
    assert stats.prompt_tokens == prompt - held_after_first
    assert model.net.calls[0] == stats.prompt_tokens  # one prefill pass of the new part only
    assert model.caches[-1].tokens == full[: model.caches[-1].offset]


def test_cache_matches_a_fresh_session_after_many_turns():
    """Reusing the cache gives the same replies as prefilling everything anew."""
    model = FakeModel()
    warm = ChatSession(model, GREEDY)
    for text in ("one", "two", "three"):
        reply_text(warm.send(text))
    cold = ChatSession(FakeModel(), GREEDY)
    cold.messages = [dict(m) for m in warm.messages[:-1]]
    assert reply_text(cold.regen()) == warm.messages[-1]["content"]


def test_regen_is_deterministic_at_temperature_zero_and_prefills_one_token():
    model = FakeModel()
    session = ChatSession(model, SamplingParams(temperature=0.9, max_tokens=8, seed=None))
    reply_text(session.send("hi"))
    session.set_params(temperature=0)
    a = reply_text(session.regen())
    b = reply_text(session.regen())
    assert a == b
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.last_stats.prompt_tokens == 1


def test_regen_without_a_message_is_an_error():
    with pytest.raises(ValueError, match="nothing to regenerate"):
        ChatSession(FakeModel(), GREEDY).regen()


def test_closing_the_stream_keeps_the_partial_reply_marked_cut():
    model = FakeModel()
    session = ChatSession(model, GREEDY)
    events = session.send("tell me a story")
    pieces = [next(events).text for _ in range(3)]
    events.close()
    assert session.messages[-1] == {"role": "assistant", "content": "".join(pieces), "cut": True}
    assert session.last_stats.finish_reason == "cut"
    cache = model.caches[-1]
    assert cache.tokens == (rendered_ids(session)[: cache.offset])  # still consistent
    assert len(reply_text(session.send("go on"))) == 8


def test_an_interrupt_inside_a_forward_pass_resets_the_cache():
    model = FakeModel()
    session = ChatSession(model, GREEDY)
    reply_text(session.send("hi"))
    model.net.interrupt_at_call = len(model.net.calls) + 3
    with pytest.raises(KeyboardInterrupt):
        reply_text(session.send("more"))
    assert session.messages[-1]["cut"] is True
    assert session.cache is model.caches[-1] and session.cache.offset == 0
    reply_text(session.send("again"))
    assert session.last_stats.reused_tokens == 0


def test_save_and_load_round_trip(tmp_path):
    session = ChatSession(FakeModel(), SamplingParams(temperature=0.3, top_k=7, seed=5,
                                                      stop=("END",), max_tokens=8),
                          system="you are terse")
    reply_text(session.send("hello"))
    events = session.send("cut me")
    next(events)
    events.close()
    path = session.save(tmp_path / "chat.json")
    restored = ChatSession(FakeModel(), GREEDY)
    restored.load(path)
    assert restored.messages == session.messages
    assert restored.messages[-1]["cut"] is True
    assert restored.params == session.params
    assert restored.system == "you are terse"


def test_load_rejects_files_that_are_not_chats(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "wizard", "content": "x"}]}')
    with pytest.raises(ValueError, match="bad message"):
        ChatSession(FakeModel(), GREEDY).load(bad)
    bad.write_text("not json")
    with pytest.raises(ValueError, match="not JSON"):
        ChatSession(FakeModel(), GREEDY).load(bad)


def test_truncate_turns_drops_oldest_pairs_and_keeps_the_system_prompt():
    model = FakeModel(context=160)
    session = ChatSession(model, GREEDY, system="sys")
    notices: list[Notice] = []
    for i in range(6):
        events = list(session.send(f"question number {i}"))
        notices += [e for e in events if isinstance(e, Notice)]
    assert notices and all(n.kind == "truncated" for n in notices)
    assert notices[0].dropped[0]["content"] == "question number 0"
    assert "question number 0" in notices[0].message
    assert session.conversation()[0] == {"role": "system", "content": "sys"}
    assert session.messages[-2]["content"] == "question number 5"
    assert session.kv_used <= 160


def test_error_policy_refuses_instead_of_dropping():
    session = ChatSession(FakeModel(context=60), GREEDY, policy="error")
    with pytest.raises(ContextOverflow, match="raise --ctx"):
        reply_text(session.send("x" * 80))


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="truncate-turns"):
        ChatSession(FakeModel(), GREEDY, policy="forget")
