"""KV cache: allocated once to a budget, never grown; it builds the attention mask.

The budget is stated in tokens (``--ctx``) or bytes (``--kv-budget``) and turned into a
``CachePlan`` before anything is allocated, so the cache's size is known up front. Each
layer gets one of three layouts:

- **linear**: ``budget`` slots filled from the start; the cache refuses (``ContextOverflow``)
  when it is full. Full-attention layers under the ``error`` and ``truncate-turns``
  policies.
- **window ring**: layers with a native sliding window (Gemma 3's local layers, Mistral's
  ``sliding_window``) keep only ``window + reserve`` slots, whatever the policy.
- **rotating ring** (policy ``rotate``): full layers keep the first ``keep`` tokens
  (attention sinks) and the ``budget - keep`` most recent ones, for ever.

Positions and masks: every slot remembers the absolute position of the token it holds, and
the mask is built from positions, so the order of slots never matters. A query at position
``p`` sees the key at ``j`` iff ``j <= p``, ``p - j < window`` (window layers), and, when
rotating, ``j < keep or p - j < budget - keep``. So a query always attends to exactly the
tokens a token-by-token decode would, however the tokens are batched.

RoPE under ``rotate``: keys are stored after RoPE at their absolute positions, so the
distance between a query and every *recent* key is the true one (less than the budget).
The sinks are re-based instead, through the backend's own ``rope`` (rotations compose): for
a query at ``p`` they are rotated by ``base = p - span + 1 - keep`` so that they sit just
before the oldest recent key it sees, exactly as StreamingLLM places them (positions within
the cache). A single query re-bases the sinks' rows in place; in a batch each query gets its
own re-based copy of the ``keep`` sink rows (n*keep extra keys, masked so query i sees copy
i), so a batch attends exactly as token-by-token decoding would. No query-key distance ever
exceeds the budget, so the model never meets a relative position beyond those it was trained
on, however long the stream runs. (Absolute positions keep growing: a backend must compute
RoPE angles precisely at large positions; the numpy reference does so in float64.)

Rollback: ring layers carry ``reserve`` extra slots, so the tokens evicted by the last
``reserve`` writes are still there and ``trim(n)`` works after the ring has wrapped (the
speculative decoder verifies k+1 tokens and rolls back the rejected ones). Updates of at
most ``reserve + 1`` tokens write in place and attend over the storage itself; longer ones
(a long prefill through a ring) attend over the storage plus the new keys, then store the
survivors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

POLICIES = ("error", "rotate", "truncate-turns")
KV_DTYPES = ("float16", "float32", "q8_0")
DEFAULT_KEEP = 4
DEFAULT_RESERVE = 64
Q8_BLOCK = 32

# rope(keys (n, KVH, hd), positions (n,)) -> keys rotated by those positions
RopeFn = Callable[[Any, np.ndarray], Any]


class ContextOverflow(ValueError):
    """More tokens than the cache's budget holds, under a policy that refuses them."""


# -- configuration and planning -------------------------------------------------------------
#: KV slots when the user states no budget: the model's context, at most this many.
DEFAULT_CONTEXT = 4096


def default_context(model_context: int) -> int:
    """Tokens a cache holds when no budget is given."""
    return min(model_context, DEFAULT_CONTEXT)


@dataclass(frozen=True)
class CacheConfig:
    """What the user chose: the budget, the storage type and the overflow policy.

    ``max_tokens`` and ``max_bytes`` may both be given: the smaller budget wins. ``reserve``
    is the rollback depth (and the in-place batch size) of ring layers, in slots.
    """

    max_tokens: int | None = None
    max_bytes: int | None = None
    dtype: str = "float16"
    policy: str = "error"
    keep: int = DEFAULT_KEEP
    reserve: int = DEFAULT_RESERVE

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.dtype!r}: choose one of "
                             f"{', '.join(KV_DTYPES)}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown context policy {self.policy!r}: choose one of "
                             f"{', '.join(POLICIES)}")
        if self.keep < 0 or self.reserve < 0:
            raise ValueError(f"--keep ({self.keep}) and reserve ({self.reserve}) must be >= 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"context budget must be at least 1 token, not {self.max_tokens}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"KV budget must be positive, not {self.max_bytes} bytes")

    @property
    def rotates(self) -> bool:
        return self.policy == "rotate"


