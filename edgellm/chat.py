"""Chat templates (the model's own Jinja template, rendered in a sandbox) and ``ChatSession``,
the conversation state that keeps the KV cache warm across turns.

GGUF files carry the HF chat template in ``tokenizer.chat_template``. It is untrusted text,
so it runs in Jinja's immutable sandbox, bounded in steps, time and size
(``edgellm.template_sandbox``). Models without one get a plain ChatML fallback.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2

from edgellm.atomic import atomic_write_text
from edgellm.cache import POLICIES, ContextOverflow
from edgellm.generate import GenerationResponse, stream_generate
from edgellm.sampling import SamplingParams
from edgellm.template_sandbox import make_environment, render_bounded

if TYPE_CHECKING:
    from edgellm.api import Model
    from edgellm.cache import KVCache

#: Used when a model file has no template: ChatML, which most small chat models know.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}


class TemplateError(ValueError):
    """The chat template failed to render (a bug in the template or unsupported messages)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = make_environment()  # the immutable sandbox, bounded in steps, time and size
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"the model's chat template does not parse: {exc}") from None


def render_chat(template: str | None, messages: Sequence[Message], *, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages`` under ``template`` (the fallback when None)."""
    if template is not None and not isinstance(template, str):
        raise TemplateError(f"the model's chat template is a {type(template).__name__}, "
                            "not text: the file is corrupt")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise TemplateError(f"a chat message needs 'role' and 'content': {m!r}")
    try:
        return render_bounded(
            _compile(template or FALLBACK_TEMPLATE), passthrough=(TemplateError,),
            messages=list(messages),
            bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the model's chat template failed: {exc}") from None


# -- conversation state --------------------------------------------------------------------

SESSION_FORMAT = 1  # version of the JSON written by ChatSession.save


@dataclass
class Notice:
    """Something the user should be told about a turn (never printed by the library)."""

    kind: str  # "truncated": old turns dropped to fit the budget; "cache-reset": KV rebuilt
    message: str
    dropped: list[Message] = field(default_factory=list)


@dataclass
class TurnStats:
    """What one reply cost: prefill and decode speed, tokens, and how full the KV cache is."""

    prompt_tokens: int  # tokens prefilled for this turn (the new part only)
    reused_tokens: int  # tokens of the conversation already in the cache (not prefilled)
    generation_tokens: int
    ttft_s: float
    prompt_tps: float
    generation_tps: float
    kv_used: int  # tokens held in the cache after the reply
    kv_budget: int  # tokens the cache can hold
    finish_reason: str  # "stop" | "length" | "context" | "cut"
    draft: dict = field(default_factory=dict)  # speculative decoding stats, when a draft ran


ChatEvent = GenerationResponse | Notice


class ChatSession:
    """A conversation with a model that keeps its KV cache warm between turns.

    Each turn renders the whole conversation with the model's chat template, finds the
    longest common token prefix with what the cache already holds, trims the cache back to
    it and prefills only the rest. ``send`` and ``regen`` stream ``GenerationResponse``
    pieces (and ``Notice``s); stopping early (``close()`` on the stream, or an exception)
    keeps the partial reply in the history, marked ``"cut": True``.
    """

    def __init__(self, model: Model, params: SamplingParams | None = None, *,
                 system: str | None = None, cache: KVCache | None = None,
                 policy: str = "truncate-turns", generate_options: dict | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown overflow policy {policy!r}: use one of {POLICIES}")
        self.model = model
        self.params = params or SamplingParams()
        self.policy = policy
        self.system = system
        self.messages: list[Message] = []  # user/assistant turns; the system prompt is apart
        self.cache = cache if cache is not None else self._make_cache()
        self.generate_options = dict(generate_options or {})  # extra stream_generate kwargs
        self.last_stats: TurnStats | None = None
        self._cached_ids: list[int] = []  # the tokens the cache holds, in order

    # -- conversation -----------------------------------------------------------------------
    def send(self, text: str) -> Iterator[ChatEvent]:
        """Add a user turn and stream the assistant's reply."""
        self.messages.append({"role": "user", "content": text})
        return self._reply(added_user=True)

    def regen(self) -> Iterator[ChatEvent]:
        """Drop the last assistant reply and stream a new one to the same user turn."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            raise ValueError("nothing to regenerate: send a message first")
        return self._reply()

    def clear(self) -> None:
        """Forget the turns (the system prompt stays); the cache is reused where it matches."""
        self.messages.clear()
        self.last_stats = None

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (None or "" = the template's default)."""
        self.system = text or None

    def set_params(self, **changes: Any) -> SamplingParams:
        """Change sampling parameters by name (validated by SamplingParams)."""
        self.params = replace(self.params, **changes)
        return self.params

    def conversation(self) -> list[Message]:
        """The messages the template sees: the system prompt, then the turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": m["role"], "content": m["content"]} for m in self.messages]

    # -- budget -----------------------------------------------------------------------------
    @property
    def kv_used(self) -> int:
        return self.cache.offset

    @property
    def kv_budget(self) -> int:
        return self.cache.max_tokens

    def reply_reserve(self) -> int:
        """Cache slots kept free for the reply: max_tokens, at most half the budget."""
        return min(self.params.max_tokens, self.kv_budget // 2)

    def _drop_oldest_turns_to_fit(self, prompt_len: int) -> list[Message]:
        """truncate-turns: drop the oldest user/assistant pair (never the system prompt or
        the newest user turn) while the prompt plus the reply reserve overflows the budget.

        Returns the dropped messages; the caller re-renders after each drop, so this drops
        one pair per call and returns [] when nothing fits or nothing needs dropping.
        """
        if prompt_len + self.reply_reserve() <= self.kv_budget or len(self.messages) < 2:
            return []
        dropped = [self.messages.pop(0)]
        if self.messages and self.messages[0]["role"] == "assistant" and len(self.messages) > 1:
            dropped.append(self.messages.pop(0))
        return dropped

    def _render_within_budget(self) -> tuple[list[int], list[Notice]]:
        """The prompt ids of the conversation, after applying the overflow policy."""
        notices: list[Notice] = []
        while True:
            ids = self.model.encode(self.model.apply_chat_template(self.conversation()))
            dropped = (self._drop_oldest_turns_to_fit(len(ids))
                       if self.policy == "truncate-turns" else [])
            if not dropped:
                break
            notices.append(Notice("truncated", _describe_dropped(dropped, self.kv_budget),
                                  dropped))
        if len(ids) >= self.kv_budget and self.policy != "rotate":
            raise ContextOverflow(
                f"the conversation needs {len(ids)} tokens but the KV budget is "
                f"{self.kv_budget}: /clear, shorten the message, or raise --ctx")
        return ids, notices

    # -- prompt cache -----------------------------------------------------------------------
    def _reuse_prefix(self, ids: Sequence[int]) -> int:
        """Trim the cache to its longest common prefix with ``ids``; return that length.

        At least one token is always left to prefill: the reply needs fresh logits. A
        rotating cache that can no longer roll back that far starts afresh.
        """
        common = _common_prefix_len(self._cached_ids, ids)
        common = min(common, len(ids) - 1, self.cache.offset)
        if self.cache.offset - common > self.cache.max_trim():
            self._reset_cache()
            return 0
        self.cache.trim(self.cache.offset - common)
        del self._cached_ids[common:]
        return common

    def _reset_cache(self) -> None:
        """Start the cache afresh (an interrupt inside a forward pass may leave it uneven)."""
        self.cache = self._make_cache(self.cache.max_tokens)
        self._cached_ids = []

    def _make_cache(self, max_tokens: int | None = None) -> KVCache:
        """A cache with this session's overflow policy ("rotate" needs a rotating cache)."""
        return self.model.make_cache(max_tokens, policy=self.policy)

    # -- one reply --------------------------------------------------------------------------
    def _reply(self, added_user: bool = False) -> Iterator[ChatEvent]:
        try:
            ids, notices = self._render_within_budget()
        except TemplateError:  # the template refused: the turn is not kept, the chat goes on
            if added_user and self.messages and self.messages[-1]["role"] == "user":
                self.messages.pop()
            raise
        yield from notices
        reused = self._reuse_prefix(ids)
        tokens: list[int] = []
        pieces: list[str] = []
        last: GenerationResponse | None = None
        finished = broken = False
        evicted_before = self.cache.evicted
        told = False
        try:
            for r in stream_generate(self.model, ids[reused:], self.params, cache=self.cache,
                                     history=ids[:reused], **self.generate_options):
                if r.token is not None:
                    tokens.append(r.token)
                pieces.append(r.text)
                last = r
                if not told and self.cache.evicted > evicted_before:  # once a turn
                    told = True
                    yield self._rotation_notice()
                yield r
            finished = True
        except GeneratorExit:  # the consumer stopped between tokens: the cache is consistent
            raise
        except BaseException:  # e.g. KeyboardInterrupt inside a forward pass
            broken = True
            raise
        finally:
            self._end_turn(ids, reused, tokens, "".join(pieces), last,
                           cut=not finished, broken=broken)

    def _rotation_notice(self) -> Notice:
        """A rotating cache has begun letting the oldest tokens go (told once a turn)."""
        return Notice("rotated", f"the KV budget of {self.kv_budget} tokens is full: rotating, "
                                 f"{self.cache.evicted} of the oldest tokens let go so far "
                                 f"(the first {self.cache.config.keep} stay)")

    def _end_turn(self, ids: list[int], reused: int, tokens: list[int], text: str,
                  last: GenerationResponse | None, cut: bool, broken: bool) -> None:
        """Record the reply (marked when cut) and what the cache now holds."""
        reply: Message = {"role": "assistant", "content": text}
        if cut:
            reply["cut"] = True
        self.messages.append(reply)
        held = ids + tokens  # the cache always holds a prefix of these ...
        if broken or self.cache.offset > len(held):  # ... unless a forward pass was cut
            self._reset_cache()
        else:
            self._cached_ids = held[: self.cache.offset]
        finish = "cut" if cut else (last.finish_reason if last else "stop") or "stop"
        self.last_stats = TurnStats(
            prompt_tokens=len(ids) - reused, reused_tokens=reused,
            generation_tokens=last.generation_tokens if last else 0,
            ttft_s=last.ttft_s if last else 0.0, prompt_tps=last.prompt_tps if last else 0.0,
            generation_tps=last.generation_tps if last else 0.0,
            kv_used=self.kv_used, kv_budget=self.kv_budget, finish_reason=finish,
            draft=dict(last.extra.get("speculative", {})) if last else {},
        )

    # -- persistence ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The conversation and sampling parameters as JSON-ready data."""
        params = asdict(self.params)
        params["stop"] = list(self.params.stop)
        params["logit_bias"] = {str(k): v for k, v in self.params.logit_bias.items()}
        return {"format": SESSION_FORMAT, "model": self.model.name, "system": self.system,
                "params": params, "messages": [dict(m) for m in self.messages]}

    def load_dict(self, data: dict[str, Any]) -> None:
        """Replace the conversation and parameters with saved ones (see ``to_dict``)."""
        if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
            raise ValueError("not a saved chat: expected a JSON object with 'messages'")
        for m in data["messages"]:
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or \
                    not isinstance(m.get("content"), str):
                raise ValueError(f"not a saved chat: bad message {m!r}")
        system = data.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"not a saved chat: 'system' is a {type(system).__name__}, "
                             "not text")
        self.params = SamplingParams(**_saved_params(data.get("params")))
        self.system = system or None
        self.messages = [dict(m) for m in data["messages"]]
        self.last_stats = None

    def save(self, path: str | os.PathLike) -> Path:
        """Write the conversation and parameters as JSON (atomically); returns the path."""
        path = Path(path).expanduser()
        # temporary name, fsync, rename: a crash mid-save leaves the previous file intact
        return atomic_write_text(path, json.dumps(self.to_dict(), ensure_ascii=False,
                                                  indent=2) + "\n")

    def load(self, path: str | os.PathLike) -> None:
        """Restore a conversation written by ``save``."""
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
        self.load_dict(data)


