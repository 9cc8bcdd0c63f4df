"""The engine: many requests decoded together, one forward pass per step, in one KV budget.

One engine serves the HTTP server, the C ABI and the Python API. Interface (stable; later
changes are additive only)::

    from edgellm.engine import Engine, Request
    engine = Engine(model, ctx=4096, kv_budget=None, max_seqs=8, max_queue=64)
    handle = engine.submit(Request(prompt_ids, SamplingParams(temperature=0, max_tokens=64),
                                   logprobs=None))
    for event in handle:               # TokenEvent: token, text, logprob, finish_reason, usage
        print(event.text, end="")
    handle.cancel()                    # any thread; the slot is free at the next step
    completion = handle.result()       # or wait for all of it: text, tokens, finish, usage
    engine.stats()                     # EngineStats: slots, queue, tokens, tokens/s, KV use
    engine.close()                     # ends waiting and running requests ("error")

- ``submit(request, on_event=fn)`` calls ``fn(event)`` on the engine's thread for every event
  instead of queueing them for iteration (the server hands them to its event loop); ``fn``
  must be quick, and an exception from it cancels that request.
- Errors at submit: ``QueueFull`` (more than ``max_queue`` requests waiting: try later; HTTP
  503), ``PromptTooLong`` (the prompt does not fit ``ctx``; HTTP 400), ``EngineClosed``,
  ``ValueError`` for bad sampling parameters.
- The KV budget is stated up front: ``max_seqs`` caches of ``ctx`` tokens each (or as many
  as ``kv_budget`` bytes hold), allocated (and touched) when the engine starts; a request
  waits in the queue while every slot is busy. ``describe()`` says it in one line.
- A background thread (started by the constructor unless ``start=False``; then call
  ``start()``) steps while there is work and sleeps otherwise. Woken from sleep by a
  request, it waits until no other has come for ``coalesce_s`` (2 ms; at most 20 ms), so
  requests sent together prefill in one step. ``submit``, ``cancel`` and
  ``stats`` are safe from any thread.
- A sequence's tokens are the same whatever else is in the batch: at temperature 0, and with
  a ``seed`` when sampling (each request has its own RNG).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from edgellm.batching import (
    DEFAULT_PREFILL_CHUNK,
    FINISH_REASONS,
    MAX_TOP_LOGPROBS,
    Request,
    Scheduler,
    SequenceState,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from edgellm.cache import KVCache

if TYPE_CHECKING:
    from edgellm.api import Model

__all__ = ["Completion", "Engine", "EngineClosed", "EngineError", "EngineStats", "QueueFull",
           "PromptTooLong", "Request", "RequestHandle", "TokenEvent", "TokenLogprob", "Usage",
           "FINISH_REASONS", "MAX_TOP_LOGPROBS"]

#: sequences (KV cache slots) when neither max_seqs nor kv_budget says
DEFAULT_MAX_SEQS = 8
#: slots at most, whatever the budget (a step's tokens are bounded by the forward pass)
MAX_SLOTS = 256
DEFAULT_MAX_QUEUE = 64
#: quiet seconds after the last step before the heaps are trimmed (malloc_trim): long enough
#: for the server to finish and free its last responses, short next to a person's pause
IDLE_TRIM_SECONDS = 0.5
#: an idle engine that gets a request waits until no other has come for this long (at most
#: COALESCE_MAX_S) before its first step, so a burst of requests (clients starting together,
#: the server parsing them one by one) prefills in one step and decodes in step: one weight
#: pass for all the prompts instead of one per arrival. Costs a lone request this much TTFT.
COALESCE_GAP_S = 0.002
COALESCE_MAX_S = 0.020


class EngineError(Exception):
    """Base of the engine's refusals."""


class QueueFull(EngineError):
    """Too many requests are waiting for a slot: try again later (HTTP 503)."""


class PromptTooLong(EngineError, ValueError):
    """The prompt does not fit a sequence's context (HTTP 400)."""


class EngineClosed(EngineError):
    """The engine was closed (HTTP 503)."""