@dataclass(frozen=True)
class LayerSpec:
    """What a model says about one attention layer's cache."""

    n_kv_heads: int
    head_dim: int
    window: int = 0  # native sliding window (0 = full attention)
    rope: RopeFn | None = None  # re-rotates sink keys under ``rotate``


@dataclass(frozen=True)
class LayerPlan:
    """One layer's layout: ``slots`` rows, of which the first ``keep`` hold sinks.

    ``span`` is how many recent tokens (the query included) a query sees; 0 = all of them
    (linear layout, never wraps).
    """

    slots: int
    keep: int = 0
    span: int = 0
    window: int = 0

    @property
    def is_ring(self) -> bool:
        return self.span > 0

    @property
    def max_inplace(self) -> int:
        """Largest update written before attending without hiding a token a query needs."""
        if not self.is_ring:
            return self.slots
        return self.slots - self.keep - self.span + 1


@dataclass(frozen=True)
class CachePlan:
    """The whole cache, sized before allocation: ``tokens`` is the budget in tokens."""

    tokens: int
    config: CacheConfig
    layers: tuple[LayerPlan, ...]
    nbytes: int

    def describe(self) -> str:
        """One line for humans: budget, storage, bytes, policy."""
        rings = sum(1 for p in self.layers if p.is_ring and p.keep == 0 and p.window)
        policy = self.config.policy
        if self.config.rotates:
            policy += f" (keep {self.layers_keep})"
        ring_note = f", {rings} window-ring layers" if rings else ""
        return (f"KV cache: {self.tokens} tokens, {self.config.dtype}, "
                f"{self.nbytes / 2**20:.1f} MiB{ring_note}, policy {policy}")

    @property
    def layers_keep(self) -> int:
        return max((p.keep for p in self.layers), default=0)


