"""Continuous batching, one step at a time: the engine's scheduler (no threads here).

Sequences live in **slots**; each slot owns a KV cache of ``ctx`` tokens, allocated once, so
the whole KV budget is ``len(slots)`` caches, known before the first request. A step:

1. drops cancelled sequences (their slots are free for this very step);
2. admits waiting requests into free slots, choosing the slot whose cached tokens share the
   longest prefix with the prompt (a chat's next turn prefills only what is new) and trimming
   that cache back to the common prefix;
3. runs ONE forward pass (``net.forward_batch``) over the pending token of every decoding
   sequence plus a chunk of the prompts still being prefilled (chunked prefill: a long prompt
   never stalls the streams for more than one chunk);
4. samples each sequence that got logits with its own sampler (its own seeded RNG, its own
   penalties' history), detokenizes, matches stop strings and emits a ``TokenEvent``.

A sequence decoding alone, on a backend that picks tokens on the device (CUDA graphs:
``Model.sampled_tokens``), takes its tokens from there instead
(``Scheduler._stream_step``): each step is queued before the token of the one before is
read back, so the host's work for a token (the books, detokenizing, the event) overlaps the
GPU's step, and no logits come back. It needs a chain the device draws (greedy, or
top-k/top-p/min-p/temperature, with logit bias and penalties over a window of up to 64
tokens) and no logprobs. A step with anything else to do (a new request, a cancel, the end)
closes the stream first, which takes the step it ran ahead back out of the cache. Several
sequences decoding, and nothing else to do, take their tokens from one stream of the set
the same way (``Model.sampled_batch_tokens``; ``Scheduler._set_stream_step``): one batch
step on the device for all of them, each token drawn by its own chain and generator, no
logits coming back, the next step queued ahead; any change to the set closes it.

A finished sequence's slot keeps what its cache holds (prompt and reply) for prefix reuse
until another request needs the slot (least recently used first).

Determinism: the forward pass's arithmetic is per token and each sampler sees only its own
logits, so a sequence's tokens do not depend on the rest of the batch (at temperature 0, and
when sampling with a seed).
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgellm.cache import KVCache
from edgellm.generate import StopMatcher, non_finite
from edgellm.sampling import SamplingParams, logits_processor, make_sampler

#: tokens one forward pass takes at most (the model's own prompt slice)
MAX_STEP_TOKENS = 512
#: prompt tokens per step while other sequences are decoding (their inter-token latency)
DEFAULT_PREFILL_CHUNK = 128
#: seconds of steps the decode rate (tokens/s in /metrics) is measured over
RATE_WINDOW_S = 10.0
#: most top logprobs a request may ask for (OpenAI's limit)
MAX_TOP_LOGPROBS = 20

FINISH_REASONS = ("stop", "length", "cancelled", "error")


# -- the public records (re-exported by edgellm.engine) ------------------------------------
@dataclass(frozen=True)
class Request:
    """One sequence to generate: prompt ids (already templated and tokenized), how to sample
    (``params``: temperature, top-k/p, min-p, penalties, seed, max_tokens, stop strings,
    logit bias) and whether to report logprobs (None: no; 0: the sampled token's; k: and the
    k most likely tokens')."""

    prompt: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None
    request_id: str = ""  # "" = the engine names it

    def __post_init__(self) -> None:
        if len(self.prompt) == 0:
            raise ValueError("empty prompt: give at least one token")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, "
                             f"not {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the ``top`` most likely (token, logprob), under
    the distribution after logit bias and penalties, before temperature and truncation."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    """What a finished request cost."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens found in a slot's cache (not prefilled again)
    queue_s: float  # submitted -> admitted into a slot
    ttft_s: float  # submitted -> first token
    decode_tps: float  # tokens per second after the first


@dataclass(frozen=True)
class TokenEvent:
    """One step of one request: a sampled token and the text it released (stop strings and
    partial UTF-8 are held back, so ``text`` may be ""). The last event of a request has a
    ``finish_reason`` ("stop": EOS or a stop string; "length": max_tokens or the context;
    "cancelled"; "error", with ``error``) and its ``usage``; it may carry no token."""

    request_id: str
    token: int | None
    text: str
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


# -- internal state -------------------------------------------------------------------------
@dataclass
class SetStream:
    """Several sequences' tokens picked on the device together
    (``Model.sampled_batch_tokens``): each step's (token, logit) a member, in ``members``'
    order."""

    tokens: Iterator[list[tuple[int, float]]]
    members: list[SequenceState]


@dataclass
class Slot:
    """A KV cache and the tokens it holds (``ids``: exactly the cache's contents, but for
    the step a device stream runs ahead, ``SequenceState.stream``)."""

    cache: KVCache
    ids: list[int] = field(default_factory=list)
    seq: SequenceState | None = None  # the active sequence, None when free
    last_used: int = 0  # step counter when it was last released (LRU)


class SequenceState:
    """One request being served: prefill progress, the token to feed next, its sampler."""

    def __init__(self, request: Request, tokenizer, sink: Callable[[TokenEvent], None]):
        self.request = request
        self.id = request.request_id
        self.prompt = [int(t) for t in request.prompt]
        self.params = request.params
        self.process = logits_processor(request.params)
        self.rng = np.random.default_rng(request.params.seed)  # its own: seeded runs repeat
        self.sample = make_sampler(request.params, self.rng)
        # its tokens picked on the device, if open: its own stream, or its set's
        self.stream: Iterator[int] | SetStream | None = None
        self.detok = tokenizer.detokenizer()
        self.stops = StopMatcher(request.params.stop)
        self.sink = sink
        self.slot: Slot | None = None
        self.fed = 0  # prompt tokens in the cache (reused ones included)
        self.cached = 0  # prompt tokens reused from the slot's earlier contents
        self.generated: list[int] = []
        self.pending: int | None = None  # sampled, not yet in the cache
        self.cancel_requested = False  # set from any thread; read at the start of a step
        self.cancel_step: int | None = None  # scheduler step count when cancel was asked
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None
        self.first_at: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt)

    def usage(self) -> Usage:
        now = time.perf_counter()
        first = self.first_at or now
        n = len(self.generated)
        return Usage(
            prompt_tokens=len(self.prompt), completion_tokens=n, cached_tokens=self.cached,
            queue_s=(self.admitted_at or now) - self.submitted_at,
            ttft_s=first - self.submitted_at,
            decode_tps=(n - 1) / (now - first) if n > 1 and now > first else 0.0)


