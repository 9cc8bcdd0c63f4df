"""Llama family (Llama 2/3.x, SmolLM2, Mistral): pre-norm decoder, GQA, SwiGLU, RoPE.

GGUF stores Llama's Q and K weights permuted for ggml's adjacent-pair RoPE (NORM mode), so
RoPE here rotates pairs (x[2i], x[2i+1]). Qwen2 subclasses this with half-split RoPE.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from edgellm.backends.base import BlockShape
from edgellm.cache import (
    CacheConfig,
    KVCache,
    LayerCache,
    LayerSpec,
    build_cache,
    default_context,
    with_budget,
)
from edgellm.config import ModelArgs
from edgellm.converters.gguf_reader import QTensor

#: prompt tokens per forward pass: bounds prefill's activations whatever the prompt's length.
#: 256 lowered the 0.5B's 512-token peak RSS from 572 MiB to its 558 MiB load peak, but cost
#: the 1.5B 7-10% of its pp512 (each slice expands every weight again), so 512
PREFILL_CHUNK = 512


def claim_runs(layer_lists: Sequence[Sequence[LayerCache]]) -> tuple[list[int], list[int]]:
    """``claim_slots`` for each block's layer caches: slots and firsts, block-major."""
    slots, firsts = [], []
    for layers in layer_lists:
        s, f = claim_slots(layers)
        slots += s
        firsts += f
    return slots, firsts


def claim_slots(layers: Sequence[LayerCache]) -> tuple[list[int], list[int]]:
    """Book the next token of each layer cache (``LayerCache.claim_one``): each one's slot
    and the first slot its query sees, as ``Backend.attention_append`` takes them."""
    claims = [layer.claim_one() for layer in layers]
    return [c[0] for c in claims], [c[1] for c in claims]


@dataclass
class AttentionWeights:
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    bq: Any = None
    bk: Any = None
    bv: Any = None
    q_norm: Any = None  # (hd,) per-head RMSNorm of queries (Gemma 3, Qwen3)
    k_norm: Any = None


@dataclass
class Block:
    attn_norm: Any
    attn: AttentionWeights
    ffn_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    post_attn_norm: Any = None  # Gemma-style norms on the sublayer outputs
    post_ffn_norm: Any = None

    def matrices(self) -> tuple:
        """The block's weight matrices in the order a forward pass reads them: Q, K, V,
        output, gate, up, down."""
        a = self.attn
        return a.wq, a.wk, a.wv, a.wo, self.w_gate, self.w_up, self.w_down


