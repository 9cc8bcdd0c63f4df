"""The Python side of libedgellm, the C ABI in ``native/edgellm.h``.

The C library (``native/capi.c``, built by ``native/capi_build.py``) checks pointers, keeps
each thread's last error and calls the app's callbacks; everything else happens here:

- **handles**: a model or request handle is an integer (kind, slot, generation) in a
  ``HandleTable``; a freed slot's generation moves on, so a handle used after its free, or a
  request handle passed as a model, is reported (``EDGELLM_ERR_INVALID_HANDLE``), never
  followed;
- **JSON in, JSON out**: load options and OpenAI-style requests are validated here (unknown
  keys and wrong types are refused, naming the key); replies go out as OpenAI chunk objects;
- **one engine per model**: requests from any thread go to the model's engine
  (``Model.engine``), which decodes them together; a request's cancel reaches the engine.

Every function the C side calls goes through ``_entry``: exceptions become a status code and
a one-line message on the calling thread, never an unwinding into C.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# status codes, as in native/edgellm.h (never renumbered)
OK = 0
INVALID_ARGUMENT = 1
INVALID_JSON = 2
NOT_FOUND = 3
BAD_MODEL = 4
BUFFER_TOO_SMALL = 5
INVALID_HANDLE = 6
CANCELLED = 7
CONTEXT = 8
BUSY = 9
VERSION = 10
RUNTIME = 11
INTERNAL = 12

TOKENIZE_ADD_BOS = 1
TOKENIZE_PARSE_SPECIAL = 2


class CapiError(Exception):
    """A failure with the status code the C caller gets."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# -- handles ----------------------------------------------------------------------------------
MODEL_KIND = 1
REQUEST_KIND = 2
KIND_NAMES = {MODEL_KIND: "model", REQUEST_KIND: "request"}
_SLOT_BITS = 24  # up to 16M live handles of a kind
_GEN_BITS = 32


class HandleTable:
    """Objects by handle: ``(kind << 56) | (generation << 24) | (slot + 1)``, never 0.

    A slot's generation counter moves on when its object is removed, so an old handle to a
    reused slot no longer matches. Thread-safe.
    """

    def __init__(self, kind: int):
        self.kind = kind
        self._objects: list[Any] = []
        self._generations: list[int] = []
        self._free: list[int] = []
        self._lock = threading.Lock()

    def add(self, obj: Any) -> int:
        with self._lock:
            if self._free:
                slot = self._free.pop()
            else:
                if len(self._objects) >= (1 << _SLOT_BITS) - 1:
                    raise CapiError(BUSY, f"too many live {KIND_NAMES[self.kind]} handles")
                slot = len(self._objects)
                self._objects.append(None)
                self._generations.append(1)
            self._objects[slot] = obj
            return (self.kind << 56) | (self._generations[slot] << _SLOT_BITS) | (slot + 1)

    def get(self, handle: int) -> Any:
        with self._lock:
            return self._objects[self._slot(handle)]

    def remove(self, handle: int) -> Any:
        """The handle's object, taken out of the table: the handle is invalid from now on."""
        with self._lock:
            slot = self._slot(handle)
            obj, self._objects[slot] = self._objects[slot], None
            self._generations[slot] = self._generations[slot] % ((1 << _GEN_BITS) - 1) + 1
            self._free.append(slot)
            return obj

    def _slot(self, handle: int) -> int:
        """The live slot the handle names, or CapiError(INVALID_HANDLE) saying why not."""
        name = KIND_NAMES[self.kind]
        kind = handle >> 56
        if kind != self.kind:
            other = KIND_NAMES.get(kind)
            what = f"a {other} handle" if other else "not an edgellm handle"
            raise CapiError(INVALID_HANDLE, f"expected a {name} handle, got {what}")
        slot = (handle & ((1 << _SLOT_BITS) - 1)) - 1
        generation = (handle >> _SLOT_BITS) & ((1 << _GEN_BITS) - 1)
        if (not 0 <= slot < len(self._objects) or self._objects[slot] is None
                or self._generations[slot] != generation):
            raise CapiError(INVALID_HANDLE, f"invalid {name} handle: it was freed already "
                                            "(or never created)")
        return slot