def bytes_per_slot(spec: LayerSpec, dtype: str) -> int:
    """Bytes of one token's key and value in one layer."""
    n = spec.n_kv_heads * spec.head_dim
    if dtype == "q8_0":
        return 2 * (n + 2 * (n // Q8_BLOCK))  # int8 values + one f16 scale per 32
    return 2 * n * (2 if dtype == "float16" else 4)


def plan_layer(spec: LayerSpec, tokens: int, config: CacheConfig) -> LayerPlan:
    """The layout of one layer for a budget of ``tokens``."""
    w = spec.window
    if w and w <= tokens:  # a native window fits: a ring of its size, whatever the policy,
        if not config.rotates and w + config.reserve >= tokens:  # unless linear is smaller
            return LayerPlan(slots=tokens, window=w)
        return LayerPlan(slots=w + config.reserve, keep=0, span=w, window=w)
    if config.rotates:
        if config.keep >= tokens:
            raise ValueError(f"--keep {config.keep} leaves no room for recent tokens in a "
                             f"budget of {tokens}: lower --keep or raise --ctx")
        return LayerPlan(slots=tokens + config.reserve, keep=config.keep,
                         span=tokens - config.keep, window=w)
    return LayerPlan(slots=tokens, window=w)


def _plan_bytes(specs: list[LayerSpec], tokens: int, config: CacheConfig) -> int:
    return sum(plan_layer(s, tokens, config).slots * bytes_per_slot(s, config.dtype)
               for s in specs)


def plan_cache(specs: list[LayerSpec], config: CacheConfig,
               default_tokens: int = DEFAULT_CONTEXT) -> CachePlan:
    """Size every layer from the budget; a byte budget becomes the most tokens that fit."""
    tokens = config.max_tokens or default_tokens
    if config.max_bytes is not None:
        if _plan_bytes(specs, 1 + config.keep * config.rotates, config) > config.max_bytes:
            raise ValueError(f"KV budget of {config.max_bytes:,} bytes is too small for even "
                             "one token: raise --kv-budget")
        lo, hi = 1, tokens  # largest budget in tokens whose bytes fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _plan_bytes(specs, mid, config) <= config.max_bytes:
                lo = mid
            else:
                hi = mid - 1
        tokens = lo
    layers = tuple(plan_layer(s, tokens, config) for s in specs)
    nbytes = sum(p.slots * bytes_per_slot(s, config.dtype)
                 for p, s in zip(layers, specs, strict=True))
    return CachePlan(tokens, config, layers, nbytes)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str | int) -> int:
    """'256MB' -> 256_000_000, '1.5GiB' -> 1610612736 (KB/MB/GB decimal, KiB/MiB/GiB binary)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 256MB, 1GiB or 500000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


# -- storage ------------------------------------------------------------------------------
class FloatStore:
    """Keys and values as backend arrays (slots, KVH, hd) of float16 or float32."""

    in_place = True  # read() returns the storage itself

    def __init__(self, backend, slots: int, n_kv_heads: int, head_dim: int, dtype: str,
                 storage: tuple[Any, Any] | None = None):
        shape = (slots, n_kv_heads, head_dim)
        self.backend = backend
        self.dtype = dtype  # of the arrays read() returns
        # (the backend's own zeroed storage, when it has some to give: ``kv_storage``)
        self.keys, self.values = storage or (backend.zeros(shape, dtype),
                                             backend.zeros(shape, dtype))

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)

    def write(self, slots: np.ndarray, k: Any, v: Any) -> None:
        slots = self.backend.index(slots)
        self.keys[slots] = k
        self.values[slots] = v

    def read(self) -> tuple[Any, Any]:
        return self.keys, self.values

    def as_stored(self, x: Any) -> Any:
        """x (n, KVH, hd) as write() would keep it (assignment into the typed storage)."""
        return x


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(..., hd) f32 -> int8 (..., hd) and f16 scales (..., hd/32), ggml's Q8_0 rounding."""
    blocks = x.reshape(*x.shape[:-1], -1, Q8_BLOCK)
    d = np.abs(blocks).max(axis=-1) / 127.0  # (..., hd/32)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.round(blocks * inv[..., None]).astype(np.int8)
    return q.reshape(x.shape), d.astype(np.float16)


def dequantize_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """int8 (..., hd) and f16 scales (..., hd/32) -> f32 (..., hd)."""
    blocks = q.reshape(*q.shape[:-1], -1, Q8_BLOCK).astype(np.float32)
    return (blocks * d.astype(np.float32)[..., None]).reshape(q.shape)


class Q8Store:
    """Keys and values quantized to Q8_0 blocks in numpy; read() dequantizes a copy."""

    in_place = False

    def __init__(self, backend, slots: int, n_kv_heads: int, head_dim: int):
        if head_dim % Q8_BLOCK:
            raise ValueError(f"q8_0 KV storage needs a head size divisible by {Q8_BLOCK}, "
                             f"not {head_dim}: use --kv-dtype float16")
        self.backend = backend
        self.dtype = "float32"  # of the arrays read() returns (dequantized)
        self.q = np.zeros((2, slots, n_kv_heads, head_dim), np.int8)  # keys, values
        self.d = np.zeros((2, slots, n_kv_heads, head_dim // Q8_BLOCK), np.float16)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.d.nbytes)

    def write(self, slots: np.ndarray, k: Any, v: Any) -> None:
        for i, x in enumerate((k, v)):
            self.q[i, slots], self.d[i, slots] = quantize_q8_0(self.backend.to_numpy(x))

    def read(self) -> tuple[Any, Any]:
        k, v = dequantize_q8_0(self.q, self.d)
        return self.backend.asarray(k), self.backend.asarray(v)

    def as_stored(self, x: Any) -> Any:
        """x (n, KVH, hd) as write() then read() would give it back: rounded to Q8_0."""
        return self.backend.asarray(dequantize_q8_0(*quantize_q8_0(self.backend.to_numpy(x))))


# -- one layer ----------------------------------------------------------------------------
class LayerCache:
    """Keys and values of one attention layer, laid out as its ``LayerPlan`` says."""

    def __init__(self, backend, spec: LayerSpec, plan: LayerPlan, dtype: str = "float16",
                 storage: tuple[Any, Any] | None = None):
        self.backend, self.spec, self.plan = backend, spec, plan
        self.store = (Q8Store(backend, plan.slots, spec.n_kv_heads, spec.head_dim)
                      if dtype == "q8_0" else
                      FloatStore(backend, plan.slots, spec.n_kv_heads, spec.head_dim, dtype,
                                 storage))
        self.slot_pos = np.full(plan.slots, -1, dtype=np.int64)  # position held by each slot
        self.offset = 0
        sink_shape = (plan.keep, spec.n_kv_heads, spec.head_dim)
        # the sinks as first stored (keys after RoPE at positions 0..keep-1), in f32
        self.sink_keys = backend.zeros(sink_shape, "float32") if plan.keep else None
        self.sink_values = backend.zeros(sink_shape, "float32") if plan.keep else None
        self._sink_base = 0  # rotation currently applied to the sinks' rows of the storage

    # -- geometry ---------------------------------------------------------------------------
    @property
    def max_tokens(self) -> int:
        return self.plan.slots if not self.plan.is_ring else 2**62

    @property
    def window(self) -> int:
        return self.plan.window

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def slot_of(self, pos: np.ndarray) -> np.ndarray:
        """Slot (n,) of each absolute position (n,): sinks fixed, the rest round the ring."""
        keep = self.plan.keep
        return np.where(pos < keep, pos, keep + (pos - keep) % (self.plan.slots - keep))

    def sink_base(self, start: int) -> int:
        """Rotation that places the sinks just before the oldest recent key ``start`` sees."""
        p = self.plan
        if not p.keep:
            return 0
        return max(0, start - p.span + 1 - p.keep)

    def mask(self, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
        """(n, T) bool: may the query at q_pos[i] see the key at k_pos[j] (-1 = empty)?"""
        p = self.plan
        q, j = q_pos[:, None], k_pos[None, :]
        visible = (j >= 0) & (j <= q)
        if p.window:
            visible &= q - j < p.window
        if p.span:
            visible &= (j < p.keep) | (q - j < p.span)
        return visible

    # -- update -----------------------------------------------------------------------------
    def attend(self, backend: Any, q: Any, k: Any, v: Any, scale: float,
               softcap: float = 0.0) -> Any:
        """Store k, v (n, KVH, hd) as the next n tokens, then q (n, H, hd)'s attention over
        the layer (``update_and_fetch`` and ``backend.attention``); a device step may do
        both in one launch (``graphs._StepLayer``)."""
        keys, values, mask = self.update_and_fetch(k, v)
        return backend.attention(q, keys, values, mask, scale, softcap)

    def update_and_fetch(self, k: Any, v: Any) -> tuple[Any, Any, np.ndarray]:
        """Store k, v (n, KVH, hd) as the next n tokens; return keys, values (T, KVH, hd) to
        attend over and the mask (n, T) bool, True where query i may attend to key j.
        """
        n = k.shape[0]
        start = self.offset
        new_pos = np.arange(start, start + n)
        if not self.plan.is_ring and start + n > self.plan.slots:
            raise ContextOverflow(f"context full: {start} + {n} tokens exceed the layer's "
                                  f"{self.plan.slots} slots")
        if self.writes_in_place(start, n):
            self._write(new_pos, k, v)
            keys, values = self._read(start)
            used = start + n  # until the layout wraps, position p sits in slot p and the
            if used < len(self.slot_pos):  # slots past the newest are empty: not attended
                keys, values = keys[:used], values[:used]
            key_pos = self.slot_pos[:used].copy()
        else:  # the update would overwrite keys its own first queries need
            keys, values = self._read(start)
            old_pos = np.where(self.slot_pos < start, self.slot_pos, -1)
            keys, values = self._concat(keys, k), self._concat(values, v)
            key_pos = np.concatenate([old_pos, new_pos])
            self._write(new_pos, k, v)
        self.offset = start + n
        mask = self.mask(new_pos, key_pos)
        if self._needs_sinks_per_query(start, n):
            keys, values, mask = self._with_sinks_per_query(keys, values, mask, key_pos, new_pos)
        return keys, values, mask

    def writes_in_place(self, start: int, n: int) -> bool:
        """May n tokens from position ``start`` be stored before their queries attend? Yes
        when the write overwrites no key those queries need: an update the layout always
        takes (``max_inplace``), or one that ends before the first wrap, which overwrites
        nothing at all (a ring's first prompt: attention over the slots so far, not over
        the whole ring followed by the new rows)."""
        return n <= self.plan.max_inplace or start + n <= self.plan.slots

    def takes_one(self) -> bool:
        """Does decode's next token take the one-token path (``claim_one``)? Before the
        layout wraps, with no sinks, into storage that attention reads in place."""
        return self.offset < self.plan.slots and not self.plan.keep and self.store.in_place

    def claim_one(self) -> tuple[int, int]:
        """Book the next token into its slot (only where ``takes_one``): returns the slot and
        the first slot its query sees. Slots [0, slot] hold positions 0..slot, and only the
        window (or a rotating budget) hides some of them. The caller stores the token's key
        and value in that slot (``Backend.attention_append``, a whole batch in one call):
        ``update_and_fetch``'s index arrays and (n, T) comparisons cost ~10 us a layer, a
        batched step's largest Python cost."""
        p, slot = self.plan, self.offset
        self.slot_pos[slot] = slot
        self.offset = slot + 1
        hidden = max([0] + [slot + 1 - limit for limit in (p.window, p.span) if limit])
        return slot, hidden

    def _needs_sinks_per_query(self, start: int, n: int) -> bool:
        """Do the queries of this update see the sinks at different distances (wrapped)?"""
        return (n > 1 and self.plan.keep > 0 and self.spec.rope is not None
                and self.sink_base(start + n - 1) > 0)

    def _with_sinks_per_query(self, keys: Any, values: Any, mask: np.ndarray,
                              key_pos: np.ndarray, q_pos: np.ndarray) -> tuple[Any, Any, Any]:
        """Give each query its own copy of the sinks, re-based for it, so that a batch attends
        exactly as token-by-token decoding (StreamingLLM) would.

        keys/values (T, KVH, hd) gain n*keep rows; mask (n, T) -> (n, T + n*keep) with the
        shared sink columns hidden and query i seeing only its copy.
        """
        b, keep, n = self.backend, self.plan.keep, len(q_pos)
        bases = np.array([self.sink_base(int(q)) for q in q_pos])  # (n,)
        sink_k = np.tile(b.to_numpy(self.sink_keys), (n, 1, 1))  # (n*keep, KVH, hd)
        sink_k = b.to_numpy(self.spec.rope(b.asarray(sink_k), np.repeat(bases, keep)))
        sink_v = np.tile(b.to_numpy(self.sink_values), (n, 1, 1))
        s = np.arange(keep)
        own = np.eye(n, dtype=bool).repeat(keep, axis=1)  # (n, n*keep): query i, copy i
        stored = np.tile(self.slot_pos[s] == s, n)[None, :]  # (1, n*keep)
        visible = own & stored & (np.tile(s, n)[None, :] <= q_pos[:, None])
        if self.plan.window:
            visible &= q_pos[:, None] - np.tile(s, n)[None, :] < self.plan.window
        shared = mask & (key_pos >= keep)[None, :]  # the shared sink rows are not used
        keys = b.asarray(np.concatenate([b.to_numpy(keys), sink_k]))
        values = b.asarray(np.concatenate([b.to_numpy(values), sink_v]))
        return keys, values, np.concatenate([shared, visible], axis=1)

    def _write(self, pos: np.ndarray, k: Any, v: Any) -> None:
        """Store the tokens at positions pos (n,) that the layout keeps."""
        p = self.plan
        if p.is_ring:  # of a long update only the sinks and the last ring-full survive
            survive = (pos < p.keep) | (pos >= pos[-1] + 1 - (p.slots - p.keep))
            if not survive.all():
                idx = np.flatnonzero(survive)
                rows = self.backend.index(idx)
                pos, k, v = pos[idx], k[rows], v[rows]
        slots = self.slot_of(pos)
        self.store.write(slots, k, v)
        self.slot_pos[slots] = pos
        if p.keep:
            sinks = np.flatnonzero(pos < p.keep)
            if len(sinks):
                rows = self.backend.index(pos[sinks])
                self.sink_keys[rows] = self.backend.asarray(self.backend.to_numpy(k)[sinks])
                self.sink_values[rows] = self.backend.asarray(self.backend.to_numpy(v)[sinks])

    def _read(self, start: int) -> tuple[Any, Any]:
        """Keys and values of every slot, the sinks' keys re-based for a query at start."""
        keys, values = self.store.read()
        keep = self.plan.keep
        if keep and self.spec.rope is not None:
            base = self.sink_base(start)
            if base or self._sink_base:
                rotated = (self.spec.rope(self.sink_keys, np.full(keep, base)) if base
                           else self.sink_keys)
                keys[:keep] = rotated
                self._sink_base = base if self.store.in_place else 0
        return keys, values

    def _concat(self, stored: Any, new: Any) -> Any:
        """stored rows, then the new rows as the store keeps them, in the store's dtype: an
        update too long to write first must attend over the same values (f16-rounded keys
        in an f16 cache) as one written in place, and attention sees the cache's dtype."""
        b, m = self.backend, stored.shape[0]
        out = b.zeros((m + new.shape[0], *stored.shape[1:]), self.store.dtype)
        out[:m] = stored
        out[m:] = self.store.as_stored(new)
        return out

    # -- rollback ---------------------------------------------------------------------------
    def max_trim(self) -> int:
        """How many of the last tokens ``trim`` can still forget."""
        p = self.plan
        if not p.is_ring:
            return self.offset
        recent = self.slot_pos[p.keep:]
        recent = recent[recent >= 0]
        lowest = int(recent.min()) if len(recent) else self.offset
        if lowest <= p.keep:  # never wrapped: everything is still here
            return self.offset
        return max(0, self.offset - (lowest + p.span - 1))

    def trim(self, n: int) -> int:
        """Forget the last n tokens (speculative rollback); returns how many were dropped."""
        n = min(n, self.offset)
        if n > self.max_trim():
            raise ValueError(f"cannot roll back {n} tokens: this ring cache keeps only "
                             f"{self.max_trim()} evicted tokens (raise CacheConfig.reserve)")
        gone = np.arange(self.offset - n, self.offset)
        slots = self.slot_of(gone)
        self.slot_pos[slots] = np.where(self.slot_pos[slots] == gone, -1, self.slot_pos[slots])
        self.offset -= n
        return n


# -- the whole cache ----------------------------------------------------------------------
class KVCache:
    """One ``LayerCache`` per layer, advanced together by the model's forward pass."""

    def __init__(self, layers: list[LayerCache], plan: CachePlan | None = None):
        self.layers = layers
        self.plan = plan

    @property
    def config(self) -> CacheConfig:
        return self.plan.config if self.plan else CacheConfig(policy="error")

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def offset(self) -> int:
        """Tokens processed so far (the position of the next token)."""
        return self.layers[0].offset

    @property
    def max_tokens(self) -> int:
        """The budget in tokens: how many a query attends to at most (itself included)."""
        if self.plan:
            return self.plan.tokens
        return min(layer.max_tokens for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (fixed for the cache's life)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def evicted(self) -> int:
        """Tokens the next token can no longer see because the budget rotated them out."""
        if not self.config.rotates:
            return 0
        return max(0, self.offset + 1 - self.max_tokens)

    def fits(self, n: int) -> bool:
        """Can n more tokens be processed without refusing (always, when rotating)?"""
        return self.config.rotates or self.offset + n <= self.max_tokens

    def positions(self, n: int) -> np.ndarray:
        """Positions (n,) of the next n tokens."""
        return np.arange(self.offset, self.offset + n)

    def begin(self, n: int) -> np.ndarray:
        """Check that n new tokens fit the budget, then return their positions (n,).

        Raises ``ContextOverflow`` (before any layer changes) under ``error`` and
        ``truncate-turns`` when they do not.
        """
        if not self.fits(n):
            free = self.max_tokens - self.offset
            raise ContextOverflow(
                f"context full: {n} new tokens do not fit the KV cache budget of "
                f"{self.max_tokens} tokens ({free} free, {self.nbytes / 2**20:.1f} MiB): raise "
                "--ctx or --kv-budget, or choose --policy rotate (keeps the first --keep "
                "tokens and the most recent ones) or truncate-turns (chat drops old turns)")
        return self.positions(n)

    def max_trim(self) -> int:
        """How many of the last tokens ``trim`` can forget right now."""
        return min(layer.max_trim() for layer in self.layers)

    def trim(self, n: int) -> int:
        """Forget the last n tokens in every layer; returns how many were dropped.

        Works after a ring has wrapped, as far back as its ``reserve`` slots reach
        (``max_trim()``); asking for more raises ValueError and changes nothing.
        """
        n = min(n, self.offset)
        if n > self.max_trim():
            raise ValueError(f"cannot roll back {n} tokens: the cache can forget at most "
                             f"{self.max_trim()} now (raise CacheConfig.reserve)")
        for layer in self.layers:
            layer.trim(n)
        return n

    def reset(self) -> None:
        """Empty the cache (keeps the allocation)."""
        for layer in self.layers:
            layer.slot_pos[:] = -1
            layer.offset = 0
            layer._sink_base = 0


def build_cache(backend, specs: list[LayerSpec], config: CacheConfig,
                default_tokens: int = DEFAULT_CONTEXT, owner: Any = None) -> KVCache:
    """Plan, then allocate, a cache for layers ``specs`` (of ``owner``, a model: whose
    earlier caches' storage the backend may hand on, ``Backend.kv_storage``)."""
    plan = plan_cache(specs, config, default_tokens)
    storage = None
    if config.dtype != "q8_0" and owner is not None:
        layout = [(p, (p.slots, s.n_kv_heads, s.head_dim))
                  for s, p in zip(specs, plan.layers, strict=True)]
        storage = backend.kv_storage(owner, layout, config.dtype)
    layers = [LayerCache(backend, s, p, config.dtype, storage[i] if storage else None)
              for i, (s, p) in enumerate(zip(specs, plan.layers, strict=True))]
    return KVCache(layers, plan)


def with_budget(config: CacheConfig, max_tokens: int | None) -> CacheConfig:
    """``config`` with its budget in tokens replaced (when given)."""
    return replace(config, max_tokens=max_tokens) if max_tokens else config


def context_event(cache: KVCache) -> dict[str, Any]:
    """What a response record says about the cache's overflow: ``{}`` while nothing was
    evicted, else ``{"context": {"policy": "rotate", "evicted": n, "budget": tokens,
    "keep": k}}`` so that every rotation is visible in the API.
    """
    if not cache.evicted:
        return {}
    return {"context": {"policy": cache.policy, "evicted": cache.evicted,
                        "budget": cache.max_tokens, "keep": cache.config.keep}}
