"""Chat templates: the model's own Jinja template, rendered in a sandbox.

GGUF files carry the HF chat template in ``tokenizer.chat_template``. It is untrusted text,
so it runs in Jinja's immutable sandbox. Models without one get a plain ChatML fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"the model's chat template does not parse: {exc}") from None


def render_chat(template: str | None, messages: Sequence[Message], *, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True) -> str:
    """The prompt text for ``messages`` under ``template`` (the fallback when None)."""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise TemplateError(f"a chat message needs 'role' and 'content': {m!r}")
    try:
        return _compile(template or FALLBACK_TEMPLATE).render(
            messages=list(messages), bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"the model's chat template failed: {exc}") from None