# -- JSON -------------------------------------------------------------------------------------
def parse_object(text: str, what: str) -> dict[str, Any]:
    """``text`` as a JSON object, or CapiError(INVALID_JSON) naming what is wrong."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise CapiError(INVALID_JSON, f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CapiError(INVALID_JSON, f"{what} must be a JSON object, not {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class Field:
    """One accepted key: its JSON type ("string", "integer", "number", "boolean", "array",
    "object", "string or array") and an optional check returning an error text or None."""

    type: str
    check: Callable[[Any], str | None] | None = None
    required: bool = False


def _is_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "string or array":
        return isinstance(value, str | list)
    types = {"string": str, "boolean": bool, "array": list, "object": dict}
    return isinstance(value, types[kind])


def validate(obj: dict[str, Any], fields: dict[str, Field], what: str) -> dict[str, Any]:
    """The keys of ``obj`` given a value (null counts as absent), each checked against
    ``fields``; an unknown key, a wrong type, a failed check or a missing required key is a
    CapiError(INVALID_JSON) naming the key."""
    for key in obj:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise CapiError(INVALID_JSON, f"{what}: unsupported key {key!r} (supported: {known})")
    out = {}
    for key, spec in fields.items():
        value = obj.get(key)
        if value is None:
            if spec.required:
                raise CapiError(INVALID_JSON, f"{what}: {key!r} is required")
            continue
        if not _is_type(value, spec.type):
            raise CapiError(INVALID_JSON, f"{what}: {key!r} must be {_article(spec.type)}, "
                                          f"not {_json_type(value)}")
        problem = spec.check(value) if spec.check else None
        if problem:
            raise CapiError(INVALID_JSON, f"{what}: {key!r} {problem}")
        out[key] = value
    return out


def _article(kind: str) -> str:
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def _at_least(low: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be >= {low}, not {v}"


def _between(low: float, high: float) -> Callable[[Any], str | None]:
    return lambda v: None if low <= v <= high else f"must be between {low} and {high}, not {v}"


LOAD_OPTIONS = {
    "model": Field("string", lambda v: None if v else "must not be empty", required=True),
    "backend": Field("string"),
    "threads": Field("integer", _at_least(1)),
    "context_length": Field("integer", _at_least(16)),
    "max_sequences": Field("integer", _between(1, 64)),
}

CHAT_ROLES = ("system", "user", "assistant")
MAX_STOPS = 4


def _stops_check(value: Any) -> str | None:
    stops = [value] if isinstance(value, str) else value
    if len(stops) > MAX_STOPS:
        return f"takes at most {MAX_STOPS} strings, not {len(stops)}"
    if not all(isinstance(s, str) for s in stops):
        return "must be a string or an array of strings"
    return None


#: the sampling keys both request kinds accept (OpenAI's, plus llama.cpp's top_k, min_p,
#: repetition_penalty); keys not given take edgellm's SamplingParams defaults
SAMPLING_FIELDS = {
    "model": Field("string"),  # accepted and ignored: the handle decides the model
    "stream": Field("boolean"),  # accepted and ignored: replies always stream
    "max_tokens": Field("integer", _at_least(0)),
    "max_completion_tokens": Field("integer", _at_least(0)),
    "temperature": Field("number", _between(0, 2)),
    "top_p": Field("number", lambda v: None if 0 < v <= 1 else f"must be in (0, 1], not {v}"),
    "top_k": Field("integer", _at_least(0)),
    "min_p": Field("number", lambda v: None if 0 <= v < 1 else f"must be in [0, 1), not {v}"),
    "seed": Field("integer"),
    "stop": Field("string or array", _stops_check),
    "presence_penalty": Field("number", _between(-2, 2)),
    "frequency_penalty": Field("number", _between(-2, 2)),
    "repetition_penalty": Field("number", lambda v: None if v > 0 else f"must be > 0, not {v}"),
}
CHAT_FIELDS = {**SAMPLING_FIELDS, "messages": Field("array", required=True)}
COMPLETION_FIELDS = {**SAMPLING_FIELDS, "prompt": Field("string", required=True)}
MESSAGE_FIELDS = {"role": Field("string", required=True),
                  "content": Field("string", required=True)}


def sampling_params(fields: dict[str, Any]):
    """SamplingParams from a validated request's sampling keys."""
    from edgellm.sampling import SamplingParams

    names = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
             "frequency_penalty", "repetition_penalty")
    kwargs = {name: fields[name] for name in names if name in fields}
    max_tokens = fields.get("max_completion_tokens", fields.get("max_tokens"))
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    if "stop" in fields:
        stop = fields["stop"]
        kwargs["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise CapiError(INVALID_JSON, f"request: {exc}") from None


def chat_messages(messages: list[Any]) -> list[dict[str, str]]:
    """The validated messages of a chat request."""
    if not messages:
        raise CapiError(INVALID_JSON, "chat request: 'messages' must not be empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise CapiError(INVALID_JSON, f"chat request: messages[{i}] must be an object, "
                                          f"not {_json_type(message)}")
        fields = validate(message, MESSAGE_FIELDS, f"chat request: messages[{i}]")
        if fields["role"] not in CHAT_ROLES:
            raise CapiError(INVALID_JSON, f"chat request: messages[{i}].role must be one of "
                                          f"{', '.join(CHAT_ROLES)}, not {fields['role']!r}")
        out.append(fields)
    return out


# -- models -----------------------------------------------------------------------------------
class LoadCancelled(Exception):
    """The load progress callback asked to stop."""


class ModelEntry:
    """A loaded model behind a handle: the Model, its engine and its live requests.

    Calls that use the model (tokenize, info, starting a request) run inside ``use()``;
    ``close()`` waits for them, so a free racing with another thread's call never pulls the
    model out from under it: that call finishes, or is refused as INVALID_HANDLE."""

    def __init__(self, model, engine):
        self.model = model
        self.engine = engine
        self.requests: set[CRequest] = set()
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        self._users = 0
        self.closing = False

    @contextmanager
    def use(self):
        with self.lock:
            if self.closing:
                raise CapiError(INVALID_HANDLE, "the model was freed")
            self._users += 1
        try:
            yield self.model
        finally:
            with self.lock:
                self._users -= 1
                self._idle.notify_all()

    def close(self) -> None:
        """Refuse new calls, wait for the ones in progress, cancel the live requests, wait
        until the engine has ended them, stop the engine and release the model's memory."""
        with self.lock:
            self.closing = True
            while self._users:
                self._idle.wait()
            requests = list(self.requests)
        for request in requests:
            request.cancel()
        for request in requests:
            request.wait_engine()
        self.model.close()  # closes the engine too


def load_model(options_json: str, progress: Callable[[float, str], None] | None = None):
    """(Model, Engine) for validated load options (the work of edgellm_model_load)."""
    from edgellm.api import load
    from edgellm.backends import get_backend
    from edgellm.store import resolve_model

    options = validate(parse_object(options_json, "load options"), LOAD_OPTIONS, "load options")
    try:
        path = resolve_model(options["model"])
    except (LookupError, FileNotFoundError, IsADirectoryError, PermissionError) as exc:
        raise CapiError(NOT_FOUND, exc.args[0] if exc.args else str(exc)) from None
    backend = options.get("backend", "auto")
    try:
        get_backend(backend, **({"threads": options["threads"]} if "threads" in options else {}))
    except ValueError as exc:
        raise CapiError(INVALID_JSON, f"load options: 'backend': {exc}") from None
    except (ImportError, RuntimeError) as exc:
        raise CapiError(RUNTIME, f"backend {backend!r} does not run here: {exc}") from None

    def report(fraction: float, stage: str) -> None:
        if progress is not None:
            progress(0.95 * fraction, stage)

    try:
        model = load(path, backend=backend, threads=options.get("threads"),
                     context_length=options.get("context_length"), progress=report)
    except (LoadCancelled, CapiError):
        raise
    except (ValueError, OSError, KeyError, IndexError) as exc:
        text = _error_message(exc)
        raise CapiError(BAD_MODEL, text if str(path) in text
                        else f"{path}: cannot load this model: {text}") from None
    try:
        engine = model.start_engine(max_seqs=options.get("max_sequences"))
        if progress is not None:
            progress(1.0, "engine")
    except BaseException:
        model.close()
        raise
    return model, engine


def model_info(entry: ModelEntry) -> dict[str, Any]:
    """What edgellm_model_info reports."""
    from edgellm import __version__

    model, engine = entry.model, entry.engine
    return {"name": model.name, "architecture": model.args.architecture,
            "path": str(model.path), "context_length": engine.ctx,
            "vocab_size": model.args.vocab_size, "backend": model.backend.name,
            "max_sequences": engine.slots, "kv_bytes": engine.kv_bytes,
            "chat_template": model.chat_template is not None,
            "edgellm_version": __version__, "stats": engine_stats(engine)}


def engine_stats(engine) -> dict[str, Any]:
    """The engine's counters: requests, tokens, steps, and the most steps a cancelled
    request ran after its cancel (``cancel_steps_max``: 1 means it stopped at the next step)."""
    stats = engine.stats()
    return {"requests_submitted": stats.requests_submitted,
            "requests_finished": dict(stats.requests_finished),
            "active": stats.slots_active, "queued": stats.queue_depth,
            "prompt_tokens": stats.prompt_tokens, "cached_tokens": stats.cached_tokens,
            "generated_tokens": stats.generated_tokens, "steps": stats.steps,
            "cancel_steps_max": stats.cancel_steps_max}


def tokenize(model, text: str, flags: int) -> list[int]:
    """edgellm_tokenize's ids: BOS as the file asks when ADD_BOS is set, special-token text
    parsed when PARSE_SPECIAL is set."""
    if flags & ~(TOKENIZE_ADD_BOS | TOKENIZE_PARSE_SPECIAL):
        raise CapiError(INVALID_ARGUMENT, f"unknown tokenize flags 0x{flags:x} (known: "
                                          "EDGELLM_TOKENIZE_ADD_BOS, _PARSE_SPECIAL)")
    tok = model.tokenizer
    ids = tok.encode(text, add_bos=None if flags & TOKENIZE_ADD_BOS else False,
                     parse_special=bool(flags & TOKENIZE_PARSE_SPECIAL))
    if len(ids) > 1 and ids[0] == tok.bos_id and ids[1] == tok.bos_id:  # as Model.encode
        ids = ids[1:]
    return ids


def detokenize(model, ids: list[int]) -> str:
    vocab = len(model.tokenizer.tokens)
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise CapiError(INVALID_ARGUMENT, f"tokens[{i}] = {token} is not a token id of "
                                              f"this model (0..{vocab - 1})")
    return model.tokenizer.decode(ids)


# -- requests ---------------------------------------------------------------------------------
CHAT, COMPLETION = 0, 1
_ids = iter(range(1, 1 << 62))
_ids_lock = threading.Lock()


def _request_id(kind: int) -> str:
    with _ids_lock:
        n = next(_ids)
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-edgellm-{n}"


class CRequest:
    """One request handle's life: created, running (its events read by the C caller's
    thread, one chunk at a time), done. Runs once; cancellable from any thread."""

    def __init__(self, entry: ModelEntry):
        self.entry = entry
        self.lock = threading.Lock()
        self.state = "new"  # new -> running -> done
        self.cancelled = False
        self.handle = None  # the engine's RequestHandle while it runs
        self.kind = CHAT
        self.id = ""
        self.created = 0
        self.events = None
        self.chunk = None  # the last chunk's cffi buffer: kept alive until the next call
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.final = None  # the engine's last TokenEvent
        self.sent_role = False

    # -- any thread --------------------------------------------------------------------------
    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            handle = self.handle
        if handle is not None:
            handle.cancel()

    def wait_engine(self, timeout: float | None = None) -> None:
        """Wait until the engine is done with this request (if it was submitted): after a
        cancel, the end of the step in flight."""
        handle = self.handle
        if handle is not None:
            handle.wait(timeout)

    # -- the running thread ------------------------------------------------------------------
    def start(self, kind: int, request_json: str) -> None:
        what = "chat request" if kind == CHAT else "completion request"
        body = parse_object(request_json, what)
        fields = validate(body, CHAT_FIELDS if kind == CHAT else COMPLETION_FIELDS, what)
        params = sampling_params(fields)
        with self.entry.use() as model:
            self._submit(kind, fields, params, model, what)

    def _submit(self, kind: int, fields: dict[str, Any], params, model, what: str) -> None:
        import time

        from edgellm.engine import EngineClosed, PromptTooLong, QueueFull, Request

        try:
            if kind == CHAT:
                prompt = model.encode(model.apply_chat_template(chat_messages(fields["messages"])))
            else:
                prompt = model.encode(fields["prompt"])
        except ValueError as exc:  # the template refused the messages
            raise CapiError(INVALID_ARGUMENT, f"{what}: {exc}") from None
        if not prompt:
            raise CapiError(INVALID_ARGUMENT, f"{what}: the prompt is empty")
        params = self._bounded(params, fields, len(prompt))
        with self.lock:
            if self.state != "new":
                raise CapiError(BUSY, "this request already ran (a request runs once: create "
                                      "another with edgellm_request_create)")
            if self.cancelled:
                self.state = "done"
                raise CapiError(CANCELLED, "the request was cancelled before it ran")
            self.kind, self.id, self.created = kind, _request_id(kind), int(time.time())
            try:
                self.handle = self.entry.engine.submit(Request(prompt, params,
                                                               request_id=self.id))
            except PromptTooLong as exc:
                raise CapiError(CONTEXT, str(exc)) from None
            except QueueFull as exc:
                raise CapiError(BUSY, str(exc)) from None
            except EngineClosed:
                raise CapiError(INVALID_HANDLE, "the model was freed") from None
            self.state = "running"
            self.events = iter(self.handle)

    def _bounded(self, params, fields: dict[str, Any], prompt_tokens: int):
        """max_tokens within what the sequence budget leaves after the prompt (as the
        server does): all of it when the request does not say, refused when it asks more."""
        from dataclasses import replace

        ctx = self.entry.engine.ctx
        room = ctx - prompt_tokens
        if room < 1:
            raise CapiError(CONTEXT, f"the prompt has {prompt_tokens} tokens but a sequence "
                                     f"holds {ctx} (context_length): shorten it")
        asked = fields.get("max_completion_tokens", fields.get("max_tokens"))
        if asked is None:
            return replace(params, max_tokens=room)
        if asked > room:
            raise CapiError(CONTEXT, f"max_tokens {asked} plus the prompt's {prompt_tokens} "
                                     f"tokens exceed the {ctx}-token context: ask for at most "
                                     f"{room}")
        return params

    def next_chunk(self) -> str | None:
        """The next chunk's JSON, or None when the reply is complete (CapiError(CANCELLED)
        when it was cancelled)."""
        if self.state != "running":
            raise CapiError(BUSY, "this request is not running")
        if self.final is not None:  # the last chunk went out with the previous call
            self._end()
            return None
        event = next(self.events)
        if self.cancelled:  # nothing more after a cancel, even what was generated before it
            while not event.done:
                event = next(self.events)
            self.final = event
            self._end()
            raise CapiError(CANCELLED, "the request was cancelled")
        if event.token is not None:
            self.tokens.append(event.token)
        self.text.append(event.text)
        if not event.done:
            return self._chunk(event)
        self.final = event
        if event.finish_reason == "cancelled":
            self._end()
            raise CapiError(CANCELLED, "the request was cancelled")
        if event.finish_reason == "error":
            self._end()
            raise CapiError(INTERNAL, f"generation failed: {event.error}")
        return self._chunk(event)

    def _end(self) -> None:
        with self.lock:
            self.state = "done"

    def _chunk(self, event) -> str:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == CHAT:
            delta = {"content": event.text}
            if not self.sent_role:
                delta = {"role": "assistant", **delta}
                self.sent_role = True
            choice["delta"] = delta
        else:
            choice["text"] = event.text
        choice["logprobs"] = None
        choice["finish_reason"] = event.finish_reason
        # edgellm's extension: the token ids this chunk's text came from
        choice["token_ids"] = [] if event.token is None else [event.token]
        chunk = self._envelope("chat.completion.chunk" if self.kind == CHAT
                               else "text_completion", choice)
        if event.done:
            chunk["usage"] = self._usage()
        return json.dumps(chunk, ensure_ascii=False)

    def _envelope(self, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.entry.model.name, "choices": [choice]}

    def _usage(self) -> dict[str, int]:
        usage = self.final.usage if self.final is not None else None
        prompt = usage.prompt_tokens if usage else 0
        return {"prompt_tokens": prompt, "completion_tokens": len(self.tokens),
                "total_tokens": prompt + len(self.tokens)}

    def result(self) -> str:
        """The whole reply as one OpenAI object (after the run returned)."""
        if self.state != "done" or self.final is None:
            raise CapiError(BUSY, "the request has not finished: run it (edgellm_chat or "
                                  "edgellm_complete) and let the call return first")
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0}
        if self.kind == CHAT:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=self.final.finish_reason,
                      token_ids=list(self.tokens))
        out = self._envelope("chat.completion" if self.kind == CHAT else "text_completion",
                             choice)
        out["usage"] = self._usage()
        return json.dumps(out, ensure_ascii=False)


