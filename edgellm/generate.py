"""Generators in layers: ``generate_step`` (token ids) -> ``stream_generate`` (response
records with text and timings) -> ``generate`` (a string). No flag changes a return type.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from edgellm.cache import ContextOverflow, KVCache
from edgellm.sampling import SamplingParams, logits_processor, make_sampler

if TYPE_CHECKING:
    from edgellm.api import Model


def generate_step(
    prompt: Sequence[int],
    net,
    cache: KVCache,
    params: SamplingParams,
    history: Sequence[int] = (),
) -> Iterator[tuple[int, np.ndarray]]:
    """Prefill ``prompt`` (appended to what ``cache`` holds) in one pass, then decode.

    Yields (token, logits) for each new token, for ever: the caller decides when to stop.
    ``history`` is the context already in the cache, for the repetition penalties.
    """
    if len(prompt) == 0:
        raise ValueError("empty prompt: give at least one token")
    process = logits_processor(params)
    sample = make_sampler(params)
    context = list(history) + list(prompt)
    logits = net.forward(np.asarray(prompt), cache)[-1]
    while True:
        logits = process(logits, context)
        token = sample(logits)
        yield token, logits
        context.append(token)
        logits = net.forward(np.asarray([token]), cache)[-1]


@dataclass
class GenerationResponse:
    """One streamed piece of a reply, with running statistics."""

    text: str  # new text since the previous response (may be "")
    token: int | None
    finish_reason: str | None = None  # "stop" | "length" | "context" | None while running
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    ttft_s: float = 0.0  # time to first token
    extra: dict = field(default_factory=dict)


class StopMatcher:
    """Holds back text that might be the start of a stop string; finds complete ones."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was hit)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, False
        hits = [self.pending.find(s) for s in self.stops if s in self.pending]
        if hits:
            out = self.pending[: min(hits)]
            self.pending = ""
            return out, True
        hold = max((self._overlap(s) for s in self.stops), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def _overlap(self, stop: str) -> int:
        """Longest suffix of pending that is a prefix of stop."""
        for k in range(min(len(stop) - 1, len(self.pending)), 0, -1):
            if self.pending.endswith(stop[:k]):
                return k
        return 0

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def stream_generate(
    model: Model,
    prompt: str | Sequence[int],
    params: SamplingParams | None = None,
    cache: KVCache | None = None,
    history: Sequence[int] = (),
) -> Iterator[GenerationResponse]:
    """Stream a reply to ``prompt`` (text, tokenized with special tokens parsed, or ids).

    With ``cache`` given, the prompt is appended to what it holds (prompt caching across chat
    turns); otherwise a fresh cache is made. The last response has a ``finish_reason``.
    """
    params = params or SamplingParams()
    ids = model.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if cache is None:
        cache = model.make_cache()
    if cache.offset + len(ids) > cache.max_tokens:
        raise ContextOverflow(f"prompt of {len(ids)} tokens does not fit the context "
                              f"({cache.max_tokens - cache.offset} of {cache.max_tokens} free): "
                              "shorten it or raise --ctx")
    detok = model.tokenizer.detokenizer()
    stops = StopMatcher(params.stop)
    eos = model.tokenizer.eos_ids
    start = time.perf_counter()
    first_at = start
    n = 0
    finish = None
    steps = generate_step(ids, model.net, cache, params, history)

    def response(text: str, token: int | None, reason: str | None) -> GenerationResponse:
        now = time.perf_counter()
        gen_time = now - first_at
        return GenerationResponse(
            text, token, reason, len(ids), n,
            prompt_tps=len(ids) / max(first_at - start, 1e-9),
            generation_tps=(n - 1) / gen_time if n > 1 and gen_time > 0 else 0.0,
            ttft_s=first_at - start,
        )

    if params.max_tokens == 0:
        yield response("", None, "length")
        return
    while finish is None:
        try:
            token, _ = next(steps)
        except ContextOverflow:
            yield response(stops.flush() + detok.flush(), None, "context")
            return
        n += 1
        if n == 1:
            first_at = time.perf_counter()
        if token in eos and not params.ignore_eos:
            yield response(stops.flush() + detok.flush(), token, "stop")
            return
        text, hit = stops.feed(detok.add(token))
        if hit:
            finish = "stop"
        elif n >= params.max_tokens:
            finish = "length"
            text += stops.flush() + detok.flush()
        elif cache.offset >= cache.max_tokens:
            finish = "context"
            text += stops.flush() + detok.flush()
        yield response(text, token, finish)


def generate(model: Model, prompt: str | Sequence[int], params: SamplingParams | None = None,
             **kwargs) -> str:
    """The whole reply as one string."""
    return "".join(r.text for r in stream_generate(model, prompt, params, **kwargs))