@dataclass
class SchedulerCounters:
    """Running totals for /metrics."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens run through the model (reused ones not counted)
    cached_tokens: int = 0
    generated_tokens: int = 0
    finished: Counter = field(default_factory=Counter)  # finish_reason -> requests
    cancel_steps_max: int = 0  # most steps run between a cancel and the slot's release
    errors: int = 0  # forward passes that failed (their sequences end with "error")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _error_message(exc: Exception) -> str:
    """A failed sequence's error, as its request reports it: the exception's type and text."""
    return f"{type(exc).__name__}: {exc}"


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """log softmax of ``logits`` (vocab,) at ``token``, and the ``top`` best (id, logprob)."""
    x = logits.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top:
        idx = np.argpartition(-x, top - 1)[:top]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        best = tuple((int(i), float(x[i] - lse)) for i in idx)
    return TokenLogprob(int(token), float(x[token] - lse), best)


class Scheduler:
    """The slots, the waiting queue and the stepping logic. Not thread-safe: one thread
    (the engine's) calls ``add`` and ``step``; ``SequenceState.cancel_requested`` is the one
    field other threads write."""

    def __init__(self, net, tokenizer, caches: list[KVCache],
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if not caches:
            raise ValueError("the scheduler needs at least one KV cache slot")
        if not 1 <= prefill_chunk <= MAX_STEP_TOKENS:
            raise ValueError(f"prefill chunk must be 1..{MAX_STEP_TOKENS}, not {prefill_chunk}")
        self.net = net
        self.tokenizer = tokenizer
        self.eos = frozenset(tokenizer.eos_ids)
        self.slots = [Slot(c) for c in caches]
        self.ctx = min(c.max_tokens for c in caches)
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.counters = SchedulerCounters()
        self.recent: deque[tuple[float, int]] = deque()  # (time, tokens sampled) per step

    # -- queue ------------------------------------------------------------------------------
    def add(self, seq: SequenceState) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def active(self) -> int:
        return len(self.running)

    @property
    def free_slots(self) -> int:
        return sum(1 for s in self.slots if s.seq is None)

    def kv_tokens_used(self) -> int:
        """Tokens held by active sequences' caches."""
        return sum(s.cache.offset for s in self.slots if s.seq is not None)

    def decode_tps(self) -> float:
        """Tokens sampled per second over the last RATE_WINDOW_S seconds."""
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self.recent) if t >= now - RATE_WINDOW_S]
        if not recent:
            return 0.0
        return sum(n for _, n in recent) / max(now - recent[0][0], 1e-3)

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> int:
        """Cancel, admit, run one forward pass, sample; returns the tokens it ran."""
        self._drop_cancelled()
        self._admit()
        lone = self._lone_decoder()
        if lone is not None:
            ran = self._stream_step(lone)
            if ran is not None:
                return ran
        together = self._decoding_set()
        if together is not None:
            ran = self._set_stream_step(together)
            if ran is not None:
                return ran
        self._close_streams()
        plan = self._plan()
        if not plan:
            return 0
        batch = [(np.asarray(tokens, dtype=np.int64), seq.slot.cache) for seq, tokens, _ in plan]
        want = [w for _, _, w in plan]
        try:
            logits = self.net.forward_batch(batch, want)
        except Exception as exc:  # noqa: BLE001 - the server must keep serving the others
            return self._fail_all([seq for seq, _, _ in plan], exc)
        self.counters.steps += 1
        sampled = 0
        for (seq, tokens, _), row in zip(plan, logits, strict=True):
            seq.slot.ids.extend(tokens)
            if seq.prefilling:
                seq.fed += len(tokens)
                self.counters.prompt_tokens += len(tokens)
            else:
                seq.pending = None
            if row is not None:
                self._sample(seq, row)
                sampled += 1
        self._count_sampled(sampled)
        return sum(len(t) for _, t, _ in plan)

    def _count_sampled(self, sampled: int) -> None:
        now = time.perf_counter()
        self.recent.append((now, sampled))
        while self.recent[0][0] < now - RATE_WINDOW_S:  # bounded whether or not anyone reads it
            self.recent.popleft()

    # -- a lone sequence's tokens from the device --------------------------------------------
    def _lone_decoder(self) -> SequenceState | None:
        """The one running sequence, when it is decoding and wants no logprobs (whose
        tokens the device may pick: ``_stream_step``)."""
        if len(self.running) != 1:
            return None
        seq = self.running[0]
        return seq if seq.pending is not None and seq.request.logprobs is None else None

    def _stream_step(self, seq: SequenceState) -> int | None:
        """Feed ``seq``'s pending token and take the next from its device stream (opened at
        the first such step): the tokens run (1; 0 when the step failed and ended it), or
        None where the net cannot pick this sequence's tokens (the step runs as usual)."""
        try:
            if seq.stream is None:
                open_stream = getattr(self.net, "sampled_tokens", None)
                if open_stream is None:
                    return None
                # a copy of the generator: the stream draws the uniform of the step it runs
                # ahead, which the host's generator must not lose when the stream is closed
                seq.stream = open_stream(seq.pending, seq.slot.cache, seq.params,
                                         copy.deepcopy(seq.rng), evict=False,
                                         context=seq.prompt + seq.generated)
                if seq.stream is None:
                    return None
            token = next(seq.stream)
        except Exception as exc:  # noqa: BLE001 - as a failed forward pass: end this one
            return self._fail_all([seq], exc)
        self.counters.steps += 1
        self._fed_from_stream(seq)
        self._accept(seq, token)
        self._count_sampled(1)
        return 1

    def _decoding_set(self) -> list[SequenceState] | None:
        """The running sequences, when two or more run and every one is decoding and wants
        no logprobs (whose tokens the device may pick together: ``_set_stream_step``)."""
        seqs = list(self.running)
        if len(seqs) < 2 or any(s.pending is None or s.request.logprobs is not None
                                for s in seqs):
            return None
        return seqs

    def _set_stream_step(self, seqs: list[SequenceState]) -> int | None:
        """Feed each of ``seqs``' pending tokens and take their next from the set's device
        stream (``Model.sampled_batch_tokens``: one batch step, each drawn by its own chain,
        no logits to the host, the next step queued before these are read; opened at the
        set's first such step, after any other stream is closed): the tokens run (0 when
        the step failed and ended them), or None where the net cannot (the step runs as
        usual). A sequence whose logits went NaN or infinite ends in an error, as a lone
        stream's does."""
        stream = seqs[0].stream
        if not (isinstance(stream, SetStream) and stream.members == seqs):
            self._close_streams()
            if any(s not in self.running for s in seqs):  # (a stream's close failed them)
                return None
            open_stream = getattr(self.net, "sampled_batch_tokens", None)
            if open_stream is None:
                return None
            try:  # (it draws with copies of the generators, as a lone stream does)
                tokens = open_stream([(s.pending, s.slot.cache) for s in seqs],
                                     [s.params for s in seqs], [s.rng for s in seqs],
                                     [s.prompt + s.generated for s in seqs])
            except Exception as exc:  # noqa: BLE001 - as a failed forward pass: end these
                return self._fail_all(seqs, exc)
            if tokens is None:
                return None
            stream = SetStream(tokens, seqs)
            for seq in seqs:
                seq.stream = stream
        try:
            picked = next(stream.tokens)
        except Exception as exc:  # noqa: BLE001 - as a failed forward pass: end these
            return self._fail_all(seqs, exc)
        self.counters.steps += 1
        for seq, (token, logit) in zip(seqs, picked, strict=True):
            self._fed_from_stream(seq)
            if math.isfinite(logit):
                self._accept(seq, token)
            else:
                self.counters.errors += 1
                self._fail(seq, _error_message(non_finite(len(seq.generated) + 1)))
        self._count_sampled(len(seqs))
        return len(seqs)

    @staticmethod
    def _fed_from_stream(seq: SequenceState) -> None:
        """A device stream's step took ``seq``'s pending token into its cache and drew the
        next with a copy of its generator: the books say so, and the host's generator skips
        the uniform the device drew (one a token), so it stays in step with the copy."""
        seq.slot.ids.append(seq.pending)
        seq.pending = None
        if not seq.params.greedy:
            seq.rng.random()

    def _fail_all(self, seqs: list[SequenceState], exc: Exception) -> int:
        """End every one of ``seqs`` with ``exc`` (a failed step of them all): 0 tokens run."""
        self.counters.errors += 1
        for seq in seqs:
            self._fail(seq, _error_message(exc))
        return 0

    def _close_streams(self) -> None:
        for seq in [s for s in self.running if s.stream is not None]:
            error = self._close_stream(seq)
            if error is not None:
                self.counters.errors += 1
                self._fail(seq, error)

    def _close_stream(self, seq: SequenceState) -> str | None:
        """Close ``seq``'s device stream (a set's: for all its members), which waits for
        the step it ran ahead and takes it back out of the cache (each member's); the error
        where that failed (the cache is then emptied: what its last step left is unknown;
        the set's other members end with the error too)."""
        stream, seq.stream = seq.stream, None
        if stream is None:
            return None
        members = stream.members if isinstance(stream, SetStream) else [seq]
        for member in members:
            member.stream = None
        try:
            (stream.tokens if isinstance(stream, SetStream) else stream).close()
        except Exception as exc:  # noqa: BLE001 - the caller ends the sequence with it
            for member in members:
                if member.slot is not None:
                    member.slot.cache.reset()
                    member.slot.ids.clear()
            error = _error_message(exc)
            for member in members:
                if member is not seq and member in self.running:
                    self.counters.errors += 1
                    self._fail(member, error)
            return error
        return None

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.waiting if s.cancel_requested]:
            self.waiting.remove(seq)
            self._finish(seq, "cancelled")
        for seq in [s for s in self.running if s.cancel_requested]:
            self._finish(seq, "cancelled")

    def _admit(self) -> None:
        while self.waiting:
            free = [s for s in self.slots if s.seq is None]
            if not free:
                return
            seq = self.waiting.popleft()
            seq.admitted_at = time.perf_counter()
            if seq.params.max_tokens == 0:
                self._finish(seq, "length")
                continue
            slot = max(free, key=lambda s: (common_prefix_len(s.ids, seq.prompt), -s.last_used))
            self._reuse_prefix(slot, seq)
            slot.seq, seq.slot = seq, slot
            self.running.append(seq)

    def _reuse_prefix(self, slot: Slot, seq: SequenceState) -> None:
        """Trim the slot's cache back to its common prefix with the prompt (one prompt token
        at least is left to run: the first reply token needs its logits)."""
        cache = slot.cache
        common = min(common_prefix_len(slot.ids, seq.prompt), len(seq.prompt) - 1, cache.offset)
        if cache.offset - common > cache.max_trim():  # a ring that can't roll back that far
            cache.reset()
            slot.ids.clear()
            common = 0
        else:
            cache.trim(cache.offset - common)
            del slot.ids[common:]
        seq.fed = seq.cached = common
        self.counters.cached_tokens += common

    def _plan(self) -> list[tuple[SequenceState, list[int], bool]]:
        """(sequence, tokens to run, wants logits) for this step: every decoding sequence's
        pending token, then prompt chunks in arrival order within the step's token budget."""
        plan = [(s, [s.pending], True) for s in self.running if s.pending is not None]
        budget = MAX_STEP_TOKENS if not plan else self.prefill_chunk
        budget = min(budget, MAX_STEP_TOKENS - len(plan))
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling:
                n = min(len(seq.prompt) - seq.fed, budget)
                plan.append((seq, seq.prompt[seq.fed:seq.fed + n], seq.fed + n == len(seq.prompt)))
                budget -= n
        return plan

    def _sample(self, seq: SequenceState, logits: np.ndarray) -> None:
        history = seq.prompt + seq.generated  # for the penalties, as generate_step sees it
        processed = seq.process(logits, history)
        token = seq.sample(processed)
        logprob = (token_logprob(processed, token, seq.request.logprobs)
                   if seq.request.logprobs is not None else None)
        self._accept(seq, token, logprob)

    def _accept(self, seq: SequenceState, token: int,
                logprob: TokenLogprob | None = None) -> None:
        """``seq``'s next token: the end at EOS, a stop string, max_tokens or the context's
        end; else its event, and it is the token fed next."""
        params: SamplingParams = seq.params
        seq.generated.append(token)
        self.counters.generated_tokens += 1
        if seq.first_at is None:
            seq.first_at = time.perf_counter()
        if token in self.eos and not params.ignore_eos:
            self._finish(seq, "stop", token, seq.stops.flush() + seq.detok.flush(), logprob)
            return
        text, hit = seq.stops.feed(seq.detok.add(token))
        if hit:
            self._finish(seq, "stop", token, text, logprob)
        elif len(seq.generated) >= params.max_tokens or len(seq.slot.ids) >= self.ctx:
            text += seq.stops.flush() + seq.detok.flush()
            self._finish(seq, "length", token, text, logprob)
        else:
            seq.pending = token
            self._emit(seq, TokenEvent(seq.id, token, text, logprob))

    # -- endings ----------------------------------------------------------------------------
    def _finish(self, seq: SequenceState, reason: str, token: int | None = None,
                text: str = "", logprob: TokenLogprob | None = None,
                error: str | None = None) -> None:
        """Emit the last event, release the slot (its cache stays for prefix reuse)."""
        self._close_stream(seq)  # (an error there empties the cache; the reply is whole)
        if reason == "cancelled" and seq.cancel_step is not None:
            waited = self.counters.steps - seq.cancel_step
            self.counters.cancel_steps_max = max(self.counters.cancel_steps_max, waited)
        self.counters.finished[reason] += 1
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            seq.slot.seq = None
            seq.slot.last_used = self.counters.steps
            seq.slot = None
        seq.pending = None
        self._emit(seq, TokenEvent(seq.id, token, text, logprob, reason, seq.usage(), error))

    def _fail(self, seq: SequenceState, message: str) -> None:
        """A forward pass failed: its caches may be half written, so they start afresh."""
        self._close_stream(seq)
        if seq.slot is not None:
            seq.slot.cache.reset()
            seq.slot.ids.clear()
        self._finish(seq, "error", error=message)

    def _emit(self, seq: SequenceState, event: TokenEvent) -> None:
        try:
            seq.sink(event)
        except Exception:  # noqa: BLE001 - a consumer's failure cancels only its request
            seq.cancel_requested = True

    def fail_running(self, message: str) -> None:
        """End every running sequence with an error, its cache emptied (a step failed
        outside the forward pass: nothing about their state can be trusted)."""
        for seq in list(self.running):
            self._fail(seq, message)

    def fail_all(self, message: str) -> None:
        """End every waiting and running sequence with an error (the engine is closing)."""
        while self.waiting:
            self._finish(self.waiting.popleft(), "error", error=message)
        for seq in list(self.running):
            self._finish(seq, "error", error=message)