def _saved_params(raw: Any) -> dict[str, Any]:
    """SamplingParams fields from a saved chat, each checked for its type (a hand-edited or
    damaged file gets one ValueError naming the field; unknown fields are ignored)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"not a saved chat: 'params' is a {type(raw).__name__}, not an object")

    def bad(name: str, want: str) -> ValueError:
        return ValueError(f"not a saved chat: params.{name} should be {want}, "
                          f"not {raw[name]!r:.40}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    out: dict[str, Any] = {}
    for f in fields(SamplingParams):
        if f.name not in raw:
            continue
        value = raw[f.name]
        if f.name == "stop":
            if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
                raise bad(f.name, "a list of strings")
            value = tuple(value)
        elif f.name == "logit_bias":
            if not isinstance(value, dict):
                raise bad(f.name, "an object of token id -> bias")
            try:
                value = {int(k): float(v) for k, v in value.items()
                         if not isinstance(v, bool)}
            except (TypeError, ValueError, OverflowError):
                raise bad(f.name, "an object of token id -> bias") from None
        elif f.name == "ignore_eos":
            if not isinstance(value, bool):
                raise bad(f.name, "true or false")
        elif f.name == "seed":
            if value is not None and not is_int(value):
                raise bad(f.name, "an integer or null")
        elif isinstance(f.default, int) and not isinstance(f.default, bool):
            if not is_int(value):
                raise bad(f.name, "an integer")
        elif isinstance(f.default, float):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise bad(f.name, "a number")
            value = float(value)
        out[f.name] = value
    return out


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _describe_dropped(dropped: list[Message], budget: int) -> str:
    first = dropped[0]["content"].strip().splitlines()[0] if dropped[0]["content"].strip() else ""
    preview = first if len(first) <= 40 else first[:37] + "..."
    what = "the oldest turn" if len(dropped) > 1 else "the oldest message"
    return f"dropped {what} to fit the {budget}-token budget: {preview!r}"
