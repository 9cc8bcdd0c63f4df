"""The public entry points: ``load()`` and the ``Model`` it returns."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgellm.backends import Backend, get_backend
from edgellm.cache import CacheConfig, CachePlan, KVCache, default_context, plan_cache
from edgellm.chat import Message, render_chat
from edgellm.config import ModelArgs
from edgellm.converters.gguf_reader import read_gguf
from edgellm.models import build_model
from edgellm.store import resolve_model
from edgellm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from edgellm.engine import Completion, Engine, RequestHandle, TokenEvent
    from edgellm.sampling import SamplingParams

#: sequences the engine decodes together when a Model starts it without being told (each is a
#: KV cache of the model's context, allocated up front)
DEFAULT_ENGINE_SEQS = 4

#: load progress: (fraction done in [0, 1], stage: "file", "weights", "tokenizer", "done")
LoadProgress = Callable[[float, str], None]

#: metadata arrays the tokenizer takes over at load (Qwen's merges and Gemma's 262k tokens are
#: tens of MB of Python strings); ``Model.metadata`` keeps everything else
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                    "tokenizer.ggml.token_type")


@dataclass
class Model:
    """A loaded model: the network over a backend, its tokenizer, and its file's metadata
    (less ``TOKENIZER_ARRAYS``: the tokenizer holds the vocabulary).

    Threads: one Model may be shared by any number of threads. ``submit``/``complete``
    (and their ``_chat`` forms) go through the model's engine, which decodes concurrent
    requests together, each getting the tokens it would get alone; a request is cancelled
    from any thread with ``handle.cancel()``. ``generate``/``stream_generate`` on a shared
    Model are safe too (each call has its own KV cache; the C kernels run one op at a time)
    but are not batched. A ``ChatSession`` (one conversation, one cache) belongs to one
    thread at a time. ``close()`` (or ``with edgellm.load(...) as model:``) releases the
    memory.
    """

    path: Path
    metadata: dict[str, Any]
    args: ModelArgs
    net: Any  # the architecture's Model (edgellm.models.*)
    tokenizer: Tokenizer
    backend: Backend
    context_length: int  # tokens the default cache holds
    cache_config: CacheConfig = field(default_factory=CacheConfig)  # dtype, policy, keep
    closed: bool = field(default=False, init=False)
    _engine: Engine | None = field(default=None, init=False, repr=False)
    _engine_lock: Any = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    @property
    def name(self) -> str:
        return str(self.metadata.get("general.name") or self.path.stem)

    def make_cache(self, max_tokens: int | None = None, **overrides: Any) -> KVCache:
        """A KV cache of ``max_tokens`` (default: the model's configured context), with the
        model's ``cache_config`` (dtype, policy, keep); ``overrides`` replace its fields,
        e.g. ``make_cache(512, policy="rotate", dtype="float32")``.
        """
        return self.net.make_cache(config=self._cache_config(max_tokens, overrides))

    def cache_plan(self, max_tokens: int | None = None, **overrides: Any) -> CachePlan:
        """The cache ``make_cache`` would allocate, sized without allocating: ``.nbytes``,
        ``.tokens``, per-layer slots, and ``.describe()`` for one human-readable line.
        """
        config = self._cache_config(max_tokens, overrides)
        return plan_cache(self.net.cache_specs(), config, self.context_length)

    def _cache_config(self, max_tokens: int | None, overrides: dict) -> CacheConfig:
        config = replace(self.cache_config, **overrides)
        if max_tokens or config.max_bytes is None:
            config = replace(config, max_tokens=max_tokens or self.context_length)
        return config

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Prompt text to ids the way llama.cpp's tools do: BOS per the file, specials parsed.

        A BOS already written in the text (chat templates often do) is not added twice.
        """
        ids = self.tokenizer.encode(text, parse_special=parse_special)
        bos = self.tokenizer.bos_id
        if len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return ids

    def apply_chat_template(self, messages: Sequence[Message],
                            add_generation_prompt: bool = True) -> str:
        """Render messages with the model's chat template (a ChatML fallback if it has none)."""
        tok = self.tokenizer

        def text_of(token_id: int | None) -> str:
            return "" if token_id is None else tok.id_to_piece(token_id)

        return render_chat(self.chat_template, messages, bos_token=text_of(tok.bos_id),
                           eos_token=text_of(tok.eos_id),
                           add_generation_prompt=add_generation_prompt)

    # -- requests through the engine (safe from any thread) ---------------------------------
    def start_engine(self, **options: Any) -> Engine:
        """Start the model's engine with ``options`` (``edgellm.engine.Engine``'s: ``ctx``,
        ``kv_budget``, ``max_seqs``, ``max_queue``, ``prefill_chunk``); options left None
        take the defaults (``max_seqs``: DEFAULT_ENGINE_SEQS). Once per model: the engine
        ``submit`` uses, started on first use with the defaults when this was not called."""
        from edgellm.engine import Engine

        options = {k: v for k, v in options.items() if v is not None}
        options.setdefault("max_seqs", DEFAULT_ENGINE_SEQS)
        with self._engine_lock:
            if self.closed:
                raise ValueError("the model is closed: load it again")
            if self._engine is not None:
                raise ValueError("the model's engine is already running: start_engine() "
                                 "must come before the first request")
            self._engine = Engine(self, **options)
            return self._engine

    @property
    def engine(self) -> Engine:
        """The engine every ``submit`` goes through (started with the defaults if needed)."""
        engine = self._engine
        if engine is not None:
            return engine
        try:
            return self.start_engine()
        except ValueError:
            if self._engine is not None:  # another thread started it first
                return self._engine
            raise

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               *, logprobs: int | None = None) -> RequestHandle:
        """Queue a completion of ``prompt`` (text, tokenized as ``encode`` does, or ids) on
        the engine; returns at once. Iterate the handle for its ``TokenEvent``s (text,
        token, finish_reason, usage), ``result()`` for all of it, ``cancel()`` from any
        thread to stop it at the next step (one token, or one prompt slice while the prompt
        is processed)."""
        from edgellm.engine import Request
        from edgellm.sampling import SamplingParams

        if self.closed:
            raise ValueError("the model is closed: load it again")
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return self.engine.submit(Request(ids, params or SamplingParams(), logprobs))

    def submit_chat(self, messages: Sequence[Message], params: SamplingParams | None = None,
                    *, logprobs: int | None = None) -> RequestHandle:
        """``submit`` for a conversation, rendered with the model's chat template."""
        return self.submit(self.encode(self.apply_chat_template(messages)), params,
                           logprobs=logprobs)

    def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 *, on_token: Callable[[TokenEvent], Any] | None = None) -> Completion:
        """The whole reply to ``prompt`` through the engine. ``on_token(event)`` runs on this
        thread for each event as it arrives; an exception from it cancels the request and
        propagates."""
        return _collect(self.submit(prompt, params), on_token)

    def complete_chat(self, messages: Sequence[Message], params: SamplingParams | None = None,
                      *, on_token: Callable[[TokenEvent], Any] | None = None) -> Completion:
        """``complete`` for a conversation, rendered with the model's chat template."""
        return _collect(self.submit_chat(messages, params), on_token)

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine (its unfinished requests end with finish_reason "error") and
        release the weights, tokenizer and caches: the process's memory returns to what it
        was before the load. The model cannot be used afterwards. Idempotent."""
        with self._engine_lock:
            if self.closed:
                return
            self.closed = True
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        self.net = self.tokenizer = self.backend = None
        release_freed_model()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _collect(handle: RequestHandle, on_token: Callable[[TokenEvent], Any] | None) -> Completion:
    """Iterate a request's events (calling on_token) and return its Completion."""
    from edgellm.engine import Completion

    events: Iterator[TokenEvent] = iter(handle)
    text, tokens, logprobs, last = [], [], [], None
    try:
        for event in events:
            if on_token is not None:
                on_token(event)
            text.append(event.text)
            if event.token is not None:
                tokens.append(event.token)
            if event.logprob is not None:
                logprobs.append(event.logprob)
            last = event
    except BaseException:
        handle.cancel()
        raise
    return Completion(handle.id, "".join(text), tokens, last.finish_reason, last.usage,
                      logprobs, last.error)


