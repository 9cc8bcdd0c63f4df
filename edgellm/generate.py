"""Generators in layers: ``generate_step`` (token ids) -> ``stream_generate`` (response
records with text and timings) -> ``generate`` (a string). No flag changes a return type.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from edgellm.cache import ContextOverflow, KVCache, context_event
from edgellm.sampling import SamplingParams, draw, logits_processor, make_sampler, probabilities
from edgellm.speculative import (
    Drafter,
    DraftLengthController,
    SpeculativeStats,
    make_drafter,
    verify,
)

if TYPE_CHECKING:
    from edgellm.api import Model


class NonFiniteLogits(ValueError):
    """The model's output went NaN or infinite: a corrupt weight file or a numeric fault."""


def non_finite(step: int) -> NonFiniteLogits:
    """The error for logits that went NaN or infinite at generated token ``step``."""
    return NonFiniteLogits(
        f"the model's logits became NaN or infinite at generated token {step}: its "
        "weights are likely corrupt (re-download or re-convert the file), or try "
        "--backend numpy to rule out a kernel fault")


def checked_logits(logits: np.ndarray, step: int) -> np.ndarray:
    """``logits`` unchanged if all finite; else a ``NonFiniteLogits`` that stops generation
    (sampling from NaN picks token 0 or garbage, silently). ~20 us for a 150k vocab."""
    if not np.isfinite(logits).all():
        raise non_finite(step)
    return logits


class Cancelled(Exception):
    """A generation's ``cancel`` event was set while its prompt was being processed."""


def prefill(net, prompt: Sequence[int], cache: KVCache,
            cancel: threading.Event | None = None) -> np.ndarray:
    """Run ``prompt`` into ``cache``; the last token's logits (vocab,).

    With ``cancel``, a long prompt runs in the model's own slices of PREFILL_CHUNK tokens
    (the same arithmetic as one call) and a set event stops it between two slices: the cache
    is trimmed back to where it was (reset if a ring cannot roll back that far) and
    ``Cancelled`` is raised, so the event is honoured within one slice.
    """
    from edgellm.models.llama import PREFILL_CHUNK  # here: `import edgellm` stays light

    if cancel is None or len(prompt) <= PREFILL_CHUNK:
        return net.forward(np.asarray(prompt), cache)[-1]
    if not cache.fits(len(prompt)):
        cache.begin(len(prompt))  # ContextOverflow before any slice is written
    start = cache.offset
    for i in range(0, len(prompt), PREFILL_CHUNK):
        if cancel.is_set():
            written = cache.offset - start
            if written <= cache.max_trim():
                cache.trim(written)
            else:
                cache.reset()
            raise Cancelled()
        logits = net.forward(np.asarray(prompt[i:i + PREFILL_CHUNK]), cache)
    return logits[-1]


def generate_step(
    prompt: Sequence[int],
    net,
    cache: KVCache,
    params: SamplingParams,
    history: Sequence[int] = (),
    cancel: threading.Event | None = None,
) -> Iterator[tuple[int, np.ndarray | None]]:
    """Prefill ``prompt`` (appended to what ``cache`` holds) in one pass, then decode.

    Yields (token, logits) for each new token, for ever: the caller decides when to stop,
    and closes the generator (a device backend's greedy steps run one token ahead, which
    closing takes back out of the cache). Where the token is the logits' argmax
    (``params.argmax_only``) it comes from ``net.greedy_tokens``, and where a device
    backend draws the chain itself (``net.sampled_tokens``: top-k, top-p, min-p and
    temperature, one uniform a token from the same generator) the tokens after the first
    come from it; the logits after the first are then None: they stay on the device.
    ``history`` is the context already in the cache, for the repetition penalties.
    ``cancel``: see ``prefill`` (between tokens, the caller checks it).
    """
    if len(prompt) == 0:
        raise ValueError("empty prompt: give at least one token")
    process = logits_processor(params)
    rng = np.random.default_rng(params.seed)
    sample = make_sampler(params, rng)
    context = list(history) + list(prompt)
    logits = checked_logits(prefill(net, prompt, cache, cancel), 0)
    if params.argmax_only and hasattr(net, "greedy_tokens"):
        token = int(np.argmax(logits))
        yield token, logits
        with closing(net.greedy_tokens(token, cache)) as tokens:
            for token in tokens:
                yield token, None
        return
    on_device = None
    while True:
        logits = process(logits, context)
        token = sample(logits)
        yield token, logits
        context.append(token)
        if on_device is None and hasattr(net, "sampled_tokens"):
            on_device = net.sampled_tokens(token, cache, params, rng, context=context) or False
            if on_device:
                with closing(on_device) as tokens:
                    for token in tokens:
                        yield token, None
                return
        logits = checked_logits(net.forward(np.asarray([token]), cache)[-1],
                                len(context) - len(history) - len(prompt))