@dataclass(frozen=True)
class Completion:
    """A whole finished request (``RequestHandle.result``)."""

    request_id: str
    text: str
    tokens: list[int]
    finish_reason: str
    usage: Usage | None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for /metrics and the like."""

    slots: int
    slots_active: int
    slots_free: int
    queue_depth: int
    ctx: int
    kv_bytes: int
    kv_tokens_used: int
    kv_tokens_budget: int
    requests_submitted: int
    requests_finished: dict[str, int]
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    steps: int
    decode_tps: float
    cancel_steps_max: int
    errors: int


class RequestHandle:
    """A submitted request: iterate its events, wait for its result, or cancel it."""

    def __init__(self, engine: Engine, request: Request,
                 on_event: Callable[[TokenEvent], None] | None):
        self.engine = engine
        self.request = request
        self.id = request.request_id
        self._on_event = on_event
        self._events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self._done = threading.Event()
        self.final: TokenEvent | None = None
        self._seq: SequenceState | None = None

    def _deliver(self, event: TokenEvent) -> None:
        """Called on the engine's thread for each event."""
        if event.done:
            self.final = event
        try:
            if self._on_event is not None:
                self._on_event(event)
            else:
                self._events.put(event)
        finally:
            if event.done:
                self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating (from any thread): the next step drops the sequence and frees its
        slot; the last event has finish_reason "cancelled". No effect once done."""
        seq = self._seq
        if seq is None or self.done or seq.cancel_requested:
            return
        seq.cancel_step = self.engine._scheduler.counters.steps
        seq.cancel_requested = True
        self.engine._wake()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request is finished; False on timeout."""
        return self._done.wait(timeout)

    def __iter__(self) -> Iterator[TokenEvent]:
        """The events as they come (blocking), the last one with its finish_reason."""
        if self._on_event is not None:
            raise RuntimeError("this request delivers its events to its on_event callback")
        while True:
            event = self._events.get()
            yield event
            if event.done:
                return

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the whole request (iterating its events) and return it."""
        if self._on_event is not None:
            raise RuntimeError("this request delivers its events to its on_event callback")
        if timeout is not None and not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        text, tokens, logprobs = [], [], []
        last = None
        for event in self:
            text.append(event.text)
            if event.token is not None:
                tokens.append(event.token)
            if event.logprob is not None:
                logprobs.append(event.logprob)
            last = event
        return Completion(self.id, "".join(text), tokens, last.finish_reason, last.usage,
                          logprobs, last.error)


def _prefault(cache: KVCache) -> None:
    """Write every page of the cache's storage now: the budget is resident from the start,
    so memory does not creep up as sequences first reach deeper slots."""
    for layer in cache.layers:
        for name in ("keys", "values", "q", "d"):
            array = getattr(layer.store, name, None)
            if isinstance(array, np.ndarray):
                array.fill(0)


class Engine:
    """Continuous batching over one loaded model (see the module docstring)."""

    def __init__(self, model: Model, *, ctx: int | None = None, kv_budget: int | None = None,
                 max_seqs: int | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prefault: bool = True,
                 start: bool = True, coalesce_s: float = COALESCE_GAP_S):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, not {max_queue}")
        if coalesce_s < 0:
            raise ValueError(f"coalesce_s must be >= 0, not {coalesce_s}")
        self.coalesce_s = coalesce_s
        self.model = model
        plan = model.cache_plan(ctx, policy="error")
        self.ctx = plan.tokens
        self.seq_bytes = plan.nbytes
        slots = self._slot_count(kv_budget, max_seqs)
        caches = [model.make_cache(self.ctx, policy="error") for _ in range(slots)]
        if prefault:
            for cache in caches:
                _prefault(cache)
        self._scheduler = Scheduler(model.net, model.tokenizer, caches, prefill_chunk)
        self.max_queue = max_queue
        self._inbox: list[SequenceState] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self._submitted = 0
        if start:
            self.start()

    def _slot_count(self, kv_budget: int | None, max_seqs: int | None) -> int:
        if max_seqs is not None and max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, not {max_seqs}")
        if kv_budget is None:
            return min(max_seqs or DEFAULT_MAX_SEQS, MAX_SLOTS)
        fit = kv_budget // self.seq_bytes
        if fit < 1:
            raise ValueError(f"a KV budget of {kv_budget / 2**20:.1f} MiB holds no sequence of "
                             f"{self.ctx} tokens ({self.seq_bytes / 2**20:.1f} MiB each): "
                             "raise --kv-budget or lower --ctx")
        return int(min(fit, max_seqs or MAX_SLOTS, MAX_SLOTS))

    # -- facts ------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return len(self._scheduler.slots)

    @property
    def kv_bytes(self) -> int:
        return self.slots * self.seq_bytes

    def describe(self) -> str:
        """The KV budget in one line."""
        dtype = self.model.cache_config.dtype
        return (f"KV budget {self.kv_bytes / 2**20:.1f} MiB: {self.slots} sequences x "
                f"{self.ctx} tokens ({dtype}, {self.seq_bytes / 2**20:.1f} MiB each), "
                f"queue up to {self.max_queue}")

    # -- requests ---------------------------------------------------------------------------
    def submit(self, request: Request,
               on_event: Callable[[TokenEvent], None] | None = None) -> RequestHandle:
        """Queue a request; returns its handle at once (see the module docstring)."""
        if len(request.prompt) + 1 > self.ctx:
            raise PromptTooLong(f"the prompt has {len(request.prompt)} tokens but a sequence "
                                f"holds {self.ctx} (prompt + at least 1 generated): shorten "
                                "it or raise --ctx")
        vocab = self.model.args.vocab_size
        bad = [t for t in request.prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of the vocabulary (0..{vocab - 1})")
        if not request.request_id:
            request = Request(request.prompt, request.params, request.logprobs,
                              f"req-{next(self._ids)}")
        handle = RequestHandle(self, request, on_event)
        seq = SequenceState(request, self.model.tokenizer, handle._deliver)
        handle._seq = seq
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is closed")
            # requests that will have to wait for a slot, this one included
            backlog = (len(self._inbox) + len(self._scheduler.waiting) + 1
                       - self._scheduler.free_slots)
            if backlog > self.max_queue:
                raise QueueFull(f"all {self.slots} sequence slots are busy and "
                                f"{self.max_queue} requests already wait (the queue limit): "
                                "try again shortly")
            self._inbox.append(seq)
            self._submitted += 1
            self._wakeup.notify()
        return handle

    def _wake(self) -> None:
        with self._lock:
            self._wakeup.notify()

    # -- the stepping thread ----------------------------------------------------------------
    def start(self) -> None:
        """Start the background stepping thread (idempotent)."""
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="edgellm-engine",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        from edgellm.api import return_freed_memory

        sched = self._scheduler
        was_busy = False
        while True:
            if was_busy and not self._inbox and not sched.has_work():
                # going idle: once quiet for a moment, hand the freed heap pages back (every
                # thread's: the server frees its last responses after our last step)
                with self._lock:
                    if not self._inbox:
                        self._wakeup.wait(IDLE_TRIM_SECONDS)
                    quiet = not self._closed and not self._inbox
                if quiet:
                    return_freed_memory()  # outside the lock: submit() never waits on it
                was_busy = False
            with self._lock:
                while not self._closed and not self._inbox and not sched.has_work():
                    self._wakeup.wait()
                if not sched.has_work():
                    self._await_burst()
                if self._closed:
                    break
                for seq in self._inbox:
                    sched.add(seq)
                self._inbox.clear()
            was_busy = True
            try:
                sched.step()
            except Exception as exc:  # noqa: BLE001 - a bug must not stop the serving thread
                sched.fail_running(f"internal error: {type(exc).__name__}: {exc}")
        with self._lock:
            for seq in self._inbox:
                sched.add(seq)
            self._inbox.clear()
        sched.fail_all("the engine was closed")

    def _await_burst(self) -> None:
        """Idle, with a request in: let the rest of a burst arrive (under the lock, which
        the condition's waits release; see COALESCE_GAP_S)."""
        end = time.monotonic() + COALESCE_MAX_S
        seen = -1
        while self.coalesce_s and not self._closed and len(self._inbox) != seen:
            seen = len(self._inbox)
            left = end - time.monotonic()
            if left <= 0:
                return
            self._wakeup.wait(min(self.coalesce_s, left))

    def step(self) -> int:
        """Run one step on the caller's thread (only when the engine was made with
        ``start=False`` and not started); returns the tokens it ran."""
        if self._thread is not None:
            raise RuntimeError("the engine's own thread is stepping it")
        with self._lock:
            for seq in self._inbox:
                self._scheduler.add(seq)
            self._inbox.clear()
        return self._scheduler.step()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the thread; waiting and running requests end with finish_reason "error"."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wakeup.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._scheduler.fail_all("the engine was closed")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- observation ------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Counters and gauges (read without stopping the engine; each value is current)."""
        s, c = self._scheduler, self._scheduler.counters
        return EngineStats(
            slots=len(s.slots), slots_active=s.active, slots_free=s.free_slots,
            queue_depth=len(s.waiting) + len(self._inbox), ctx=self.ctx,
            kv_bytes=self.kv_bytes, kv_tokens_used=s.kv_tokens_used(),
            kv_tokens_budget=self.ctx * len(s.slots),
            requests_submitted=self._submitted, requests_finished=dict(c.finished),
            prompt_tokens=c.prompt_tokens, cached_tokens=c.cached_tokens,
            generated_tokens=c.generated_tokens, steps=c.steps, decode_tps=s.decode_tps(),
            cancel_steps_max=c.cancel_steps_max, errors=c.errors)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until nothing is queued or running (tests, shutdown); False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self._inbox and not self._scheduler.has_work():
                return True
            time.sleep(0.005)
        return False