# -- the functions the C side calls ----------------------------------------------------------
_models = HandleTable(MODEL_KIND)
_requests = HandleTable(REQUEST_KIND)
_here = threading.local()  # .running: the ModelEntry objects whose request this thread runs


def _running_here() -> list[ModelEntry]:
    if not hasattr(_here, "running"):
        _here.running = []
    return _here.running


def _error_message(exc: BaseException) -> str:
    """One line: what failed and, where the code knows it, what to do."""
    text = str(exc.args[0]) if isinstance(exc, LookupError) and exc.args else str(exc)
    return " ".join(text.split()) or type(exc).__name__


def attach(ffi, lib) -> None:
    """Attach the Python side to the C library's extern "Python" functions (called by the
    library's init code, once, on the first call that needs Python)."""
    if ffi.sizeof("void *") < 8:
        raise RuntimeError("libedgellm needs a 64-bit process (handles are 64-bit)")

    def entry(fn):
        """fn's exceptions become a status and this thread's last error; never raises."""

        def call(*args):
            try:
                return fn(*args)
            except CapiError as exc:
                lib.elm_set_error(_error_message(exc).encode("utf-8", "replace"))
                return exc.status
            except LoadCancelled:
                lib.elm_set_error(b"the load was cancelled by its progress callback")
                return CANCELLED
            except MemoryError:
                lib.elm_set_error(b"out of memory")
                return INTERNAL
            except BaseException as exc:  # noqa: BLE001 - nothing may unwind into C
                message = f"internal error: {type(exc).__name__}: {_error_message(exc)}"
                lib.elm_set_error(message.encode("utf-8", "replace"))
                return INTERNAL

        call.__name__ = fn.__name__
        return ffi.def_extern(name=fn.__name__)(call)

    def text_of(ptr, what: str, status: int = INVALID_ARGUMENT) -> str:
        try:
            return ffi.string(ptr).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CapiError(status, f"{what} is not valid UTF-8: {exc}") from None

    def write_text(text: str, buf, size: int, out_size) -> int:
        """The two-call sizing: the bytes needed (with the NUL) always; the text only when
        it fits; a size query (NULL, 0) is OK."""
        data = text.encode("utf-8") + b"\0"
        out_size[0] = len(data)
        if buf == ffi.NULL and size == 0:
            return OK
        if size < len(data):
            raise CapiError(BUFFER_TOO_SMALL, f"the buffer holds {size} bytes but "
                                              f"{len(data)} are needed (size included in the "
                                              "out-parameter): call again with a larger one")
        ffi.memmove(buf, data, len(data))
        return OK

    @entry
    def elm_py_model_load(options_json, progress_ptr, user_data, out_handle):
        progress = None
        if progress_ptr != ffi.NULL:
            callback = ffi.cast("elm_progress_fn", progress_ptr)

            def progress(fraction: float, stage: str) -> None:
                if callback(user_data, float(fraction), stage.encode()) != 0:
                    raise LoadCancelled()

        model, engine = load_model(text_of(options_json, "options_json", INVALID_JSON), progress)
        out_handle[0] = _models.add(ModelEntry(model, engine))
        return OK

    @entry
    def elm_py_model_free(handle):
        entry_ = _models.get(handle)
        if entry_ in _running_here():
            raise CapiError(BUSY, "edgellm_model_free was called from inside a callback of "
                                  "this model's request: free it after the call returns")
        _models.remove(handle)
        entry_.close()
        del entry_  # the last reference: what the model held goes now, then the caches
        from edgellm.api import release_freed_model

        release_freed_model()
        return OK

    @entry
    def elm_py_model_info(handle, buf, size, out_size):
        entry_ = _models.get(handle)
        with entry_.use():
            info = model_info(entry_)
        return write_text(json.dumps(info, ensure_ascii=False), buf, size, out_size)

    @entry
    def elm_py_tokenize(handle, text, flags, tokens, capacity, out_count):
        with _models.get(handle).use() as model:
            ids = tokenize(model, text_of(text, "text"), int(flags))
        out_count[0] = len(ids)
        if tokens == ffi.NULL and capacity == 0:
            return OK
        if capacity < len(ids):
            raise CapiError(BUFFER_TOO_SMALL, f"the text has {len(ids)} tokens but the buffer "
                                              f"holds {capacity}: call again with a larger one")
        if ids:
            ffi.memmove(tokens, ffi.new("int32_t[]", ids), 4 * len(ids))
        return OK

    @entry
    def elm_py_detokenize(handle, tokens, n_tokens, buf, size, out_size):
        ids = list(ffi.unpack(tokens, n_tokens)) if n_tokens else []
        with _models.get(handle).use() as model:
            text = detokenize(model, ids)
        return write_text(text, buf, size, out_size)

    @entry
    def elm_py_request_create(handle, out_handle):
        entry_ = _models.get(handle)
        request = CRequest(entry_)
        with entry_.lock:
            if entry_.closing:
                raise CapiError(INVALID_HANDLE, "the model was freed")
            entry_.requests.add(request)
        out_handle[0] = _requests.add(request)
        return OK

    @entry
    def elm_py_request_cancel(handle):
        _requests.get(handle).cancel()
        return OK

    @entry
    def elm_py_request_free(handle):
        request = _requests.get(handle)
        with request.lock:
            if request.state == "running":
                raise CapiError(BUSY, "the request is running: cancel it and let "
                                      "edgellm_chat/edgellm_complete return before freeing it")
            _requests.remove(handle)
        with request.entry.lock:
            request.entry.requests.discard(request)
        return OK

    @entry
    def elm_py_run_start(handle, kind, request_json):
        request = _requests.get(handle)
        request.start(int(kind), text_of(request_json, "request_json", INVALID_JSON))
        _running_here().append(request.entry)
        return OK

    @entry
    def elm_py_run_next(handle, chunk_out, length_out):
        request = _requests.get(handle)
        try:
            text = request.next_chunk()
        except BaseException:
            _leave(request.entry)
            raise
        if text is None:
            _leave(request.entry)
            chunk_out[0] = ffi.NULL
            length_out[0] = 0
            return OK
        data = text.encode("utf-8")
        request.chunk = ffi.new("char[]", data)
        chunk_out[0] = request.chunk
        length_out[0] = len(data)
        return OK

    @entry
    def elm_py_request_result(handle, buf, size, out_size):
        return write_text(_requests.get(handle).result(), buf, size, out_size)

    lib.elm_mark_ready()


def _leave(entry: ModelEntry) -> None:
    running = _running_here()
    if entry in running:
        running.remove(entry)