def load(model: str | os.PathLike = "qwen2.5-coder-0.5b-instruct", backend: str = "auto",
         threads: int | None = None, context_length: int | None = None,
         cache: CacheConfig | None = None, progress: LoadProgress | None = None,
         quant: str = "q8_0") -> Model:
    """Load a model by catalog name, ``.gguf`` path or Hugging Face model folder onto a backend
    ("auto" = fastest here). A folder is converted in memory to ``quant`` (any type of
    ``edgellm convert``), no file written.

    ``context_length`` caps the default KV cache (default: the model's own, at most 4096).
    ``cache`` sets the KV cache's budget (``max_tokens``/``max_bytes``: a byte budget sets the
    context to the most tokens that fit), storage dtype and overflow policy.
    ``progress(fraction, stage)`` is called as loading goes (on this thread; the weights by
    bytes prepared); an exception from it aborts the load.
    """
    report = progress or _no_progress
    pin_malloc_settings()  # before anything large is allocated and freed
    if Path(model).is_dir():  # a Hugging Face folder: converted in memory
        from edgellm.converters.hf_convert import folder_as_gguf

        path = Path(model)
        gguf = folder_as_gguf(path, quant, threads)
    else:
        path = resolve_model(model)
        gguf = read_gguf(path)
    report(0.02, "file")
    options = {"threads": threads} if threads else {}
    be = get_backend(backend, **options)
    with _weight_progress(be, gguf.tensors, lambda f: report(0.02 + 0.9 * f, "weights")):
        net = build_model(gguf.metadata, gguf.tensors, be)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    report(0.97, "tokenizer")
    cache = cache or CacheConfig()
    ctx = context_length or cache.max_tokens or default_context(net.args.context_length)
    if cache.max_bytes is not None:  # the most tokens that fit, up to the model's context
        ctx = context_length or cache.max_tokens or net.args.context_length
        ctx = plan_cache(net.cache_specs(), replace(cache, max_tokens=ctx)).tokens
    cache = replace(cache, max_tokens=ctx, max_bytes=None)
    metadata = {k: v for k, v in gguf.metadata.items() if k not in TOKENIZER_ARRAYS}
    del gguf
    model = Model(path, metadata, net.args, net, tokenizer, be, ctx, cache)
    return_freed_memory()
    report(1.0, "done")
    return model


