"""The public entry points: ``load()`` and the ``Model`` it returns."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from edgellm.backends import Backend, get_backend
from edgellm.cache import CacheConfig, CachePlan, KVCache, default_context, plan_cache
from edgellm.chat import Message, render_chat
from edgellm.config import ModelArgs
from edgellm.converters.gguf_reader import read_gguf
from edgellm.models import build_model
from edgellm.store import resolve_model
from edgellm.tokenizer import Tokenizer

#: metadata arrays the tokenizer takes over at load (Qwen's merges and Gemma's 262k tokens are
#: tens of MB of Python strings); ``Model.metadata`` keeps everything else
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                    "tokenizer.ggml.token_type")


@dataclass
class Model:
    """A loaded model: the network over a backend, its tokenizer, and its file's metadata
    (less ``TOKENIZER_ARRAYS``: the tokenizer holds the vocabulary)."""

    path: Path
    metadata: dict[str, Any]
    args: ModelArgs
    net: Any  # the architecture's Model (edgellm.models.*)
    tokenizer: Tokenizer
    backend: Backend
    context_length: int  # tokens the default cache holds
    cache_config: CacheConfig = field(default_factory=CacheConfig)  # dtype, policy, keep

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


def load(model: str | os.PathLike = "qwen2.5-coder-0.5b-instruct", backend: str = "auto",
         threads: int | None = None, context_length: int | None = None,
         cache: CacheConfig | None = None) -> Model:
    """Load a model by catalog name or ``.gguf`` path onto a backend ("auto" = fastest here).

    ``context_length`` caps the default KV cache (default: the model's own, at most 4096).
    ``cache`` sets the KV cache's budget (``max_tokens``/``max_bytes``: a byte budget sets the
    context to the most tokens that fit), storage dtype and overflow policy.
    """
    path = resolve_model(model)
    gguf = read_gguf(path)
    options = {"threads": threads} if threads else {}
    be = get_backend(backend, **options)
    net = build_model(gguf.metadata, gguf.tensors, be)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
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
    return model


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing).

    Loading frees tens of MB in small blocks (the vocabulary's interim lists, the tokenizer's
    construction, weight repacking) that malloc would otherwise keep: 15 MB of the 0.5B's
    resident memory after load.
    """
    try:  # the process's own symbols: no library search (find_library runs a subprocess)
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc
        return
    trim(0)
