"""The OpenAI-compatible HTTP front of the engine: an ASGI app (FastAPI on Starlette).

``create_app(engine, model_id, ...)`` builds it; ``edgellm serve`` (apps/serve.py) runs it with
uvicorn. Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as SSE
ending ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus),
``POST /tokenize``, ``POST /detokenize``. Errors are OpenAI error objects
(``{"error": {"message", "type", "param", "code"}}``). Every route but /health needs the API
key when one is set. A client that disconnects cancels its sequences at once: the engine drops
them at its next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from edgellm import __version__
from edgellm.chat import TemplateError
from edgellm.engine import (
    Engine,
    EngineClosed,
    PromptTooLong,
    QueueFull,
    Request,
    RequestHandle,
    TokenEvent,
    TokenLogprob,
)
from edgellm.sampling import SamplingParams
from edgellm.server.metrics import render_metrics
from edgellm.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    Unsupported,
)

logger = logging.getLogger("edgellm.serve")

#: request bodies larger than this are refused (413)
DEFAULT_MAX_BODY_BYTES = 2 << 20
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
          "/tokenize", "/detokenize")


class ApiError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


@dataclass
class ServerState:
    engine: Engine
    model_id: str
    api_key: str | None
    max_body_bytes: int
    http: Counter = field(default_factory=Counter)  # (route, status) -> responses
    started: float = field(default_factory=time.time)


# -- request parsing --------------------------------------------------------------------------
async def read_body(request: HttpRequest, limit: int) -> bytes:
    """The body, refused (413) past ``limit`` bytes whether or not it says its length."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """One line naming the first offending field, and that field's name as ``param``."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    if err.get("type") == "extra_forbidden":
        return (f"unsupported field '{loc}': edgellm does not support it (remove it)", loc)
    return (f"invalid value for '{loc}': {err.get('msg')}" if loc else err.get("msg"), loc or None)


async def parse(request: HttpRequest, schema: type[BaseModel], limit: int) -> Any:
    raw = await read_body(request, limit)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(400, message, param=param) from None


# -- building engine requests -------------------------------------------------------------------
def sampling_params(body: SamplingFields, vocab_size: int) -> SamplingParams:
    """SamplingParams from the request's fields (absent ones keep edgellm's defaults)."""
    given = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
             "min_p": body.min_p, "presence_penalty": body.presence_penalty,
             "frequency_penalty": body.frequency_penalty,
             "repetition_penalty": body.repetition_penalty}
    options = {k: v for k, v in given.items() if v is not None}
    try:
        return SamplingParams(**options, stop=body.stops(), ignore_eos=body.ignore_eos,
                              logit_bias=body.token_bias(vocab_size))
    except Unsupported:
        raise
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None


def engine_requests(engine: Engine, prompts: list[list[int]], body: SamplingFields,
                    limit: int | None, logprobs: int | None, prompt_param: str,
                    request_id: str) -> list[Request]:
    """n requests per prompt (choice i of a prompt gets seed + i), max_tokens bounded by what
    the sequence budget leaves after the prompt."""
    base = sampling_params(body, engine.model.args.vocab_size)
    out = []
    for p, ids in enumerate(prompts):
        if not ids:
            raise ApiError(400, "the prompt is empty", param=prompt_param)
        room = engine.ctx - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but a sequence holds "
                                f"{engine.ctx} (the server's --ctx): shorten it",
                           param=prompt_param, code="context_length_exceeded")
        if limit is not None and limit > room:
            raise ApiError(400, f"max_tokens {limit} plus the prompt's {len(ids)} tokens exceed "
                                f"the {engine.ctx}-token sequence budget: ask for at most "
                                f"{room}", param="max_tokens", code="context_length_exceeded")
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j
            params = replace(base, seed=seed, max_tokens=room if limit is None else limit)
            out.append(Request(ids, params, logprobs, f"{request_id}-{p * body.n + j}"))
    return out