class SpeculativeToken(NamedTuple):
    """One token of ``speculative_generate_step``: generate_step's pair plus its origin."""

    token: int
    logits: np.ndarray  # (vocab,) the target's processed logits at this position
    from_draft: bool  # proposed by the drafter and accepted (False: the target's own token)


def speculative_generate_step(
    prompt: Sequence[int],
    net,
    cache: KVCache,
    params: SamplingParams,
    history: Sequence[int] = (),
    *,
    drafter: Drafter,
    controller: DraftLengthController | None = None,
    stats: SpeculativeStats | None = None,
) -> Iterator[SpeculativeToken]:
    """``generate_step`` with drafted tokens verified k at a time in one target pass.

    Same contract as ``generate_step`` (yields for ever; the output is the target's: identical
    tokens at temperature 0, the same distribution when sampling). ``drafter`` proposes tokens
    (``edgellm.speculative.make_drafter``); ``controller`` picks how many per round (adaptive
    by default); ``stats`` is updated in place. When the consumer stops, the caches are rolled
    back so that, as with generate_step, they hold the context before the last yielded token.
    """
    if len(prompt) == 0:
        raise ValueError("empty prompt: give at least one token")
    process = logits_processor(params)
    rng = np.random.default_rng(params.seed)
    controller = controller or DraftLengthController()
    stats = stats if stats is not None else SpeculativeStats()
    context = list(history) + list(prompt)
    shift = cache.offset - len(history)  # cache slots before context[0] (normally 0)
    try:
        logits = process(checked_logits(net.forward(np.asarray(prompt), cache)[-1], 0), context)
        token = (int(np.argmax(logits)) if params.greedy
                 else draw(probabilities(logits, params), rng))
        context.append(token)
        stats.tokens += 1
        drafter.prefill(context)  # prompt processing of the draft: before the first token
        yield SpeculativeToken(token, logits, False)
        while True:
            k = controller.next_length()
            room = cache.max_tokens - cache.offset  # a plain cache refuses past max_tokens
            if room > 0:  # keep the round below the last slot, so "context" ends as plain
                k = max(0, min(k, room - 2))
            seconds_before, steps_before = drafter.seconds, getattr(drafter, "steps", 0)
            draft = drafter.propose(context, k, params, process, rng)
            draft_seconds = drafter.seconds - seconds_before
            draft_steps = getattr(drafter, "steps", 0) - steps_before
            feed = [context[-1], *draft.tokens]  # (k+1,): the last token, then the draft
            start = time.perf_counter()
            target_logits = checked_logits(net.forward(np.asarray(feed), cache, all_logits=True),
                                           stats.tokens)  # (k+1, V)
            target_seconds = time.perf_counter() - start
            tokens, token_logits = verify(draft, target_logits, context, params, process, rng)
            accepted = len(tokens) - 1
            cache.trim(len(draft.tokens) - accepted)  # drop the rejected drafts' slots
            drafter.accept(len(context) + accepted)
            controller.record(k, len(draft.tokens), accepted, draft_seconds, draft_steps,
                              len(feed), target_seconds)
            stats.target_passes += 1
            stats.draft_passes = getattr(drafter, "passes", 0)
            stats.draft_lengths.append(len(draft.tokens))
            if draft.tokens:
                stats.rounds += 1
                stats.drafted += len(draft.tokens)
            for i, (token, logits) in enumerate(zip(tokens, token_logits, strict=True)):
                context.append(token)
                stats.tokens += 1
                stats.accepted += i < accepted  # counted as emitted: the consumer may stop
                yield SpeculativeToken(token, logits, i < accepted)
    finally:  # the consumer stopped (or an error): the cache holds context[:-1], as plain
        keep = shift + len(context) - 1
        if cache.offset > keep:
            cache.trim(cache.offset - keep)
        drafter.close(len(context) - 1)


