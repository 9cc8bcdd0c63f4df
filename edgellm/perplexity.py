"""Perplexity of a model over a text: llama.cpp's chunked method, or one stream through a
budgeted (e.g. rotating) cache as in StreamingLLM. Library code: progress goes to a callback.

Chunked (``chunked_perplexity``), as llama.cpp's ``llama-perplexity``: the file is tokenized
once (BOS first for models that add one); it is cut into ``len // ctx`` non-overlapping
chunks of ``ctx`` tokens; each chunk is evaluated from an empty cache, its first token
replaced by BOS for models that add one; the tokens of the chunk's second half are scored
(positions ``ctx/2 .. ctx-2`` predict the next token, ``ctx/2 - 1`` tokens a chunk).

Streaming (``streaming_perplexity``): the whole token stream goes through one cache in
batches of ``batch`` tokens and every token after the first is scored; with a small budget
and ``policy="rotate"`` this measures what a conversation that outgrows its context sees.

Both report ``ppl = exp(mean nll)`` and llama.cpp's uncertainty: the standard error of the
mean nll, ``sqrt((E[nll^2] - E[nll]^2) / (N - 1))``, times ``ppl``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from edgellm.cache import CacheConfig

# progress(done_tokens, total_tokens, running_ppl)
Progress = Callable[[int, int, float], None]


@dataclass
class NllSum:
    """Running sums of the negative log-likelihoods of scored tokens."""

    count: int = 0
    total: float = 0.0
    squares: float = 0.0

    def add(self, nll: np.ndarray) -> None:
        nll = np.asarray(nll, dtype=np.float64)
        self.count += int(nll.size)
        self.total += float(nll.sum())
        self.squares += float(np.square(nll).sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.total / self.count) if self.count else float("nan")

    @property
    def ppl_error(self) -> float:
        """llama.cpp's ``+/-``: standard error of the mean nll, scaled by the ppl."""
        if self.count < 2:
            return float("nan")
        mean = self.total / self.count
        var = self.squares / self.count - mean * mean
        return math.sqrt(max(var, 0.0) / (self.count - 1)) * self.ppl


@dataclass
class PerplexityResult:
    """What a perplexity run measured."""

    mode: str  # "chunked" | "stream"
    ppl: float
    ppl_error: float
    scored: int  # tokens whose probability was scored
    tokens: int  # tokens evaluated (forward passes over them)
    seconds: float
    ctx: int
    details: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row: logits (n, vocab), targets (n,) -> (n,) f64."""
    logits = np.asarray(logits, dtype=np.float32)
    top = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(axis=-1, dtype=np.float64)) + top[:, 0]
    return lse - logits[np.arange(len(targets)), targets].astype(np.float64)


def tokenize_for_perplexity(model, text: str) -> list[int]:
    """The file's ids as llama-perplexity makes them: BOS per the model, specials as text."""
    return model.tokenizer.encode(text, parse_special=False)


def chunked_perplexity(model, tokens: Sequence[int], ctx: int, *,
                       progress: Progress | None = None, max_chunks: int | None = None,
                       kv_dtype: str = "float16") -> PerplexityResult:
    """llama.cpp's chunked perplexity with ``ctx``-token chunks (see the module docstring)."""
    if ctx < 4:
        raise ValueError(f"--ctx {ctx} is too small for chunked perplexity (at least 4)")
    n_chunks = len(tokens) // ctx
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    if len(tokens) < 2 * ctx:
        raise ValueError(f"need at least {2 * ctx} tokens for a context of {ctx}; the text "
                         f"has {len(tokens)}: use a longer file or a smaller --ctx")
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    first = ctx // 2
    sums = NllSum()
    cache = model.make_cache(ctx, policy="error", dtype=kv_dtype)
    start = time.perf_counter()
    for c in range(n_chunks):
        chunk = np.array(tokens[c * ctx:(c + 1) * ctx], dtype=np.int64)  # (ctx,)
        if bos is not None:
            chunk[0] = bos
        cache.reset()
        model.net.forward(chunk[:first], cache)  # the first half only gives context
        logits = model.net.forward(chunk[first:], cache, all_logits=True)  # (ctx - first, V)
        sums.add(token_nll(logits[:-1], chunk[first + 1:]))
        if progress:
            progress((c + 1) * ctx, n_chunks * ctx, sums.ppl)
    seconds = time.perf_counter() - start
    return PerplexityResult("chunked", sums.ppl, sums.ppl_error, sums.count, n_chunks * ctx,
                            seconds, ctx, {"chunks": n_chunks})


def streaming_perplexity(model, tokens: Sequence[int], cache_config: CacheConfig, *,
                         batch: int = 64, progress: Progress | None = None,
                         max_tokens: int | None = None) -> PerplexityResult:
    """Every token of one stream scored through a cache built from ``cache_config``.

    ``batch`` tokens go through the model per forward pass (prefill speed); the cache's mask
    makes the result the same as token-by-token decoding (up to the sinks' re-basing within
    a batch, see ``edgellm.cache``). A non-rotating cache smaller than the stream raises
    ``ContextOverflow``.
    """
    ids = np.asarray(tokens[:max_tokens] if max_tokens else tokens, dtype=np.int64)
    if len(ids) < 2:
        raise ValueError("need at least 2 tokens to score a stream")
    options = {k: v for k, v in asdict(cache_config).items() if k != "max_tokens"}
    cache = model.make_cache(cache_config.max_tokens, **options)
    sums = NllSum()
    start = time.perf_counter()
    for at in range(0, len(ids) - 1, batch):
        feed = ids[at:min(at + batch, len(ids) - 1)]  # (n,) the last token is only a target
        logits = model.net.forward(feed, cache, all_logits=True)  # (n, V)
        sums.add(token_nll(logits, ids[at + 1:at + 1 + len(feed)]))
        if progress:
            progress(at + len(feed), len(ids) - 1, sums.ppl)
    seconds = time.perf_counter() - start
    details = {"policy": cache.policy, "keep": cache.config.keep, "kv_bytes": cache.nbytes,
               "evicted": cache.evicted, "batch": batch}
    return PerplexityResult("stream", sums.ppl, sums.ppl_error, sums.count, len(ids) - 1,
                            seconds, cache.max_tokens, details)
