"""Request bodies of the OpenAI-compatible endpoints (pydantic), and their translation into
engine ``Request``s.

Every model forbids fields it does not know, so a field edgellm does not support is a 400
naming it, never silently ignored. Types are strict (``"5"`` is not an integer). Fields that
exist in OpenAI's API but that edgellm cannot honour (``tools``, ``echo``, ``best_of`` > 1,
images, ...) are refused the same way.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

#: most stop strings one request may give, and their longest length
MAX_STOPS = 16
MAX_STOP_CHARS = 256
#: most choices per request (n, times the prompts of a completion)
MAX_CHOICES = 16


class Unsupported(ValueError):
    """A request uses a feature edgellm does not support (HTTP 400 naming ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(Strict):
    type: Literal["text"]


class SamplingFields(Strict):
    """What chat and text completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's own logs: no effect here
    ignore_eos: bool = False  # extension (llama-server's name): generate through EOS

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise Unsupported("stop", f"at most {MAX_STOPS} stop strings, not {len(stops)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise Unsupported("stop", f"stop strings must be 1..{MAX_STOP_CHARS} characters")
        return tuple(stops)

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise Unsupported("logit_bias", f"logit_bias key {key!r} is not a token id "
                                                f"(0..{vocab_size - 1})")
            if not -100 <= value <= 100:
                raise Unsupported("logit_bias", f"logit_bias values must be in [-100, 100], "
                                                f"not {value}")
            bias[int(key)] = float(value)
        return bias


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    def limit(self) -> int | None:
        if self.max_completion_tokens is not None and self.max_tokens is not None \
                and self.max_completion_tokens != self.max_tokens:
            raise Unsupported("max_completion_tokens", "max_tokens and max_completion_tokens "
                                                       "differ: give one of them")
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def logprob_count(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise Unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default

    def logprob_count(self) -> int | None:
        if self.echo:
            raise Unsupported("echo", "echo is not supported: leave it out or false")
        if self.suffix:
            raise Unsupported("suffix", "suffix (fill-in-the-middle) is not supported")
        if self.best_of not in (None, 1, self.n):
            raise Unsupported("best_of", "best_of other than n is not supported")
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts: texts or token lists (a list of ints is one tokenized prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise Unsupported("prompt", "prompt is empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TokenizeRequest(Strict):
    content: str
    add_special: bool = True  # BOS as the model file says
    with_pieces: bool = False
    model: str | None = None


class DetokenizeRequest(Strict):
    tokens: list[int]
    model: str | None = None