@dataclass
class GenerationResponse:
    """One streamed piece of a reply, with running statistics."""

    text: str  # new text since the previous response (may be "")
    token: int | None
    finish_reason: str | None = None  # "stop" | "length" | "context" | "cancelled" | None
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
    draft: Model | str | Drafter | None = None,
    draft_n: int | None = None,
    cancel: threading.Event | None = None,
) -> Iterator[GenerationResponse]:
    """Stream a reply to ``prompt`` (text, tokenized with special tokens parsed, or ids).

    With ``cache`` given, the prompt is appended to what it holds (prompt caching across chat
    turns); otherwise a fresh cache is made. The last response has a ``finish_reason``.
    ``draft`` (a smaller Model of the same vocabulary, "ngram", or a Drafter) turns on
    speculative decoding: same output, and ``extra["speculative"]`` carries its statistics;
    ``draft_n`` pins the draft length (default: adaptive). ``cancel``, an event another
    thread may set, ends the reply with finish_reason "cancelled" before the next token, or
    within one prompt slice while a long prompt is processed (the cache is then as before
    the prompt). Each call has its own cache unless given one, so calls on one Model from
    several threads are safe (not batched: ``Model.submit`` batches).
    """
    params = params or SamplingParams()
    ids = model.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if cache is None:
        cache = model.make_cache()
    if not cache.fits(len(ids)):  # always fits when the cache rotates
        raise ContextOverflow(f"prompt of {len(ids)} tokens does not fit the context "
                              f"({cache.max_tokens - cache.offset} of {cache.max_tokens} free): "
                              "shorten it, raise --ctx or choose --policy rotate")
    detok = model.tokenizer.detokenizer()
    stops = StopMatcher(params.stop)
    eos = model.tokenizer.eos_ids
    start = time.perf_counter()
    first_at = start
    n = 0
    finish = None
    spec_stats = SpeculativeStats() if draft is not None else None
    if draft is not None:
        drafter = make_drafter(model, draft, [*history, *ids], cache.max_tokens)
        steps = speculative_generate_step(ids, model.net, cache, params, history, drafter=drafter,
                                          controller=DraftLengthController(fixed=draft_n),
                                          stats=spec_stats)
    else:
        steps = generate_step(ids, model.net, cache, params, history, cancel)
    from_draft = False

    def response(text: str, token: int | None, reason: str | None) -> GenerationResponse:
        now = time.perf_counter()
        gen_time = now - first_at
        return GenerationResponse(
            text, token, reason, len(ids), n,
            prompt_tps=len(ids) / max(first_at - start, 1e-9),
            generation_tps=(n - 1) / gen_time if n > 1 and gen_time > 0 else 0.0,
            ttft_s=first_at - start,
            extra={} if spec_stats is None else {"speculative": spec_stats.as_dict(),
                                                 "from_draft": from_draft},
        )

    if params.max_tokens == 0:
        yield response("", None, "length")
        return
    try:
        while finish is None:
            if cancel is not None and cancel.is_set():
                yield response("", None, "cancelled")
                return
            try:
                step = next(steps)
            except ContextOverflow:
                yield response(stops.flush() + detok.flush(), None, "context")
                return
            except Cancelled:
                yield response("", None, "cancelled")
                return
            token, from_draft = step[0], len(step) > 2 and step[2]
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
            elif not cache.fits(1):
                finish = "context"
                text += stops.flush() + detok.flush()
            record = response(text, token, finish)
            record.extra.update(context_event(cache))  # the budget rotated tokens out
            yield record
    finally:
        steps.close()  # a device backend's step queued ahead leaves the cache


def generate(model: Model, prompt: str | Sequence[int], params: SamplingParams | None = None,
             **kwargs) -> str:
    """The whole reply as one string."""
    return "".join(r.text for r in stream_generate(model, prompt, params, **kwargs))