class Model:
    """A decoder-only transformer over a backend's ops.

    ``forward(tokens, cache)`` runs n new tokens (1 in decode, many in prefill or speculative
    verification) and returns f32 numpy logits: (1, vocab) for the last token, or (n, vocab).
    """

    rope_neox = False  # ggml NORM mode: adjacent pairs
    embed_scale = 1.0
    activation = "silu"

    def __init__(self, args: ModelArgs, backend, tensors: dict[str, QTensor]):
        self.args, self.backend = args, backend
        self._tensors = tensors
        self.tok_embd = backend.prepare_embedding(self._require("token_embd.weight"))
        out = tensors.get("output.weight") or tensors["token_embd.weight"]  # tied when absent
        self.output = backend.prepare(out)
        self.output_norm = backend.prepare_vector(self._require("output_norm.weight"))
        freqs = tensors.get("rope_freqs.weight")
        self.rope_freqs = freqs.dequantize() if freqs is not None else None
        self.blocks = [self._load_block(i) for i in range(args.n_layers)]
        self._block_plans: list | None = None  # the backend's whole-block decode, built lazily
        del self._tensors

    # -- loading -------------------------------------------------------------------------
    def _require(self, name: str) -> QTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise ValueError(f"{self.args.architecture} model file lacks tensor {name!r}") from None

    def _weight(self, name: str) -> Any:
        return self.backend.prepare(self._require(name))

    def _vector(self, name: str, optional: bool = False) -> Any:
        if optional and name not in self._tensors:
            return None
        return self.backend.prepare_vector(self._require(name))

    def _load_block(self, i: int) -> Block:
        p = f"blk.{i}."
        attn = AttentionWeights(
            wq=self._weight(p + "attn_q.weight"),
            wk=self._weight(p + "attn_k.weight"),
            wv=self._weight(p + "attn_v.weight"),
            wo=self._weight(p + "attn_output.weight"),
            bq=self._vector(p + "attn_q.bias", optional=True),
            bk=self._vector(p + "attn_k.bias", optional=True),
            bv=self._vector(p + "attn_v.bias", optional=True),
            q_norm=self._vector(p + "attn_q_norm.weight", optional=True),
            k_norm=self._vector(p + "attn_k_norm.weight", optional=True),
        )
        return Block(
            attn_norm=self._vector(p + "attn_norm.weight"),
            attn=attn,
            ffn_norm=self._vector(p + "ffn_norm.weight"),
            w_gate=self._weight(p + "ffn_gate.weight"),
            w_up=self._weight(p + "ffn_up.weight"),
            w_down=self._weight(p + "ffn_down.weight"),
            post_attn_norm=self._vector(p + "post_attention_norm.weight", optional=True),
            post_ffn_norm=self._vector(p + "post_ffw_norm.weight", optional=True),
        )

    # -- per-layer choices (overridden by architectures with local/global layers) --------------
    def layer_window(self, i: int) -> int:
        """Sliding-window size of layer i (0 = full attention)."""
        return self.args.sliding_window

    def layer_rope(self, i: int) -> tuple[float, float]:
        """(theta, freq_scale) of layer i."""
        return self.args.rope_theta, 1.0 / self.args.rope_scale

    def attention_scale(self) -> float:
        return 1.0 / float(np.sqrt(self.args.head_dim))

    @classmethod
    def layer_windows(cls, args: ModelArgs) -> list[int]:
        """Each layer's sliding window from the args alone (to size a cache before loading)."""
        bare = cls.__new__(cls)
        bare.args = args
        return [bare.layer_window(i) for i in range(args.n_layers)]

    def cache_specs(self) -> list[LayerSpec]:
        """Per layer: KV heads, head size, native window, and the RoPE that re-bases sinks."""
        a = self.args
        specs = []
        for i in range(a.n_layers):
            theta, freq_scale = self.layer_rope(i)
            rope = partial(self.backend.rope, theta=theta, neox=self.rope_neox,
                           freq_factors=self.rope_freqs, freq_scale=freq_scale)
            specs.append(LayerSpec(a.n_kv_heads, a.head_dim, self.layer_window(i), rope))
        return specs

    def make_cache(self, max_tokens: int | None = None, dtype: str | None = None,
                   config: CacheConfig | None = None) -> KVCache:
        """A cache preallocated to the budget in ``config`` (``max_tokens``/``dtype`` override
        it; default: f16, policy error, min(model context, 4096) tokens).
        """
        config = with_budget(config or CacheConfig(), max_tokens)
        if dtype:
            config = replace(config, dtype=dtype)
        return build_cache(self.backend, self.cache_specs(), config,
                           default_tokens=default_context(self.args.context_length), owner=self)

    @property
    def block_plans(self) -> list:
        """Per block, the backend's plan for running a decode step's block in one call
        (``prepare_decode_block``), or None where it runs op by op."""
        if self._block_plans is None:
            a = self.args
            shape = BlockShape(a.d_model, a.n_heads, a.n_kv_heads, a.head_dim, a.d_ff,
                               a.norm_eps, self.attention_scale(), a.attn_logit_softcap,
                               self.rope_neox, self.activation)
            self._block_plans = [self.backend.prepare_decode_block(block, shape)
                                 for block in self.blocks]
        return self._block_plans

    # -- forward -------------------------------------------------------------------------
    def forward(self, tokens: np.ndarray, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Logits for new tokens (n,): (n, vocab) if all_logits else (1, vocab) for the last.

        A long prompt runs in slices of PREFILL_CHUNK tokens, so its activations (and the
        memory they take) stay bounded whatever its length; each token's result is the same
        (the cache attends as it would in one pass)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if len(tokens) > PREFILL_CHUNK:
            if not cache.fits(len(tokens)):
                cache.begin(len(tokens))  # ContextOverflow before any slice is written
            parts = [self.forward(tokens[i:i + PREFILL_CHUNK], cache, all_logits)
                     for i in range(0, len(tokens), PREFILL_CHUNK)]
            return np.concatenate(parts) if all_logits else parts[-1]
        B = self.backend
        graphs = getattr(B, "graphs", None)  # a device backend replaying captured steps
        if graphs is not None and not all_logits:
            logits = graphs.forward(self, tokens, cache)
            if logits is not None:
                return logits
        positions = cache.begin(len(tokens))  # raises ContextOverflow past the budget
        x = B.embed(self.tok_embd, tokens)  # (n, d)
        if self.embed_scale != 1.0:
            x = B.scale(x, self.embed_scale)
        def op_block(i: int, x):
            return self.block_forward(i, self.blocks[i], x, positions, cache.layers[i])

        if len(tokens) == 1:
            x = self.decode_blocks(x, positions, [[layer] for layer in cache.layers], op_block)
        else:
            for i in range(len(self.blocks)):
                x = op_block(i, x)
        if not all_logits:
            x = x[-1:]
        x = B.rms_norm(x, self.output_norm, self.args.norm_eps)
        logits = B.matmul(x, self.output)  # (n, vocab)
        if self.args.final_logit_softcap:
            logits = B.softcap(logits, self.args.final_logit_softcap)
        return B.to_numpy(logits)

    def greedy_tokens(self, token: int, cache: KVCache) -> Iterator[int]:
        """Greedy decoding after ``token`` (the last token, not yet in ``cache``): each
        step's argmax, for ever; the same tokens as ``forward`` and an argmax of its logits.

        A backend that replays graphs (``backend.graphs``) takes the argmax on the device
        and queues each step before the token of the one before is read back, so the cache
        runs one token ahead of what was yielded until the generator is closed (``close()``
        or dropping it), which takes that token back out. Raises ``NonFiniteLogits`` when a
        step's maximum logit is NaN or +inf (a NaN anywhere is the maximum of an argmax).
        """
        graphs = getattr(self.backend, "graphs", None)
        steps = graphs.greedy(self, token, cache) if graphs is not None else None
        yield from self._checked(steps or self._greedy_on_host(token, cache))

    def sampled_tokens(self, token: int, cache: KVCache, params, rng: np.random.Generator,
                       *, evict: bool = True, context: Sequence[int] | None = None
                       ) -> Iterator[int] | None:
        """Decoding after ``token`` with ``params``' chain (logit bias, penalties over
        ``context``: the tokens so far, ``token`` last; top-k, top-p, min-p, temperature)
        drawn on the device, one uniform of ``rng`` a token as the host's sampler draws
        it, or (``params.argmax_only``) the argmax taken there: each step's token, for
        ever, one step ahead as ``greedy_tokens``'. None where the backend cannot (no
        graphs; a chain that needs the host: penalties without ``context`` or over more
        than the device's window, more bias entries than it takes, top-k off or above its
        candidates; a cache that cannot run as graphs), and the caller samples on the
        host. ``evict`` False: a new graph evicts no other cache's, as ``forward_batch``
        keeps an engine's slots."""
        graphs = getattr(self.backend, "graphs", None)
        if graphs is None:
            return None
        steps = (graphs.greedy(self, token, cache, evict) if params.argmax_only
                 else graphs.sample(self, token, cache, params, rng, evict, context))
        return self._checked(steps) if steps is not None else None

    def sampled_batch_tokens(self, batch: Sequence[tuple[int, KVCache]],
                             params: Sequence[Any], rngs: Sequence[np.random.Generator],
                             contexts: Sequence[Sequence[int]] | None = None
                             ) -> Iterator[list[tuple[int, float]]] | None:
        """Decoding several sequences together after their tokens (``batch``: the last
        token, not yet in it, and its own cache each), each one's next token drawn on the
        device by its ``params``' chain (or its argmax: ``params.argmax_only``), one uniform
        of its ``rng`` a token as the host's sampler draws it: yields each step's (token,
        the logits' maximum: NaN or inf marks a fault) a sequence, the tokens
        ``forward_batch`` and each sampler over its logits would give, for ever. Each step
        is queued before the one before is read back, as ``sampled_tokens``' (so each
        cache holds one token more than was yielded until it is closed; copies of
        ``rngs`` draw, one uniform ahead, and the caller advances its own one a token
        taken). ``contexts``: each sequence's tokens so far, its token last, which its
        penalties look back over. None, with nothing run or drawn, where the backend
        cannot (no graphs; a chain that needs the host, as ``sampled_tokens``'; caches that
        cannot step as one batch graph), and the caller runs ``forward_batch`` and samples
        on the host."""
        graphs = getattr(self.backend, "graphs", None)
        if graphs is None:
            return None
        tokens = [np.array([token], dtype=np.int64) for token, _ in batch]
        return graphs.batch_stream(self, tokens, [c for _, c in batch], list(params),
                                   list(rngs), contexts)

    @staticmethod
    def _checked(steps: Iterator[tuple[int, float]]) -> Iterator[int]:
        """The tokens of (token, logit) steps; ``NonFiniteLogits`` at a step whose logit is
        NaN or +inf. Closing it closes the steps."""
        from edgellm.generate import non_finite  # (edgellm.generate imports the models)

        try:
            for step, (token, best) in enumerate(steps, 1):
                if not math.isfinite(best):
                    raise non_finite(step)
                yield token
        finally:
            steps.close()  # graphs: waits for the step queued ahead and trims it

    def _greedy_on_host(self, token: int, cache: KVCache) -> Iterator[tuple[int, float]]:
        """(argmax, its logit) per step from the logits on the host. numpy's argmax picks a
        NaN or +inf where there is one, so the logit shows a fault as the device's does."""
        while True:
            logits = self.forward(np.array([token]), cache)[0]
            token = int(logits.argmax())
            yield token, float(logits[token])

    def forward_batch(self, batch: Sequence[tuple[np.ndarray, KVCache]],
                      want_logits: Sequence[bool] | None = None) -> list[np.ndarray | None]:
        """One pass over several sequences' new tokens, each against its own cache.

        ``batch`` holds (tokens (n_i,), cache) per sequence, each cache at most once, at most
        PREFILL_CHUNK tokens in all. Embedding, norms, matmuls and GLUs run over all the
        tokens together, so each weight is read once per step for every sequence; RoPE and
        attention run per sequence, at its own positions against its own cache. Returns each
        sequence's logits (vocab,) for its last token, or None where ``want_logits`` says
        False. Every op's arithmetic is per token, so a sequence's logits are the ones
        ``forward`` gives it alone, whatever else is in the batch (CPU torch's dense f32
        matmul aside: it rounds another row count otherwise). On a backend that replays
        graphs (the engine's users, the server's or the C ABI's, on a GPU) each sequence's
        step replays its own cache's graphs instead, one after another, where every cache
        in the batch can run as graphs (its own, made without evicting another's:
        ``StepGraphs.forward``'s ``evict``; else the batch runs eagerly): a GPU's eager
        step costs more host time (~40 ms for the 1.5B on an H100) than a replay of the
        whole model per sequence (~1.8 ms with its logits to the host). The sequences
        that bring one token (decode) replay batch graphs of their sets instead, up to 8
        a graph (``StepGraphs.queue_batches``: the weights read once a batch graph).
        """
        tokens = [np.asarray(t, dtype=np.int64).reshape(-1) for t, _ in batch]
        caches = [cache for _, cache in batch]
        want = [True] * len(batch) if want_logits is None else list(want_logits)
        if len(want) != len(batch):
            raise ValueError(f"want_logits has {len(want)} flags for {len(batch)} sequences")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a cache appears twice in one batch: give each sequence its own")
        if any(len(t) == 0 for t in tokens):
            raise ValueError("a sequence in the batch has no tokens")
        if sum(map(len, tokens)) > PREFILL_CHUNK:
            raise ValueError(f"a batch of {sum(map(len, tokens))} tokens exceeds "
                             f"{PREFILL_CHUNK}: split it across steps")
        if not batch:
            return []
        B = self.backend
        graphs = getattr(B, "graphs", None)
        if graphs is not None:
            replayed = self._replayed_batch(graphs, tokens, caches, want)
            if replayed is not None:
                return replayed
        # every cache is checked (ContextOverflow) before any of them is written
        positions = np.concatenate([c.begin(len(t)) for t, c in zip(tokens, caches, strict=True)])
        bounds = np.cumsum([0, *map(len, tokens)])  # sequence j owns rows bounds[j]:bounds[j+1]
        x = B.embed(self.tok_embd, np.concatenate(tokens))  # (N, d)
        if self.embed_scale != 1.0:
            x = B.scale(x, self.embed_scale)
        layer_lists = [[c.layers[i] for c in caches] for i in range(len(self.blocks))]

        def op_block(i: int, x):
            attend = partial(self._attention_batch, i, self.blocks[i].attn, positions=positions,
                             bounds=bounds, layers=layer_lists[i])
            return self.sublayers(self.blocks[i], x, attend)[0]

        if len(positions) == len(caches):  # one token a sequence
            x = self.decode_blocks(x, positions, layer_lists, op_block)
        else:
            for i in range(len(self.blocks)):
                x = op_block(i, x)
        rows = [int(bounds[j + 1]) - 1 for j in range(len(batch)) if want[j]]
        if not rows:
            return [None] * len(batch)
        x = B.rms_norm(x[B.index(np.asarray(rows))], self.output_norm,
                       self.args.norm_eps)  # (R, d)
        logits = B.matmul(x, self.output)  # (R, vocab)
        if self.args.final_logit_softcap:
            logits = B.softcap(logits, self.args.final_logit_softcap)
        logits = B.to_numpy(logits)
        found = iter(logits)
        return [next(found) if w else None for w in want]

    def _replayed_batch(self, graphs, tokens: list[np.ndarray], caches: list[KVCache],
                        want: list[bool]) -> list[np.ndarray | None] | None:
        """``forward_batch`` as graph replays: the sequences that bring a token each
        (decode) as batch graphs of their sets (``StepGraphs.queue_batches``), the rest (a
        prompt's chunk) each its own cache's graph; or None (nothing run) where a cache
        cannot run as graphs (sink tokens, a quantized cache, a ring slice longer than the
        ring) or, with several sequences, cannot take its tokens (the eager path raises
        ContextOverflow before writing any; a lone sequence's replay raises it as early)."""
        pairs = list(zip(tokens, caches, strict=True))
        with graphs.exclusive():  # (another thread's step cannot evict between check and run)
            if len(pairs) > 1 and (not all(c.fits(len(t)) for t, c in pairs) or any(
                    graphs.graph_for_step(self, len(t), c, evict=False) is None
                    for t, c in pairs)):
                return None
            # every step queued while the GPU runs the one before; waited for once
            queued = graphs.queue_batches(self, tokens, caches, want) if len(pairs) > 1 else {}
            for j, ((t, c), w) in enumerate(zip(pairs, want, strict=True)):
                if j in queued:
                    continue
                logits = graphs.queue_step(self, t, c, evict=False, want_logits=w)
                if logits is None:  # (a lone sequence, not checked above: nothing was run)
                    return None
                queued[j] = partial(_last_row, logits)
            return [queued[j]() for j in range(len(pairs))]

    def _attention_batch(self, i: int, w: AttentionWeights, x, positions: np.ndarray,
                         bounds: np.ndarray, layers: list[LayerCache]):
        """Attention for a batch of sequences: projections over all rows, then each
        sequence's rows against its own layer cache. x (N, d) -> (N, d)."""
        B, a = self.backend, self.args
        n = x.shape[0]
        q, k, v = self.project_qkv(i, w, x, positions)  # (N, H, hd), (N, KVH, hd) x2
        if n == len(layers):  # a decode step: one token a sequence
            out = self.attend_appending(q, k, v, layers)
        else:
            out = None
        if out is None:
            rows = [slice(int(bounds[j]), int(bounds[j + 1])) for j in range(len(layers))]
            parts = [layer_cache.update_and_fetch(k[r], v[r])  # (keys, values, mask) each
                     for r, layer_cache in zip(rows, layers, strict=True)]
            out = B.attention_batch(q, parts, self.attention_scale(), a.attn_logit_softcap)
        return B.matmul(out.reshape(n, a.n_heads * a.head_dim), w.wo)  # (N, H, hd) -> (N, d)

    def attend_appending(self, q, k, v, layers: list[LayerCache]):
        """Decode rows (one a sequence: q (N, H, hd), k, v (N, KVH, hd)) stored and attended
        in one backend call, where every layer cache takes a token in place; else None (and
        no cache touched)."""
        if not all(layer.takes_one() for layer in layers):
            return None
        slots, firsts = claim_slots(layers)
        return self.backend.attention_append(
            q, k, v, [layer.store.read() for layer in layers], slots, firsts,
            self.attention_scale(), self.args.attn_logit_softcap)

    def decode_blocks(self, x, positions: np.ndarray, layer_lists: list[list[LayerCache]],
                      op_block: Callable[[int, Any], Any]):
        """x (N, d: one token of each of N sequences) after every block of a decode step.
        Each run of consecutive blocks that the backend takes (a plan, every sequence's layer
        cache on the one-token path) goes to the backend in one call; the other blocks, and a
        run the backend declines (nothing touched then), through ``op_block(i, x)``. The
        result is the op path's to the bit."""
        plans, count = self.block_plans, len(self.blocks)
        i = 0
        while i < count:
            end = i
            while end < count and plans[end] is not None and all(
                    layer.takes_one() for layer in layer_lists[end]):
                end += 1
            y = self._decode_run(i, end, x, positions, layer_lists) if end > i else None
            if y is None:
                for j in range(i, max(end, i + 1)):
                    x = op_block(j, x)
                end = max(end, i + 1)
            else:
                x = y
            i = end
        return x

    def _decode_run(self, start: int, end: int, x, positions: np.ndarray,
                    layer_lists: list[list[LayerCache]]):
        """Blocks start..end-1 in one backend call (``Backend.decode_blocks``), or None."""
        ropes = [(*self.layer_rope(i), self.rope_freqs) for i in range(start, end)]
        stores = [[layer.store.read() for layer in layer_lists[i]] for i in range(start, end)]
        return self.backend.decode_blocks(self.block_plans[start:end], x, positions, ropes,
                                          stores, partial(claim_runs, layer_lists[start:end]))

    def block_forward(self, i: int, block: Block, x, positions: np.ndarray,
                      layer_cache: LayerCache):
        return self.sublayers(block, x, self._attend(i, positions, layer_cache))[0]

    def _attend(self, i: int, positions: np.ndarray, layer_cache) -> Callable[[Any], Any]:
        """Block i's attention of a normed x against one sequence's layer cache."""
        return partial(self.attention, i, self.blocks[i].attn, positions=positions,
                       layer_cache=layer_cache)

    def chained_blocks(self, x, positions, layers: Sequence):
        """x (n, d) through every block op by op, under the output norm at the end. Each
        block's last residual op also normalises its sum for what reads it next (the next
        block's attn_norm, after the last block the output norm): one launch where the
        backend fuses ``residual``, not an add and then a norm. The same arithmetic as
        ``block_forward`` per block then the output norm; ``layers``: each block's cache."""
        B, eps = self.backend, self.args.norm_eps
        normed = B.rms_norm(x, self.blocks[0].attn_norm, eps)
        for i, (block, layer) in enumerate(zip(self.blocks, layers, strict=True)):
            then = self.blocks[i + 1].attn_norm if i + 1 < len(self.blocks) else self.output_norm
            x, normed = self.sublayers(block, x, self._attend(i, positions, layer), normed, then)
        return normed

    def sublayers(self, block: Block, x, attend: Callable[[Any], Any], normed=None,
                  then_norm=None) -> tuple[Any, Any]:
        """The block's two residual sublayers; ``attend`` maps the normed x to attention's
        output (one sequence's cache, or each sequence of a batch against its own).
        ``normed``: x under the block's attn_norm where the op before made it; ``then_norm``:
        a norm the last residual op applies to the sum. Returns (x, x under then_norm or
        None)."""
        B, eps = self.backend, self.args.norm_eps
        if normed is None:
            normed = B.rms_norm(x, block.attn_norm, eps)
        # (each sublayer's output passed straight in: no name keeps it alive past its norm)
        x, normed = B.residual(x, attend(normed), eps, block.post_attn_norm, block.ffn_norm)
        return B.residual(x, self.mlp(block, normed), eps, block.post_ffn_norm, then_norm)

    def attention(self, i: int, w: AttentionWeights, x, positions: np.ndarray,
                  layer_cache: LayerCache):
        B, a = self.backend, self.args
        n = x.shape[0]
        q, k, v = self.project_qkv(i, w, x, positions)
        out = self.attend_appending(q, k, v, [layer_cache]) if n == 1 else None
        if out is None:
            out = layer_cache.attend(B, q, k, v, self.attention_scale(), a.attn_logit_softcap)
        return B.matmul(out.reshape(n, a.n_heads * a.head_dim), w.wo)

    def project_qkv(self, i: int, w: AttentionWeights, x, positions: np.ndarray):
        """Queries (n, H, hd), keys and values (n, KVH, hd) of x (n, d), RoPE applied."""
        a = self.args
        norms = (w.q_norm, w.k_norm, a.norm_eps) if w.q_norm is not None else None
        theta, freq_scale = self.layer_rope(i)
        return self.backend.project_qkv(x, (w.wq, w.wk, w.wv), (w.bq, w.bk, w.bv),
                                        (a.n_heads, a.n_kv_heads, a.head_dim), positions,
                                        theta, self.rope_neox, self.rope_freqs, freq_scale,
                                        norms)

    def mlp(self, block: Block, x):
        B = self.backend
        act = B.gated_projection(x, block.w_gate, block.w_up, self.activation == "gelu_tanh")
        return B.matmul(act, block.w_down)


def _last_row(logits: Callable[[], np.ndarray | None]) -> np.ndarray | None:
    """The last row of what ``logits()`` returns (a queued step's logits), or None."""
    rows = logits()
    return None if rows is None else rows[-1]