def _no_progress(fraction: float, stage: str) -> None:
    pass


@contextmanager
def _weight_progress(backend: Backend, tensors: dict, report: Callable[[float], None]):
    """Report the fraction of the file's tensor bytes the backend has prepared, while the
    architecture builds its weights. The backend instance's ``prepare*`` methods are wrapped
    for the duration (instance attributes, removed after): every architecture prepares each
    tensor through them, so no constructor needs a progress parameter."""
    total = sum(t.nbytes for t in tensors.values()) or 1
    done = reported = 0.0

    def counting(method):
        def prepare(tensor, *args, **kwargs):
            nonlocal done, reported
            out = method(tensor, *args, **kwargs)
            done += tensor.nbytes
            if done / total >= reported + 0.01:  # a call per percent, not per tensor
                reported = min(done / total, 1.0)
                report(reported)
            return out
        return prepare

    names = [n for n in ("prepare", "prepare_vector", "prepare_embedding") if hasattr(backend, n)]
    for name in names:
        setattr(backend, name, counting(getattr(backend, name)))
    try:
        yield
    finally:
        for name in names:
            delattr(backend, name)


#: glibc's mallopt parameter numbers for the trim and mmap thresholds and the arena count
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
#: blocks from this size up get mappings of their own (glibc's dynamic default starts at
#: 128 KiB and rises to the largest block freed, up to 32 MiB). 1 MiB cost the 0.5B's prefill
#: ~8% in page faults of its per-slice temporaries (up to 10 MB); 16 MiB costs nothing there
#: and still ends the retention below
MMAP_THRESHOLD = 16 << 20
#: free memory a heap keeps at its top before handing it back. Pinning the mmap threshold also
#: pins this at glibc's 128 KiB, and then every free of a step's temporaries gave their pages
#: back and the next step faulted them in again: 2,400 page faults a step with 8 sequences in
#: the 0.5B (24 -> 19.4 ms a step once kept), 41,000 a 512-token prompt (+8-11% prefill). Two
#: mmap thresholds: any block the heap serves can be freed and reused without a fault. The
#: heaps go back to the system where we trim on purpose (Model.close, an idle engine).
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
#: malloc arenas: glibc gives threads that meet contention arenas of their own (up to 8 per
#: core), each keeping its own free pages. The server's threads (event loop, engine, kernel
#: pool) held ~10 MB more that way: its load test (benchmarks/serve_stress.py --seed 5, three
#: runs each) ended at 894-898 MiB and +2.2..+5.3 MiB over its warm-up, and at 886.5-886.8
#: MiB and +1.0..+1.7 MiB with two arenas
ARENA_MAX = 2
_malloc_pinned = False