def submit_all(engine: Engine, requests: list[Request],
               deliver: Callable[[int, TokenEvent], None]) -> list[RequestHandle]:
    """Submit every choice's request, or none of them (an error cancels those submitted)."""
    handles: list[RequestHandle] = []
    try:
        for i, r in enumerate(requests):
            handles.append(engine.submit(r, on_event=partial(deliver, i)))
    except BaseException as exc:
        for h in handles:
            h.cancel()
        if isinstance(exc, QueueFull):
            raise ApiError(503, str(exc), "server_error", code="queue_full") from None
        if isinstance(exc, EngineClosed):
            raise ApiError(503, str(exc), "server_error", code="shutting_down") from None
        if isinstance(exc, PromptTooLong):
            raise ApiError(400, str(exc), code="context_length_exceeded") from None
        if isinstance(exc, ValueError):
            raise ApiError(400, str(exc)) from None
        raise
    return handles


# -- response records ------------------------------------------------------------------------------
def token_text(tokenizer, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token, special=True)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprob(tokenizer, lp: TokenLogprob) -> dict:
    text, raw = token_text(tokenizer, lp.token)
    top = []
    for t, v in lp.top:
        tt, tb = token_text(tokenizer, t)
        top.append({"token": tt, "logprob": v, "bytes": tb})
    return {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    event: TokenEvent | None = None  # the last one


def usage_record(choices: list[Choice], n: int) -> dict:
    """OpenAI usage: each distinct prompt counted once, every choice's completion tokens."""
    prompt = cached = completion = 0
    for i, c in enumerate(choices):
        u = c.event.usage if c.event else None
        if u is None:
            continue
        completion += u.completion_tokens
        if i % n == 0:
            prompt += u.prompt_tokens
            cached += u.cached_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Exchange:
    """One HTTP request's choices in flight: their events arrive on the event loop's queue."""

    def __init__(self, app_state: ServerState, request: HttpRequest, kind: str,
                 body: SamplingFields, requests: list[Request]):
        self.state, self.http, self.kind, self.body = app_state, request, kind, body
        self.id = requests[0].request_id.rsplit("-", 1)[0]
        self.created = int(time.time())
        self.queue: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.choices = [Choice() for _ in requests]
        self.started = time.perf_counter()
        self.handles = submit_all(app_state.engine, requests, self._deliver)

    def _deliver(self, index: int, event: TokenEvent) -> None:  # on the engine's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def record(self, index: int, event: TokenEvent) -> Choice:
        c = self.choices[index]
        c.event = event
        c.text.append(event.text)
        if event.logprob is not None:
            c.logprobs.append(event.logprob)
        if event.done:
            c.finish_reason = event.finish_reason
        return c

    def log_info(self, stream: bool) -> None:
        """What the request log line says about tokens (read by the logging middleware)."""
        usage = usage_record(self.choices, self.body.n)
        seconds = time.perf_counter() - self.started
        reasons = sorted({c.finish_reason or "cut" for c in self.choices})
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        self.http.state.log = (
            f"prompt={usage['prompt_tokens']} cached={cached}"
            f" completion={usage['completion_tokens']} n={len(self.choices)}"
            f" {usage['completion_tokens'] / max(seconds, 1e-9):.1f} t/s"
            f"{' stream' if stream else ''} finish={','.join(reasons)}")

    def check_error(self, event: TokenEvent) -> None:
        if event.finish_reason == "error":
            raise ApiError(500, f"generation failed: {event.error}", "server_error",
                           code="engine_error")

    # -- non-streaming -------------------------------------------------------------------------
    async def collect(self) -> dict:
        """Wait for every choice (cancelling all of them if the client goes away)."""
        gone = asyncio.ensure_future(wait_for_disconnect(self.http))
        try:
            while not self.finished:
                getter = asyncio.ensure_future(self.queue.get())
                done, _ = await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    raise ClientGone()
                index, event = getter.result()
                self.record(index, event)
                self.check_error(event)
        finally:
            gone.cancel()
            self.cancel()  # no-op for finished choices
            self.log_info(stream=False)
        return self.final_record()

    def final_record(self) -> dict:
        tok = self.state.engine.model.tokenizer
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            if self.kind == "chat":
                logprobs = ({"content": [chat_logprob(tok, lp) for lp in c.logprobs]}
                            if self.wants_logprobs else None)
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": i, "text": text,
                                "logprobs": self.legacy_logprobs(c.logprobs)
                                if self.wants_logprobs else None,
                                "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat"
                else "text_completion", "created": self.created, "model": self.state.model_id,
                "system_fingerprint": f"edgellm-{__version__}", "choices": choices,
                "usage": usage_record(self.choices, self.body.n)}

    @property
    def wants_logprobs(self) -> bool:
        return self.handles[0].request.logprobs is not None

    def legacy_logprobs(self, logprobs: list[TokenLogprob], offset: int = 0) -> dict:
        """/v1/completions' logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tok = self.state.engine.model.tokenizer
        tokens, values, tops, offsets = [], [], [], []
        for lp in logprobs:
            text, _ = token_text(tok, lp.token)
            tokens.append(text)
            values.append(lp.logprob)
            tops.append({token_text(tok, t)[0]: v for t, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    # -- streaming -----------------------------------------------------------------------------
    async def stream(self) -> AsyncIterator[str]:
        """SSE chunks as tokens come; [DONE] at the end. Closing the stream (the client went
        away) cancels every choice still running."""
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        usage_field = {"usage": None} if include_usage else {}
        offsets = [0] * len(self.choices)
        try:
            if self.kind == "chat":
                for i in range(len(self.choices)):
                    yield self.sse(self.chunk(i, {"role": "assistant", "content": ""}, None,
                                              None) | usage_field)
            while not self.finished:
                index, event = await self.queue.get()
                c = self.record(index, event)
                if event.finish_reason == "error":
                    err = ApiError(500, f"generation failed: {event.error}", "server_error",
                                   code="engine_error")
                    yield self.sse(err.body())
                    break
                if not event.text and event.logprob is None and not event.done:
                    continue  # nothing to say yet (text held back for a stop string)
                lp = None
                if event.logprob is not None:
                    lp = ({"content": [chat_logprob(self.tokenizer, event.logprob)]}
                          if self.kind == "chat" else
                          self.legacy_logprobs([event.logprob], offsets[index]))
                offsets[index] += len(event.text)
                delta = {"content": event.text} if event.text or self.kind == "chat" else {}
                if self.kind == "chat" and event.done and not event.text:
                    delta = {}
                yield self.sse(self.chunk(index, delta if self.kind == "chat" else event.text,
                                          lp, c.finish_reason) | usage_field)
            else:
                if include_usage:
                    yield self.sse(self.chunk_base() | {
                        "choices": [], "usage": usage_record(self.choices, self.body.n)})
            yield "data: [DONE]\n\n"
        finally:
            self.cancel()
            self.log_info(stream=True)

    @property
    def tokenizer(self):
        return self.state.engine.model.tokenizer

    def chunk_base(self) -> dict:
        """The fields every streamed chunk carries."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.state.model_id, "system_fingerprint": f"edgellm-{__version__}"}

    def chunk(self, index: int, delta: Any, logprobs: dict | None,
              finish_reason: str | None) -> dict:
        if self.kind == "chat":
            choice = {"index": index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        return self.chunk_base() | {"choices": [choice]}

    @staticmethod
    def sse(record: dict) -> str:
        return f"data: {json.dumps(record, ensure_ascii=False)}\n\n"


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def wait_for_disconnect(request: HttpRequest) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- the app ---------------------------------------------------------------------------------------
class RequestLog:
    """ASGI middleware: one log line per request (status, tokens, t/s, time) and the counts
    of responses by route and status for /metrics."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 0}
        start = time.perf_counter()

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            code = status["code"] or 499  # no response started: the client went away
            path = scope.get("path", "")
            route = path if path in ROUTES else "other"
            self.state.http[(route, code)] += 1
            extra = scope.get("state", {}).get("log", "")
            client = scope.get("client") or ("-", 0)
            logger.info("%s %s %s %d %s %.2fs", client[0], scope.get("method", ""), path, code,
                        extra, time.perf_counter() - start)


def create_app(engine: Engine, model_id: str, *, api_key: str | None = None,
               cors_origins: tuple[str, ...] = (),
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The server's ASGI app over ``engine``; requests must name ``model_id``."""
    state = ServerState(engine, model_id, api_key or None, max_body_bytes)
    app = FastAPI(title="edgellm", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    app.add_middleware(RequestLog, state=state)
    if cors_origins:  # off unless asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"])
    _add_error_handlers(app)
    model = engine.model

    async def check_key(request: HttpRequest) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                  state.api_key.encode()):
            raise ApiError(401, "missing or incorrect API key: send 'Authorization: Bearer "
                                "KEY' with the server's --api-key", code="invalid_api_key")

    auth = [Depends(check_key)]

    def check_model(name: str) -> None:
        if name != state.model_id:
            raise ApiError(404, f"the model '{name}' does not exist: this server serves "
                                f"'{state.model_id}'", param="model", code="model_not_found")

    async def respond(request: HttpRequest, kind: str, body: SamplingFields,
                      prompts: list[list[int]], prompt_param: str) -> Response:
        limit = body.limit()
        logprobs = body.logprob_count()
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        requests = engine_requests(engine, prompts, body, limit, logprobs, prompt_param,
                                   f"{prefix}-{uuid.uuid4().hex[:24]}")
        exchange = Exchange(state, request, kind, body, requests)
        if body.stream:
            # the background task cancels the choices even when the client leaves before
            # the stream's generator ever ran (its finally would not)
            return StreamingResponse(exchange.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(exchange.cancel))
        try:
            return JSONResponse(await exchange.collect())
        except ClientGone:
            return Response(status_code=499)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: HttpRequest) -> Response:
        body = await parse(request, ChatCompletionRequest, state.max_body_bytes)
        check_model(body.model)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in body.messages]
        try:
            ids = model.encode(model.apply_chat_template(messages))
        except TemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return await respond(request, "chat", body, [ids], "messages")

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: HttpRequest) -> Response:
        body = await parse(request, CompletionRequest, state.max_body_bytes)
        check_model(body.model)
        prompts = [model.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]
        if len(prompts) * body.n > 16:
            raise ApiError(400, f"{len(prompts)} prompts x n={body.n} choices: at most 16",
                           param="n")
        return await respond(request, "text", body, prompts, "prompt")

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> dict:
        return {"object": "list", "data": [model_record(state)]}

    @app.get("/v1/models/{name:path}", dependencies=auth)
    async def get_model(name: str) -> dict:
        check_model(name)
        return model_record(state)

    @app.get("/health")
    async def health() -> dict:
        stats = engine.stats()
        return {"status": "ok", "slots_free": stats.slots_free, "queue": stats.queue_depth}

    @app.get("/metrics", dependencies=auth)
    async def metrics() -> Response:
        return PlainTextResponse(render_metrics(engine.stats(), state.http),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: HttpRequest) -> dict:
        body = await parse(request, TokenizeRequest, state.max_body_bytes)
        if body.model is not None:
            check_model(body.model)
        ids = (model.encode(body.content) if body.add_special
               else model.tokenizer.encode(body.content))
        if body.with_pieces:
            return {"tokens": [{"id": t, "piece": token_text(model.tokenizer, t)[0]}
                               for t in ids]}
        return {"tokens": ids}

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: HttpRequest) -> dict:
        body = await parse(request, DetokenizeRequest, state.max_body_bytes)
        if body.model is not None:
            check_model(body.model)
        vocab = model.args.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of the vocabulary (0..{vocab - 1})",
                           param="tokens")
        return {"content": model.tokenizer.decode(body.tokens)}

    return app


def model_record(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": int(state.started),
            "owned_by": "edgellm"}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(Unsupported)
    async def unsupported(request, exc: Unsupported):
        return ApiError(400, str(exc), param=exc.param, code="unsupported").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        param=None, code=code).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return ApiError(400, str(exc.errors()[0].get("msg", exc))).response()

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}", "server_error",
                        code="internal_error").response()