def pin_malloc_settings() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD (its trim threshold at TRIM_THRESHOLD, its
    arena count at ARENA_MAX) for this process (once; elsewhere nothing).

    glibc raises the threshold to the size of each mapped block freed (up to 32 MB), after
    which blocks of that size come from the heap, and a heap returns memory only where whole
    pages are free: load/free cycles of the 0.5B through the C ABI kept 21 MB more heap after
    the second or third cycle, for good. Pinned, a large block is unmapped when it is freed,
    and a load followed by a free leaves the process where it was.
    """
    global _malloc_pinned
    if _malloc_pinned:
        return
    _malloc_pinned = True
    mallopt = _libc_function("mallopt")
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        mallopt(_M_ARENA_MAX, ARENA_MAX)


_libc: dict[str, Any] = {}


def _libc_function(name: str) -> Any:
    """A glibc function of this process (looked up once: each ctypes.CDLL makes new classes
    that outlive a load/free cycle and pin an allocator arena), or None elsewhere."""
    if name not in _libc:
        try:  # the process's own symbols: no library search (find_library runs a subprocess)
            _libc[name] = getattr(ctypes.CDLL(None), name)
        except (OSError, AttributeError, TypeError):  # not glibc
            _libc[name] = None
    return _libc[name]


def release_freed_model() -> None:
    """Once a model's last references are dropped: collect the cycles its weights may sit in
    (bound methods, partials), clear the interpreter caches it left names in, and hand the
    freed heap pages back."""
    gc.collect()
    release_interpreter_caches()
    return_freed_memory()


def release_interpreter_caches() -> None:
    """Drop CPython's type attribute cache (sys._clear_type_cache).

    The cache holds a strong reference to each attribute name it has seen (4096 entries);
    names built while a model loads and runs (numpy's, cffi's, jinja2's) stay alive in it
    after the model is freed, each pinning an otherwise empty 1 MiB pymalloc arena: 0.5B
    load/free cycles through the C ABI grew by ~1 MB a cycle. The cache refills on the next
    lookups."""
    clear = getattr(sys, "_clear_type_cache", None)
    if clear is not None:
        clear()


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing).

    Loading frees tens of MB in small blocks (the vocabulary's interim lists, the tokenizer's
    construction, weight repacking) that malloc would otherwise keep: 15 MB of the 0.5B's
    resident memory after load.
    """
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)
