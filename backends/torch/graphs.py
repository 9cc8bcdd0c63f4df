"""Forward steps as CUDA graphs: a small model's step is tens of launches per layer, and from
Python each launch costs more host time than the GPU spends on it (a 512-token prefill of
the 1.5B, eagerly: 1,351-1,464 launches, 10.4-10.6 ms on the GPU, 51-73 ms of wall time on
an H100 and an H200). Replaying them as one graph removes that (14.9 ms on the H200).

A step of n tokens runs the graph of the smallest bucket (``BUCKETS``) that holds it: decode
(1 token) exactly, a prompt slice padded to 8..512 tokens. The pads repeat the last token
at its position, write their keys to a spare row of the KV storage that no query reads, and
their outputs are dropped (every op but attention works row by row, and attention masks
them). A graph is captured once per model, cache layout and bucket, and replayed for every
step after; all of a cache's buckets share its KV storage and one memory pool, and all of a
model's graphs (one replays at a time) one logits buffer and, per layout and bucket, the
step inputs' device buffers.

What changes from step to step lives in static device buffers filled from pinned host
memory before each replay: tokens, positions, the last real row, each distinct layout's
write slots and mask (layers with the same plan share them: two for Gemma 3, one for Qwen),
and the mask's span (the columns up to the last that any row sees): the decode attention
splits the slots used so far, not the whole storage (an eager step's split, and the work
of a chat's short context in a 4,096- or 32,768-slot cache).
The host still keeps the cache's books (``slot_pos``, ``offset``) as
``LayerCache.update_and_fetch`` does, so trim, eager steps and everything else see the same
cache. A layer attends as update_and_fetch does: over its storage after the write when the
bucket may be written in place (``LayerCache.writes_in_place``), else over the storage
before the write followed by the new rows (a ring whose window a long slice would
overwrite); in place, the write itself goes to the backend's attention (``_StepLayer.attend``:
one launch for both on the GPU path). Which of the two each group of layers takes is part of
the bucket's key, so a ring's first prompt and a later one of the same size are two graphs.
The captured pass is
``Model.forward``'s own steps (embed, the blocks, norm, output), the blocks chained
(``Model.chained_blocks``: each block's last residual add also applies the next norm).

A graph's KV storage is the tensors it was captured with: its first cache's own (a cache is
made with the spare row, ``storage_for``). A new cache of the same layout whose predecessor
is gone is made in them (zeroed) and adopts the graph, so a benchmark's or a chat's fresh
caches neither capture again nor hold their keys twice; a cache made while the graph is in
use by a live cache gets its own storage (and its own graph, or copies its rows into an
orphan's at its first step).
Caches that rotate with sink tokens or store Q8_0, slices that need all logits, and ring
layers shorter than the slice run eagerly.

Every graph also takes its logits' maximum and argmax, so greedy decoding (``greedy``) needs
no logits on the host: the next step reads its token from the device, and is queued before
this step's token is read back (one step ahead), so the host's work for a step (its books,
the copies, the replay's launch) overlaps the GPU's work on the step before. Sampled
decoding (``sample``) runs the same way, with a small graph of its own after each step's
that draws the token from the 64 largest logits (``_sample``), a uniform from the host's
generator a step, after the logit bias and the penalties where a chain has them
(``_processed``, in a second such graph: the window's tokens from the host, but its last,
the step's input, which the host may not have read yet, on the device).

Several caches decoding together (an engine's concurrent users: ``Model.forward_batch``)
replay one graph of their set (``queue_batch``; up to 8 a graph, more in several sets:
``cache_sets``, ``queue_batches``, beside a prompt's chunk that replays its own cache's
graph), not each its own: their tokens go
through the mat-vecs as one batch of 2..8 rows, so each weight is read once a step for all of them
(the kernels' arithmetic is per token: each sequence's logits are those of its own step
alone), and each sequence attends over its own cache's storage, which the set's caches'
graphs hold (so a batch graph adds no KV memory; it is dropped with any of them, and with
its anchor's, below). A set is
captured at its first step; an engine's slots keep their caches, so a set of users decoding
together replays the same graph until one of them is done. Then (requests come and go)
another set of that size and layout takes over an idle batch graph rather than capture
one (``_taken_over``): on the GPU path its attention reads each row's cache at an offset
from its first set's storage (``kernels.attention``'s ``apart``), from a device table
refilled in place, so each layout keeps about one batch graph a set size. Its logits come
to the host (N, vocab), or (``batch_stream``) each sequence's token is drawn after it on the
device by its own chain (``_sample`` over the rows, each with its own knobs), only the
tokens come back, and the next step is queued before they are read, as a lone cache's
``greedy``.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from edgellm.cache import FloatStore, KVCache, LayerCache

from .backend import KVStorage

log = logging.getLogger(__name__)

#: graphs kept per model before a cache stepped directly (``Model.forward``, ``generate``)
#: evicts the oldest live cache's: the engine's default slots (``engine.DEFAULT_MAX_SEQS``).
#: An engine's caches (``evict`` False) evict none and are never refused: as many graphs as
#: its slots, which its KV budget bounds. A graph's KV storage is its cache's own
#: (``storage_for``); what a graph adds is its buckets' pinned host inputs (a mask byte per
#: slot for each bucket row, all buckets used: 4.0-5.0 MB at 4,096 tokens, which is 3.4%
#: of the 1.5B's KV, 8% of the 0.5B's, 23% of Gemma 3's) and its captured launches; its
#: device inputs and logits are shared
MAX_GRAPHS_PER_MODEL = 8
#: of those, graphs whose cache is gone, kept for a new cache of their layout to adopt (the
#: bench's repetitions, ``generate``'s call after call): each holds its dead cache's storage
MAX_ORPHANS_PER_MODEL = 2
#: token counts a step is captured for: decode, then prompt slices up to Model's PREFILL_CHUNK
#: (8: the mat-vec's largest count, so that 2..8 tokens multiply as eagerly, in integers)
BUCKETS = (1, 8, 16, 64, 128, 256, 512)
#: the most sequences a batch graph steps together: the mat-vec's most tokens
#: (``kernels.MATVEC_MAX_TOKENS``; above it a GPU's GEMM rounds differently for another row
#: count), and the engine's default slots
MAX_BATCH_SEQUENCES = 8
#: batch graphs kept per model (sets of caches decoding together), least recently used
#: dropped first: each holds its launches and pinned inputs (a mask byte per slot a
#: sequence), not KV storage
MAX_BATCH_GRAPHS_PER_MODEL = 8
#: EDGELLM_BATCH_GRAPHS=0: each sequence of a batch replays its own cache's graph instead
#: (the A/B of ``benchmarks/engine_one_stream.py --streams N``)
BATCH_GRAPHS = os.environ.get("EDGELLM_BATCH_GRAPHS", "1") != "0"


class _StepLayer:
    """Model.attention's view of one layer inside a captured step of B tokens."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor, span: torch.Tensor, stored: int, in_place: bool,
                 kernels=None):
        # (stored + 1, KVH, hd): a spare last row; plain tensors (no subclass dispatch)
        self.keys, self.values = (t.as_subclass(torch.Tensor) for t in (keys, values))
        self.slots, self.mask = slots, mask  # (B,) write slots; (B, T) visibility
        self.span = span  # (1,): the mask's leading columns past which all are hidden
        self.stored, self.in_place = stored, in_place
        self.kernels = kernels  # the triton kernels (GPU path), or None (CPU torch)

    def takes_one(self) -> bool:
        """Never: a captured step writes through ``update_and_fetch``'s static slots and
        mask, not ``LayerCache.claim_one``'s host bookkeeping."""
        return False

    def attend(self, backend, q, k, v, scale: float, softcap: float = 0.0):
        """LayerCache.attend: where the write is in place, the backend's attention stores
        k and v itself (``TorchBackend.attention``'s ``write``: in the attention's launch
        on the GPU path)."""
        if not self.in_place or self.kernels is None:  # (LayerCache's: store, then attend)
            return LayerCache.attend(self, backend, q, k, v, scale, softcap)
        return backend.attention(q, self.keys[:self.stored], self.values[:self.stored],
                                 self.mask, scale, softcap, write=(self.slots, k, v),
                                 span=self.span)

    def update_and_fetch(self, k, v):
        """Write k, v (B, KVH, hd) at the static slots; keys and values (T, KVH, hd) to
        attend over and the static mask (B, T): T = the stored rows after the write (in
        place), or the stored rows before it followed by the B new ones."""
        keys, values = self.keys, self.values
        old_k, old_v = keys[:self.stored], values[:self.stored]
        if not self.in_place:  # copies taken before the write below
            old_k = torch.cat([old_k, k.to(keys.dtype)])
            old_v = torch.cat([old_v, v.to(values.dtype)])
        if self.kernels is not None:
            self.kernels.store_kv(keys, values, self.slots, k.contiguous(), v.contiguous())
        else:
            keys.index_copy_(0, self.slots, k.to(keys.dtype))
            values.index_copy_(0, self.slots, v.to(values.dtype))
        return old_k, old_v, self.mask


@dataclass
class _QueuedBatch:
    """A batch graph's step, queued (``StepGraphs.queue_batch``): call it to wait for its
    rows, each sequence's in the caller's order."""

    wait: Callable[[], list]
    order: list[int]  # the caller's sequence of each row of the step
    drawn: torch.Tensor | None  # (N,) int64 on the device: the tokens drawn, by row

    def __call__(self) -> list:
        return self.wait()

    def drawn_in(self, order: list[int]) -> torch.Tensor:
        """The tokens drawn, in the rows of a step whose rows are ``order`` (another batch
        graph's where a member's graph was made again between: its rows' order differs)."""
        if order == self.order:
            return self.drawn
        row_of = {j: at for at, j in enumerate(self.order)}
        rows = torch.tensor([row_of[j] for j in order], device=self.drawn.device)
        return self.drawn.index_select(0, rows)


class _BatchLayer:
    """Model.attention's view of one layer inside a batch graph's step: row j is sequence
    j's token, attended against its own cache (``parts[j]``, a ``_StepLayer``; ``bind``)."""

    def __init__(self, layer: int, rows: list[tuple], slots: torch.Tensor,
                 masks: torch.Tensor, spans: torch.Tensor, stored: int, kernels=None):
        self.layer, self.kernels = layer, kernels
        self.rows = rows  # (slot (1,), mask (1, T), span (1,)): each sequence's views
        # (N,), (N, T), (N,): the group's buffers, of which each row views its own (the
        # slots one view a group, as a bucket's: ``_warm_up`` redirects each group once)
        self.slots, self.masks, self.spans = slots, masks, spans
        self.stored = stored  # every member's: one layout
        self.parts: list[_StepLayer] = []
        self.base: tuple | None = None  # (keys, values) (stored + 1, KVH, hd): the anchor's
        self.apart: tuple | None = None  # (k offsets, v offsets) (N,) from base (GPU path)
        self.one_launch: bool | None = None  # how its last step attended (None: none yet)

    def bind(self, members: tuple, anchor: _Graph, apart: tuple | None) -> None:
        """Attend over the members' storage: a part at a time, or (``apart``: offsets of
        their storage from the anchor's, in elements) in one launch."""
        self.parts = [_StepLayer(*g.stores[self.layer], *row, self.stored, True, self.kernels)
                      for g, row in zip(members, self.rows, strict=True)]
        self.base = tuple(t.as_subclass(torch.Tensor) for t in anchor.stores[self.layer])
        self.apart = apart

    def takes_one(self) -> bool:
        return False

    def attend(self, backend, q, k, v, scale: float, softcap: float = 0.0):
        """q (N, H, hd), k, v (N, KVH, hd): each row stored and attended in its own cache:
        on the GPU path in one launch (``TorchBackend.attention``'s ``apart``), else a
        part at a time, the outputs joined (N, H, hd)."""
        self.one_launch = self.apart is not None and backend.attends_apart(q)
        if self.one_launch:
            keys, values = self.base
            return backend.attention(q, keys[:self.stored], values[:self.stored],
                                     self.masks, scale, softcap, write=(self.slots, k, v),
                                     span=self.spans, apart=self.apart)
        with backend.attention_rows_apart():
            rows = [part.attend(backend, q[j:j + 1], k[j:j + 1], v[j:j + 1], scale, softcap)
                    for j, part in enumerate(self.parts)]
        return torch.cat(rows)


@dataclass
class _Group:
    """Layers of one plan: they share write slots and masks."""

    layers: list  # layer indices
    slots: int  # stored rows (the spare row is index ``slots``)
    ring: bool


@dataclass
class _HostSet:
    """A step's inputs in (pinned) host memory, and its greedy token read back."""

    i64: torch.Tensor  # tokens (B), positions (B), last row (1), slots (B) per group,
    # then each group's mask span (1: the columns up to the last one any row sees)
    masks: torch.Tensor  # every group's (B, T) mask, flattened and concatenated
    best_id: torch.Tensor | None = None  # (1,) int64: the token read back (decode steps)
    best_logit: torch.Tensor | None = None  # (1,) float32: its logit (NaN/inf: a fault)
    done: torch.cuda.Event | None = None  # recorded after a step from this set and its
    # read-backs are queued (on a GPU; ``_mark_done``): the set is refilled only after it
    knobs: torch.Tensor | None = None  # (5,) float64: a sampled step's (``_sample``)
    processing: tuple | None = None  # (ints, floats): its rows of ``_processed``'s inputs


@dataclass
class _Bucket:
    """One captured step size of a cache's graphs, or (``members``) a batch graph of several
    caches' decode steps: its static buffers, views of them, its graph and outputs."""

    size: int
    host: _HostSet  # the set the next step fills
    dev_i64: torch.Tensor
    dev_masks: torch.Tensor
    mask_spans: list  # (start, T, in place) per group
    inputs: tuple | None = None  # (ids, positions, last, layer views)
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # (1, vocab)
    best_logit: torch.Tensor | None = None  # (1,) the logits' maximum, on the device
    best_id: torch.Tensor | None = None  # (1,) its index (the first, as numpy's argmax)
    warm: bool = False  # warmed up (``_warm_up``); no graph after it: the step runs eagerly
    host_logits: torch.Tensor | None = None  # pinned copy of the logits
    spare: _HostSet | None = None  # the other set of greedy steps' double buffering
    dev_knobs: torch.Tensor | None = None  # (5,) float64: ``_sample``'s knobs
    dev_processing: tuple | None = None  # ``_processed``'s (ints, floats) (rows, ...)
    # ``_sample`` over the step's logits as graphs, by whether ``_processed`` runs first;
    # those whose capture failed (they run eagerly)
    samplers: dict = field(default_factory=dict)
    samplers_eager: set = field(default_factory=set)
    draw_out: tuple | None = None  # the samplers' outputs (made once: both graphs write them)
    sampled: tuple | None = None  # (the maximum logit (1,), the drawn token (1,))
    members: tuple = ()  # a batch graph's (``queue_batch``): each sequence's cache's _Graph,
    # whose storage its rows attend over; empty for a bucket of one cache's steps
    anchor: _Graph | None = None  # a batch graph's: the graph whose storage's address
    # ``apart``'s offsets count from (its first members' first; kept while rebound)
    apart: torch.Tensor | None = None  # (layers, 2, N) int64 on the device: each row's keys'
    # and values' offsets from the anchor's, a layer (GPU path; refilled when rebound)
    unread: int = 0  # a batch graph's steps queued whose rows are not yet read

    def flip(self) -> _HostSet:
        """Swap in the other host set (made at the first flip): a step queued ahead fills
        one while the copies of the step before may still read the other."""
        if self.spare is None:
            pinned = self.host.i64.is_pinned()
            self.spare = _HostSet(*(t.clone().pin_memory() if pinned else t.clone()
                                    for t in (self.host.i64, self.host.masks)))
        self.host, self.spare = self.spare, self.host
        return self.host


@dataclass
class _Graph:
    """A cache layout's graphs: the KV storage they write and one bucket per step size."""

    signature: tuple
    owner: weakref.ref
    groups: list[_Group]
    stores: list  # (keys, values) per layer, each (slots + 1, KVH, hd)
    buckets: dict = field(default_factory=dict)  # (size, in place per group) -> _Bucket


def _signature(cache: KVCache) -> tuple:
    return _layout_signature([(layer.plan, tuple(layer.store.keys.shape))
                              for layer in cache.layers], cache.layers[0].store.keys.dtype)


def _layout_signature(layout: list, dtype: torch.dtype) -> tuple:
    """What a graph is captured for: (plan, storage shape (slots, KVH, hd), dtype) a layer
    (``layout``: (plan, shape) a layer), of a cache (``_signature``) or of one about to be
    made (``storage_for``)."""
    return tuple((plan, tuple(shape), dtype) for plan, shape in layout)


def supported(cache: KVCache) -> bool:
    """Can this cache's steps run as graphs? (f16/f32 torch storage, no sink tokens)"""
    return all(isinstance(layer.store, FloatStore) and isinstance(layer.store.keys, torch.Tensor)
               and layer.plan.keep == 0 for layer in cache.layers)


def batch_sets(n: int) -> list[range]:
    """The sets (index ranges, in order) that batch graphs step n decoding sequences in: as
    few as hold them, MAX_BATCH_SEQUENCES at most each and sizes within one of each other
    (9 sequences: 5 and 4, not 8 and a lone one), and no more sets than the batch graphs a
    model keeps (MAX_BATCH_GRAPHS_PER_MODEL: a step of more would capture some of its sets
    again every step, each evicting another); the sequences past their room are left out."""
    held = min(n, MAX_BATCH_SEQUENCES * MAX_BATCH_GRAPHS_PER_MODEL)
    count = -(-held // MAX_BATCH_SEQUENCES)
    sizes = [held // count + (i < held % count) for i in range(count)]  # (larger first)
    bounds = np.cumsum([0, *sizes])
    return [range(int(bounds[i]), int(bounds[i + 1])) for i in range(count)]


def cache_sets(caches: list[KVCache], among: list[int] | None = None) -> list[list[int]]:
    """``batch_sets`` over the sequences ``among`` (indices into caches; default all), taken
    in a fixed order of their caches (by id), not the batch's: an engine's slots keep their
    caches, so the same caches decoding together fall into the same sets however the
    scheduler lists them, and replay the batch graphs captured for those sets. (In the
    batch's order, a request that ends and one that joins in its slot would shift every set
    after it: each a new capture.)"""
    ranked = sorted(range(len(caches)) if among is None else among, key=lambda j: id(caches[j]))
    return [[ranked[at] for at in part] for part in batch_sets(len(ranked))]


def bucket_for(n: int) -> int | None:
    """The smallest bucket that holds n tokens (None: more than the largest)."""
    return next((b for b in BUCKETS if b >= n), None)


def _locked(method):
    """``method`` under its StepGraphs' lock (re-entrant: one locked method calls another)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class StepGraphs:
    """Captures and replays forward steps of up to 512 tokens for a TorchBackend on CUDA.

    On the CPU (``capture`` False: tests) the same static-buffer steps run eagerly each time,
    so everything but the capture itself (the host books, padding, the buffers, adoption,
    the warm-up before a capture) is tested without a GPU.
    """

    def __init__(self, backend):
        self.backend = backend
        self.capture = backend.cuda
        self._graphs: dict[int, list[_Graph]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        # what every graph of a model shares, as only one replays at a time: the logits
        # (rows, vocab) every step writes (by model id and rows: 1, a batch graph's N; a
        # bucket's own would be 1 MB each for Gemma 3's vocabulary), the step inputs'
        # device buffers (by layout and bucket)
        self._logits: dict[tuple, torch.Tensor] = {}
        self._step_inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # batch graphs by model id, then by their caches' graphs (``queue_batch``), least
        # recently used first
        self._batches: dict[int, dict[tuple, _Bucket]] = {}
        # every warm-up and capture on one stream: cuBLAS keeps a workspace per stream
        # (16 MiB on an H100 under torch 2.11), which a new stream per capture would add
        self._stream = torch.cuda.Stream(self.backend.device) if self.capture else None
        # held (``_locked``) from a step's input copies until its outputs' reads are
        # queued, and over the books of graphs and storage: the shared buffers serve one
        # thread's step at a time (``generate`` on a shared Model from several threads,
        # beside the engine's thread), and the GPU runs the steps in the order queued
        self._lock = threading.RLock()
        self.capture_seconds = 0.0  # total time spent capturing (reported apart from speed;
        # the warm-up's kernel tuning, reported as tune_s, excluded)
        self.captures = 0

    def exclusive(self) -> threading.RLock:
        """The graphs' lock, for a caller whose several steps must see no other thread's
        (``Model.forward_batch``: its check that every cache has graphs, then their steps)."""
        return self._lock

    def forward(self, model, tokens: np.ndarray, cache: KVCache,
                evict: bool = True) -> np.ndarray | None:
        """Logits (1, vocab) of the last of ``tokens``, as ``model.forward`` returns them;
        None when the step cannot run as a graph (the caller then runs it eagerly).
        ``evict`` False (an engine's slots): a cache without graphs of its own gets them
        without evicting another live cache's, past MAX_GRAPHS_PER_MODEL too (slots that
        evicted each other's would capture again at every switch, and a slot refused graphs
        would make every batch it is in run eagerly)."""
        logits = self.queue_step(model, tokens, cache, evict)
        return None if logits is None else logits()

    @_locked
    def queue_step(self, model, tokens: np.ndarray, cache: KVCache, evict: bool = True,
                   want_logits: bool = True) -> Callable[[], np.ndarray | None] | None:
        """``forward``'s step queued, its logits' copy to the host too (``want_logits``),
        and not waited for: a function that waits for the step and returns the logits (None
        without ``want_logits``), which the caller must call before the cache's next step;
        None (nothing queued) where ``forward`` returns None. A batch's sequences queue
        their steps one after another and wait once (``Model.forward_batch``): the GPU runs
        each step while the host queues the next."""
        g = self.graph_for_step(model, len(tokens), cache, evict)
        if g is None:
            return None
        return self._logits_reader(self._launch(model, g, bucket_for(len(tokens)), cache,
                                                tokens), want_logits)

    def _logits_reader(self, b: _Bucket, want_logits: bool
                       ) -> Callable[[], np.ndarray | None]:
        """After b's step is queued: its logits' copy to the host queued (``want_logits``)
        and a function that waits for the step and returns them (rows, vocab), or None."""
        if not self.capture:  # (copied now: the logits buffer is every step's)
            logits = b.logits.numpy().copy() if want_logits else None
            return lambda: logits
        if want_logits:
            if b.host_logits is None:  # pinned: a DMA straight into it (pageable: staged)
                b.host_logits = torch.empty(b.logits.shape, dtype=b.logits.dtype,
                                            pin_memory=True)
            # (in stream order: before the next step's replay overwrites the shared logits)
            b.host_logits.copy_(b.logits, non_blocking=True)
        # waited for even where no logits are wanted: the step's inputs were copied from
        # the bucket's pinned host set, which its next launch refills
        done = self._mark_done(b.host)
        copied = b.host_logits if want_logits else None

        def wait() -> np.ndarray | None:
            done.synchronize()
            return None if copied is None else copied.numpy().copy()  # (the buffer is reused)

        return wait

    @_locked
    def queue_batches(self, model, tokens: list[np.ndarray], caches: list[KVCache],
                      want: list[bool]) -> dict[int, Callable[[], np.ndarray | None]]:
        """``queue_batch`` over the sequences of a batch that bring one token (decode), in
        the sets ``cache_sets`` makes of them: {the sequence's index:
        a function that waits and returns its logits (vocab,) or None (``want``)} for those
        queued. The rest (a prompt's chunk; a set of one, or one ``queue_batch`` declines;
        the sequences past the sets' room) are the caller's to step."""
        decoding = [j for j, t in enumerate(tokens) if len(t) == 1]
        waits: dict[int, Callable[[], np.ndarray | None]] = {}
        for group in cache_sets(caches, decoding):
            wait = self.queue_batch(model, [tokens[j] for j in group],
                                    [caches[j] for j in group], [want[j] for j in group])
            if wait is not None:
                rows = functools.cache(wait)  # (waited for once, whichever row asks first)
                waits.update({j: lambda at=at, rows=rows: rows()[at]
                              for at, j in enumerate(group)})
        return waits

    def batch_stream(self, model, tokens: list[np.ndarray], caches: list[KVCache],
                     params: list, rngs: list[np.random.Generator],
                     contexts: Sequence[Sequence[int]] | None = None
                     ) -> Iterator[list[tuple[int, float]]] | None:
        """Decode steps of several caches as the batch graphs of their sets (``cache_sets``:
        one graph for up to 8, ``queue_batch``), each sequence's next token drawn on the
        device by its params' chain (``_sample``; the argmax where ``params.argmax_only``)
        with one uniform of its generator a token as the host's sampler draws it, for ever:
        each step queued before the tokens of the one before are read back (its tokens
        taken from that step's draws on the device), as ``greedy`` runs a lone cache.
        Yields each step's (token, the logits' maximum: NaN or inf marks a fault) a
        sequence, no logits to the host. Every cache holds one token more than was yielded
        until the generator is closed, which waits for that step and trims it from each
        (where one cannot trim, or has no room for it, the step is not run ahead). Copies
        of the generators in ``rngs`` draw each step's uniforms when it is queued, the step
        ahead's included: the caller advances its own one a token taken. ``contexts``: each
        sequence's tokens so far, its token last, for the penalties (as ``sample``'s).
        None, with nothing run or drawn, where a chain needs the host (``samplable``), the
        sets do not hold every cache, or a set cannot step as one batch graph."""
        draws = _draws(params, rngs, model.args.vocab_size, contexts)
        sets = cache_sets(caches)
        if draws is None or sum(map(len, sets)) < len(caches):
            return None
        first = self._queue_sets(model, sets, tokens, caches, draws)
        if first is None:
            return None
        return self._batch_steps(model, sets, caches, draws, first)

    def _batch_steps(self, model, sets: list[list[int]], caches: list[KVCache], draws: list,
                     current: list[_QueuedBatch]):
        ahead = None
        try:
            while True:
                if all(c.fits(2) and c.max_trim() >= 1 for c in caches):
                    ahead = self._queue_sets(model, sets, None, caches, draws, after=current)
                by_sequence = {j: row for s, step in zip(sets, current, strict=True)
                               for j, row in zip(s, step(), strict=True)}
                rows = [by_sequence[j] for j in range(len(caches))]
                for draw, (token, _) in zip(draws, rows, strict=True):
                    if draw is not None:
                        draw.taken(token)
                yield rows
                if ahead is None:
                    ahead = self._queue_sets(model, sets, [np.array([t]) for t, _ in rows],
                                             caches, draws)
                    if ahead is None:  # (the sets ran batch graphs a step ago: no room left)
                        raise RuntimeError("a batch stream's caches can take no more steps")
                current, ahead = ahead, None
        finally:
            if ahead is not None:  # queued but never yielded
                for step in ahead:
                    step()
                for cache in caches:
                    cache.trim(1)

    @_locked
    def _queue_sets(self, model, sets: list[list[int]], tokens: list[np.ndarray] | None,
                    caches: list[KVCache], draws: list,
                    after: list[_QueuedBatch] | None = None) -> list[_QueuedBatch] | None:
        """A drawn step of each set of caches (``queue_batch``; ``after``: each set's step
        before, whose draws are its tokens), or None with none queued where any set cannot
        take one: every set is checked before the first is queued, since a queued set has
        booked its tokens and drawn its uniforms."""
        members = []
        for s in sets:  # (each set's caches' graphs, looked up once: queue_batch takes them)
            members.append(self._batch_members(model, [caches[j] for j in s]))
            if members[-1] is None:
                return None
        return [self.queue_batch(model, None if tokens is None else [tokens[j] for j in s],
                                 [caches[j] for j in s], [True] * len(s),
                                 [draws[j] for j in s], None if after is None else after[at],
                                 members=members[at])
                for at, s in enumerate(sets)]

    @_locked
    def queue_batch(self, model, tokens: list[np.ndarray] | None, caches: list[KVCache],
                    want: list[bool], draws: list[_Draw | None] | None = None,
                    after: _QueuedBatch | None = None,
                    members: list[_Graph] | None = None) -> _QueuedBatch | None:
        """A decode step of several caches (a token each: ``tokens`` (1,) a cache) as the
        one graph of their set, queued and not waited for: a function that waits and
        returns each sequence's logits (vocab,), None where ``want`` says False; or, with
        ``draws`` (a sequence's ``_Draw``, or None for the argmax), each sequence's next
        token drawn on the device (``_sample``, after the step: no logits to the host) and
        the logits' maximum, (token, logit) (NaN or inf: a fault), a uniform drawn from
        each generator when the step is queued; ``tokens`` None: each sequence's token is
        the one drawn ``after`` (the set's step before, queued with draws), on the device.
        Every token goes through the mat-vecs together (each weight read once a step, not
        once a sequence); each attends over its own cache (``_BatchLayer``). Returns None,
        with nothing booked or run, where the batch cannot: off (BATCH_GRAPHS), one sequence or
        more than MAX_BATCH_SEQUENCES, a prompt's tokens, a cache without graphs of its
        own (``graph_for_step``, evicting none) or of another layout than the rest, a token
        that does not fit (ContextOverflow is the caller's) or a write not in place; each
        sequence then replays its own graph. ``members``: the caches' ``_batch_members``,
        where the caller checked them (under the lock; not looked up again)."""
        n = len(caches)
        if tokens is None:  # (the step before's, copied on the device below)
            tokens = [np.zeros(1, np.int64)] * n
        members = members or self._batch_members(model, caches)
        if members is None or any(len(t) != 1 for t in tokens):
            return None
        positions = [c.begin(1) for c in caches]
        order = sorted(range(n), key=lambda j: id(members[j]))  # one graph for a set
        b = self._batch_for(model, tuple(members[j] for j in order))
        if draws is not None:  # (a stream's step ahead fills the other host set)
            b.flip()
        self._advance_batch(b, [caches[j] for j in order],
                            [int(tokens[j][0]) for j in order], [positions[j] for j in order])
        b.dev_i64.copy_(b.host.i64, non_blocking=True)
        b.dev_masks.copy_(b.host.masks, non_blocking=True)
        if after is not None:  # the tokens the step before drew, in this step's rows
            b.dev_i64[:n].copy_(after.drawn_in(order))
        self._replay(model, b)
        if draws is not None:
            self._sample_after(b, [draws[j] for j in order], after is not None)
            self._queue_read_back(b.host, *b.sampled)
            read = functools.partial(self._read_rows, b.host)
        else:
            read = self._logits_reader(b, any(want))
        read = self._counted(b, read)

        def wait() -> list:
            rows = read()
            by_sequence = {j: rows[at] for at, j in enumerate(order)} if rows is not None else {}
            return [by_sequence[j] if draws is not None or want[j] else None
                    for j in range(n)]

        return _QueuedBatch(wait, order, b.sampled[1] if draws is not None else None)

    def _counted(self, b: _Bucket, read: Callable[[], object]) -> Callable[[], object]:
        """``read`` (of b's step, just queued), b's step counted unread until it is first
        called (``_taken_over`` rebinds no batch graph whose outputs a reader, or the step
        after, may still take)."""
        b.unread += 1
        pending = [b]

        def once():
            try:
                return read()
            finally:
                with self._lock:
                    if pending:
                        pending.pop().unread -= 1

        return once

    def _batch_members(self, model, caches: list[KVCache]) -> list[_Graph] | None:
        """The caches' own graphs, which a batch graph of their decode steps attends over,
        or None where they cannot step as one (``queue_batch``'s refusals but a prompt's
        tokens)."""
        n = len(caches)
        if not BATCH_GRAPHS or not 1 < n <= MAX_BATCH_SEQUENCES or not all(
                c.fits(1) for c in caches) or len({id(c) for c in caches}) < n:
            return None
        members = [self.graph_for_step(model, 1, c, evict=False) for c in caches]
        if any(g is None for g in members) or len({g.signature for g in members}) > 1:
            return None
        if not all(c.layers[group.layers[0]].writes_in_place(c.offset, 1)
                   for c, g in zip(caches, members, strict=True) for group in g.groups):
            return None
        return members

    def graph_for_step(self, model, n: int, cache: KVCache,
                       evict: bool = True) -> _Graph | None:
        """The graphs a step of ``n`` tokens of ``cache`` runs in (``forward``; made for the
        cache at its first step), or None where it runs eagerly (nothing is written)."""
        size = bucket_for(n)
        g = self._graph_for(model, cache, evict) if size is not None else None
        if g is None or any(group.ring and n > group.slots for group in g.groups):
            return None  # (a slice longer than a ring: update_and_fetch drops some of it)
        return g

    def decode_graph(self, model) -> torch.cuda.CUDAGraph | None:
        """A captured one-token step of ``model`` (benchmarks replay it alone), if any."""
        for g in self._graphs.get(id(model), []):
            for (size, _), b in g.buckets.items():
                if size == 1 and b.graph is not None:
                    return b.graph
        return None

    def greedy(self, model, token: int, cache: KVCache,
               evict: bool = True) -> Iterator[tuple[int, float]] | None:
        """Greedy decoding after ``token`` (not yet in ``cache``): yields each step's argmax
        and its logit (NaN or inf: the logits were not finite), for ever; None when the
        cache cannot run as graphs.

        Step t+1 is queued, its token read from step t's argmax on the device, before step
        t's token is read back, so the cache holds one token more than was yielded until the
        generator is closed: closing it waits for that step and trims it again. A cache that
        could not trim it (a ring holding no spare slot) is not run ahead. ``evict``: as
        ``forward``'s."""
        g = self._graph_for(model, cache, evict)
        if g is None:
            return None
        return self._decode_steps(model, g, token, cache)

    def sample(self, model, token: int, cache: KVCache, params, rng: np.random.Generator,
               evict: bool = True, context: Sequence[int] | None = None
               ) -> Iterator[tuple[int, float]] | None:
        """Decoding after ``token`` with ``params``' chain drawn on the device (``_processed``:
        logit bias and penalties, then ``_sample``: top-k, top-p, min-p, temperature, the
        draw), one uniform of ``rng`` a step drawn on the host as ``make_sampler`` draws it:
        yields each step's token and the logits' maximum (NaN or inf: a fault), for ever,
        run one step ahead as ``greedy``'s; None when the cache cannot run as graphs or the
        chain needs the host (``samplable``). ``context``: the tokens so far, ``token``
        last, which the penalties look back over (None: a chain with penalties samples on
        the host). A step's uniform is drawn when it is queued, the step ahead's included:
        a closed generator has taken one more from ``rng`` than it yielded tokens.
        ``evict``: as ``forward``'s."""
        samples = samplable(params, model.args.vocab_size, context is not None)
        g = self._graph_for(model, cache, evict) if samples else None
        if g is None:
            return None
        return self._decode_steps(model, g, token, cache, _Draw(params, rng, context))

    def _decode_steps(self, model, g: _Graph, token: int, cache: KVCache,
                      draw: _Draw | None = None):
        current = self._queue_decode(model, g, cache, np.array([token], dtype=np.int64),
                                      draw)
        ahead = None
        try:
            while True:
                # (fits(2): the last free slot is left to a token read back, so a caller that
                # stops when the cache cannot take one more stops where it would without this)
                if cache.fits(2) and cache.max_trim() >= 1:
                    ahead = self._queue_decode(model, g, cache, None, draw)
                token, logit = self._read_back(current)
                if draw is not None:
                    draw.taken(token)
                yield token, logit
                if ahead is None:
                    ahead = self._queue_decode(model, g, cache, np.array([token]), draw)
                current, ahead = ahead, None
        finally:
            if ahead is not None:  # queued but never yielded
                self._read_back(ahead)
                cache.trim(1)

    @_locked
    def _queue_decode(self, model, g: _Graph, cache: KVCache, tokens: np.ndarray | None,
                       draw: _Draw | None = None) -> _HostSet:
        """Queue one decode step (its token from the host, or None: the previous step's
        token on the device) and the read-back of its token: the argmax, or (``draw``) the
        token ``_sample`` draws; the host set to read."""
        chained = tokens is None
        b = self._launch(model, g, 1, cache, np.zeros(1, np.int64) if chained else tokens,
                         from_device=chained, flip=True, draw=draw)
        self._queue_read_back(b.host, *(b.sampled if draw is not None
                                        else (b.best_logit, b.best_id)))
        return b.host

    def _queue_read_back(self, host: _HostSet, best_logit: torch.Tensor,
                         best_id: torch.Tensor) -> None:
        """Queue the copy of a step's tokens (rows,) and their logits into ``host``
        (pinned buffers made at its first step), then mark it done."""
        if host.best_id is None:  # made once per host set
            pin = self.capture
            host.best_id = torch.empty(best_id.shape, dtype=torch.int64, pin_memory=pin)
            host.best_logit = torch.empty(best_id.shape, dtype=torch.float32, pin_memory=pin)
        host.best_id.copy_(best_id, non_blocking=True)
        host.best_logit.copy_(best_logit, non_blocking=True)
        self._mark_done(host)

    def _mark_done(self, host: _HostSet) -> torch.cuda.Event | None:
        """Record ``host.done`` after what was just queued (None on the CPU: nothing runs
        ahead there)."""
        if not self.capture:
            return None
        if host.done is None:
            host.done = torch.cuda.Event()
        host.done.record()
        return host.done

    @staticmethod
    def _read_back(host: _HostSet) -> tuple[int, float]:
        return StepGraphs._read_rows(host)[0]

    @staticmethod
    def _read_rows(host: _HostSet) -> list[tuple[int, float]]:
        """Each row's (token, logit) that ``_queue_read_back`` copied, once its step is done."""
        if host.done is not None:
            host.done.synchronize()
        return list(zip(host.best_id.tolist(), host.best_logit.tolist(), strict=True))

    def _launch(self, model, g: _Graph, size: int, cache: KVCache, tokens: np.ndarray,
                from_device: bool = False, flip: bool = False,
                draw: _Draw | None = None) -> _Bucket:
        """Book ``tokens`` in the cache and queue their step in bucket ``size`` (captured at
        its first use); ``from_device``: the first token is the previous step's argmax (or,
        ``draw``, its drawn token). ``flip``: fill the bucket's other host set (greedy steps
        run one step ahead). ``draw``: a token is drawn from the step's logits after it
        (``_sample_after``)."""
        positions = cache.begin(len(tokens))  # ContextOverflow as forward would raise it
        layout = tuple(cache.layers[group.layers[0]].writes_in_place(int(positions[0]), size)
                       for group in g.groups)
        b = g.buckets.get((size, layout))
        if b is None:
            b = g.buckets[(size, layout)] = self._new_bucket(g, size, layout)
        if flip:
            b.flip()
        self._advance(g, b, cache, tokens, positions)
        b.dev_i64.copy_(b.host.i64, non_blocking=True)
        b.dev_masks.copy_(b.host.masks, non_blocking=True)
        if from_device:  # the bucket's last token, stream-ordered after its step
            b.dev_i64[:1].copy_(b.sampled[1] if draw is not None else b.best_id)
        if b.inputs is None:
            b.inputs = self._inputs(g, b)
        self._replay(model, b)
        if draw is not None:
            self._sample_after(b, [draw], from_device)
        return b

    def _replay(self, model, b: _Bucket) -> None:
        """Queue b's step over its device inputs (filled): its graph's replay, captured at
        its first use (the CPU: warmed up, then its steps run eagerly each time)."""
        if not b.warm:
            b.warm = True
            if not self.capture:  # (the CPU: tests) warmed up as a capture is, so that the
                self._warm_up(model, b)  # tests hold what a warm-up leaves behind
            else:
                try:
                    self._capture(model, b)
                except RuntimeError as exc:  # an op that cannot be captured: this bucket
                    # runs its static-buffer step eagerly from now on
                    log.warning("CUDA graph capture of a %d-token step failed (%s); running "
                                "it eagerly", b.size, exc)
        if b.graph is not None:
            b.graph.replay()
        else:
            self.backend._rope_memo = (None, {})  # same positions tensor, new values
            b.logits = self._shared_logits(model, _step(model, *b.inputs))
            if not b.members:
                b.best_logit, b.best_id = _greedy(b.logits)

    def _sample_after(self, b: _Bucket, draws: list[_Draw | None], chained: bool) -> None:
        """Queue ``_sample`` over b's logits, a row a draw (None: the argmax), with this
        step's knobs (copied from its host set), after ``_processed`` where a draw has bias
        or penalties (``chained``: the step's tokens are the draws of the step before), as
        a graph of its own where the step's is one (captured at its first use)."""
        host, rows = b.host, len(draws)
        if host.knobs is None:
            host.knobs = torch.empty((rows, 5), dtype=torch.float64, pin_memory=self.capture)
        host.knobs.numpy()[:] = [GREEDY_KNOBS if d is None else d.knobs() for d in draws]
        if b.dev_knobs is None:
            b.dev_knobs = torch.empty((rows, 5), dtype=torch.float64,
                                      device=self.backend.device)
        b.dev_knobs.copy_(host.knobs, non_blocking=True)
        processes = any(d is not None and d.processes for d in draws)
        if processes:
            self._fill_processing(b, draws, chained)
        sampler = b.samplers.get(processes)
        if sampler is not None:
            sampler.replay()
            b.sampled = b.draw_out
        elif b.graph is None or processes in b.samplers_eager:  # (eager: new logits each time)
            b.sampled = self._draw(b, processes)
        else:
            try:
                b.samplers[processes] = self._capture_sampler(b, processes)
                b.samplers[processes].replay()
            except RuntimeError as exc:
                log.warning("CUDA graph capture of the sampler failed (%s); drawing eagerly",
                            exc)
                b.samplers.pop(processes, None)
                b.samplers_eager.add(processes)
                b.sampled = self._draw(b, processes)

    def _fill_processing(self, b: _Bucket, draws: list[_Draw | None], chained: bool) -> None:
        """Each row's ``_processed`` inputs into b's host set and, stream-ordered, its
        device buffers (a row without bias or penalties changes nothing)."""
        host, rows = b.host, len(draws)
        if host.processing is None:
            host.processing = tuple(
                torch.empty((rows, n), dtype=dtype, pin_memory=self.capture)
                for n, dtype in zip(PROCESSING_WIDTHS, (torch.int64, torch.float32),
                                    strict=True))
        ints, floats = (t.numpy() for t in host.processing)
        vocab = b.logits.shape[-1]
        for row, d in enumerate(draws):
            if d is not None and d.processes:
                d.processing(chained, vocab, ints[row], floats[row])
            else:
                _unprocessed(ints[row], floats[row])
        if b.dev_processing is None:
            b.dev_processing = tuple(torch.empty_like(t, device=self.backend.device)
                                     for t in host.processing)
        for dev, pinned in zip(b.dev_processing, host.processing, strict=True):
            dev.copy_(pinned, non_blocking=True)

    def _draw(self, b: _Bucket, processes: bool, out: tuple | None = None) -> tuple:
        """``_sample`` over b's logits (after ``_processed``: ``processes``) and knobs."""
        logits = b.logits
        if processes:  # (the window's last token: each row's input, this step's own)
            logits = _processed(logits, b.dev_i64[:logits.shape[0]], *b.dev_processing)
        return _sample(logits, b.dev_knobs, out=out)

    def _capture_sampler(self, b: _Bucket, processes: bool) -> torch.cuda.CUDAGraph:
        """``_draw`` over b's (static) logits and inputs as a graph, after a warm-up, into
        b's draw outputs (one pair, which every sampler graph of b writes)."""
        if b.draw_out is None:
            b.draw_out = self._outputs(b.logits.shape[0])
        b.sampled = b.draw_out
        graph, _ = self._record(lambda: self._draw(b, processes),
                                lambda: self._draw(b, processes, out=b.draw_out))
        return graph

    def _outputs(self, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """A (rows,) float32 and a (rows,) int64 on the device, outside the graphs' pool,
        for a captured step's tokens and their logits. Captures share one pool, in which
        blocks a capture freed are another capture's to take: an output allocated inside a
        capture can lie in the scratch of a graph captured before it, which that graph's
        replay overwrites. A decode step run ahead reads its token from the step before after
        other graphs may have replayed (another cache's, on another thread): from the pool,
        that token could be any number, and the embedding's read of it a fault."""
        dev = self.backend.device
        return (torch.empty(rows, dtype=torch.float32, device=dev),
                torch.empty(rows, dtype=torch.int64, device=dev))

    def _shared_logits(self, model, logits: torch.Tensor) -> torch.Tensor:
        """A step's logits copied into the model's one logits buffer of their rows (made at
        the first capture: in the graphs' pool, kept; a batch graph's has a row a
        sequence), which its readers (the host's copy, the sampler's graph, the greedy
        argmax) take before the next replay, in stream order."""
        key = (id(model), logits.shape[0])
        shared = self._logits.get(key)
        if shared is None or shared.shape != logits.shape or shared.dtype != logits.dtype:
            shared = self._logits[key] = torch.empty_like(logits)
        return shared.copy_(logits)

    def _record(self, warm_up, work) -> tuple[torch.cuda.CUDAGraph, object]:
        """``warm_up()`` on the side stream, then ``work()`` captured there as a graph in the
        shared pool: (the graph, what work returned: its static outputs).

        The capture is thread-local (``capture_error_mode``): only this thread's unsafe
        calls may break it. A global capture (torch's default) forbids them in every
        thread of the process, so an embedding app's own CUDA work on another thread
        (an allocation, a copy on its stream, a sync of it) would fail there or void the
        capture, and the step would run eagerly from then on (the 1.5B through the engine
        on an H200: 27 t/s against 638). What other threads launch on their own streams is
        not captured either way: capture follows the stream."""
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm_up()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side,
                              capture_error_mode="thread_local"):
            out = work()
        return graph, out

    # -- host books ------------------------------------------------------------------------
    def _advance(self, g: _Graph, b: _Bucket, cache: KVCache, tokens: np.ndarray,
                 positions: np.ndarray) -> None:
        """What update_and_fetch does on the host for these tokens, once per layout; the
        pads (rows n..B) repeat the last token and position and write the spare row."""
        n, size = len(tokens), b.size
        i64 = b.host.i64.numpy()
        masks = b.host.masks.numpy()
        i64[:n], i64[n:size] = tokens, tokens[-1]
        i64[size:size + n], i64[size + n:2 * size] = positions, positions[-1]
        i64[2 * size] = n - 1
        for gi, group in enumerate(g.groups):
            start, width, in_place = b.mask_spans[gi]
            mask = masks[start:start + size * width].reshape(size, width)
            slots = _book(cache, group, positions, mask, in_place)
            mask[n:] = mask[n - 1]  # pads: the last row's (no row without a visible key)
            base = 2 * size + 1 + gi * size
            i64[base:base + n], i64[base + n:base + size] = slots, group.slots
            i64[_span_index(size, len(g.groups), gi)] = _span(mask)

    @staticmethod
    def _advance_batch(b: _Bucket, caches: list[KVCache], tokens: list[int],
                       positions: list[np.ndarray]) -> None:
        """``_advance`` for a batch graph: cache j's token at positions[j] (1,) booked in it
        and written into row j of b's host inputs (``_batch_inputs``' layout)."""
        n, groups = b.size, b.members[0].groups
        i64, masks = b.host.i64.numpy(), b.host.masks.numpy()
        i64[:n], i64[n:2 * n] = tokens, np.concatenate(positions)
        for gi, group in enumerate(groups):
            start, width, _ = b.mask_spans[gi]
            mask = masks[start:start + n * width].reshape(n, width)
            for j, (cache, at) in enumerate(zip(caches, positions, strict=True)):
                row = mask[j:j + 1]
                i64[_batch_index(n, len(groups), "slots", gi) + j] = _book(
                    cache, group, at, row, True)[0]
                i64[_batch_index(n, len(groups), "spans", gi) + j] = _span(row)

    # -- graphs ----------------------------------------------------------------------------
    @_locked
    def _graph_for(self, model, cache: KVCache, evict: bool = True) -> _Graph | None:
        """The cache's graphs (adopted or new at its first step); None for a cache that
        cannot run as graphs (``supported``: checked once, its layout never changes).
        ``evict``: as ``forward``'s."""
        graphs = self._graphs.setdefault(id(model), [])
        for g in graphs:  # every step but the first: no signature (~0.1 ms of host time)
            if g.owner() is cache:
                return g
        if not supported(cache):
            return None
        claim = cache.layers[0].store.keys
        for g in graphs:  # the cache was made in g's storage (storage_for): nothing to copy
            if g.owner() is claim:
                g.owner = weakref.ref(cache)
                return g
        sig = _signature(cache)
        for g in graphs:  # adopt a graph whose cache is gone
            if g.signature == sig and g.owner() is None:
                self._attach(g, cache)
                return g
        for gone in _make_room(graphs, evict):
            self._drop_batches_of(model, gone)
        g = self._new_graph(cache, sig)
        graphs.append(g)
        return g

    def _batch_for(self, model, members: tuple[_Graph, ...]) -> _Bucket:
        """The batch graph of these caches' graphs (at the set's first step another's taken
        over, ``_taken_over``, or made; the least recently used goes past
        MAX_BATCH_GRAPHS_PER_MODEL)."""
        batches = self._batches.setdefault(id(model), {})
        key = tuple(id(g) for g in members)  # (members hold their graphs: no id reused)
        b = (batches.pop(key, None) or self._taken_over(batches, members)
             or self._new_batch(members))
        batches[key] = b  # the most recent last
        while len(batches) > MAX_BATCH_GRAPHS_PER_MODEL:
            batches.pop(next(iter(batches)))
        return b

    def _taken_over(self, batches: dict, members: tuple[_Graph, ...]) -> _Bucket | None:
        """The least recently used batch graph of another set of the members' size and
        layout whose steps were all read, made theirs (``_rebind``) and taken out of
        ``batches``; None where none can be. (A capture costs a warm-up of two steps and
        the capture; sets change at every request an engine admits or finishes.)"""
        n, sig = len(members), members[0].signature
        for key, b in batches.items():  # the least recently used first
            if (b.size == n and b.anchor.signature == sig and b.unread == 0
                    and self._rebind(b, members)):
                del batches[key]
                return b
        return None

    def _rebind(self, b: _Bucket, members: tuple[_Graph, ...]) -> bool:
        """Make b the batch graph of other members, without a capture, where it can be:
        its layers attended in one launch (the GPU path), at offsets from its anchor's
        storage, which are refilled in place (a captured graph reads them from that
        table), the anchor kept; or nothing was captured (its inputs then bound anew, the
        first member the anchor). Returns whether b was rebound (not: its captured
        layers attend a member's own storage at a time)."""
        layers = b.inputs[3]
        kept = (b.apart is not None
                and all(layer.one_launch is not False for layer in layers))
        table = self._offset_table(b.anchor, members) if kept else None
        if table is not None:  # (stream-ordered: after b's steps, all read; before its next)
            b.apart.copy_(table.pin_memory() if self.capture else table, non_blocking=True)
        elif b.graph is not None:
            return False
        else:
            self._anchor(b, members)
        self._bind(b, members)
        return True

    def _anchor(self, b: _Bucket, members: tuple[_Graph, ...]) -> None:
        """The first member b's anchor, and b.apart a new table of offsets from it (None
        where the kernels cannot take them)."""
        b.anchor, table = members[0], self._offset_table(members[0], members)
        b.apart = None if table is None else table.to(self.backend.device)

    def _bind(self, b: _Bucket, members: tuple[_Graph, ...]) -> None:
        """b's layers attend over the members' storage (at b.apart's offsets from b's
        anchor's, where there are any)."""
        b.members = members
        for layer in b.inputs[3]:
            at = layer.layer
            layer.bind(members, b.anchor,
                       None if b.apart is None else (b.apart[at, 0], b.apart[at, 1]))

    def _offset_table(self, anchor: _Graph, members: tuple[_Graph, ...]
                      ) -> torch.Tensor | None:
        """Each member's keys' and values' offsets from the anchor's, a layer (int64
        (layers, 2, N) on the host: ``kernels.attention``'s ``apart``), or None where the
        kernels cannot take them (CPU torch; storage not 64-byte aligned: the layers then
        attend a member at a time)."""
        kernels = self.backend.kernels
        if kernels is None:
            return None
        try:
            return torch.tensor([[kernels.offset_elements(
                [g.stores[li][i] for g in members], base.data_ptr(), base.dtype,
                base.element_size()) for i, base in enumerate(stores)]
                for li, stores in enumerate(anchor.stores)], dtype=torch.int64)
        except ValueError:
            return None

    def _drop_batches_of(self, model, g: _Graph) -> None:
        """Forget the batch graphs over g's storage, or counting from its address (g itself
        is gone)."""
        batches = self._batches.get(id(model), {})
        for key in [key for key, b in batches.items()  # (identity: _Graph's == is fields')
                    if b.anchor is g or any(m is g for m in b.members)]:
            del batches[key]

    def _new_batch(self, members: tuple[_Graph, ...]) -> _Bucket:
        """A batch graph's buffers and inputs (``_batch_index``' layout: tokens, positions,
        then each group's write slots and mask spans, a sequence each; each group's masks
        (N, T)); its graph is captured at its first replay."""
        n, lead = len(members), members[0]
        groups = lead.groups
        spans, total = [], 0
        for group in groups:  # (in place: decode's write replaces no key it attends to)
            spans.append((total, group.slots, True))
            total += n * group.slots
        b = _Bucket(n, *self._step_buffers(("batch", lead.signature, n),
                                           _batch_index(n, len(groups), "end"), total),
                    spans, members=members)
        b.inputs = self._batch_inputs(b)
        self._anchor(b, members)
        self._bind(b, members)
        return b

    def _batch_inputs(self, b: _Bucket) -> tuple:
        """(ids (N,), positions (N,), no last row (every row's logits), per-layer
        ``_BatchLayer``s over each sequence's storage: ``_bind``) on b's device buffers."""
        n, groups = b.size, b.members[0].groups
        i64, kernels = b.dev_i64, self.backend.kernels
        layers = {}
        for gi, group in enumerate(groups):
            start, width, _ = b.mask_spans[gi]
            masks = b.dev_masks[start:start + n * width].view(n, width)
            slots = _batch_index(n, len(groups), "slots", gi)
            spans = _batch_index(n, len(groups), "spans", gi)
            rows = [(i64[slots + j:slots + j + 1], masks[j:j + 1], i64[spans + j:spans + j + 1])
                    for j in range(n)]  # (a sequence's: its part's)
            group_slots, group_spans = i64[slots:slots + n], i64[spans:spans + n]
            for li in group.layers:
                layers[li] = _BatchLayer(li, rows, group_slots, masks, group_spans,
                                         group.slots, kernels)
        return i64[:n], i64[n:2 * n], None, [layers[i] for i in range(len(layers))]

    @staticmethod
    def _attach(g: _Graph, cache: KVCache) -> None:
        """Make g's storage the cache's: its rows copied in (unless they are there already:
        the cache's own storage), the cache viewing them, a layer at a time."""
        for layer, stores in zip(cache.layers, g.stores, strict=True):
            rows, store = layer.plan.slots, layer.store
            for name, full in zip(("keys", "values"), stores, strict=True):
                if full.data_ptr() != getattr(store, name).data_ptr():
                    full[:rows].copy_(getattr(store, name))
                setattr(store, name, full[:rows])
        g.owner = weakref.ref(cache)

    def _new_graph(self, cache: KVCache, sig: tuple) -> _Graph:
        groups: dict = {}
        for i, layer in enumerate(cache.layers):
            groups.setdefault(layer.plan, []).append(i)
        group_list = [_Group(ids, plan.slots, plan.is_ring)
                      for plan, ids in groups.items()]
        stores = [(_with_spare_row(layer.store.keys), _with_spare_row(layer.store.values))
                  for layer in cache.layers]
        g = _Graph(sig, weakref.ref(cache), group_list, stores)
        self._attach(g, cache)
        return g

    # -- KV storage --------------------------------------------------------------------------
    @_locked
    def storage_for(self, model, layout: list, dtype: torch.dtype) -> list[tuple] | None:
        """Zeroed storage for a new cache of ``model`` (``Backend.kv_storage``; ``layout``:
        (plan, (slots, KVH, hd)) per layer): the storage of a graph of that layout whose
        cache is gone, claimed for this cache (which adopts the graph at its first step
        with nothing copied), else new tensors with the graphs' spare row, which the
        cache's first graph takes as its own. So a cache and its graph are one storage,
        never two: a chat's 4,096-slot cache of the 1.5B is 117 MB, and 32,768 slots 0.9 GB.
        None for caches graphs do not run (sink tokens)."""
        if any(plan.keep for plan, _ in layout):
            return None
        sig = _layout_signature(layout, dtype)
        for g in self._graphs.get(id(model), []):
            if g.signature == sig and g.owner() is None:
                views = [tuple(t.zero_()[:plan.slots] for t in pair)
                         for (plan, _), pair in zip(layout, g.stores, strict=True)]
                g.owner = weakref.ref(views[0][0])  # claimed until the cache's first step
                return views
        device = self.backend.device
        return [tuple(torch.zeros((slots + 1, *rest), dtype=dtype, device=device)
                      .as_subclass(KVStorage)[:slots] for _ in range(2))
                for _, (slots, *rest) in layout]

    def _new_bucket(self, g: _Graph, size: int, layout: tuple) -> _Bucket:
        spans, total = [], 0
        for in_place, group in zip(layout, g.groups, strict=True):
            width = group.slots + (0 if in_place else size)
            spans.append((total, width, in_place))
            total += size * width
        return _Bucket(size, *self._step_buffers(
            (g.signature, size, layout), _span_index(size, len(g.groups), len(g.groups)),
            total), spans)

    def _step_buffers(self, key: tuple, n_i64: int, n_masks: int
                      ) -> tuple[_HostSet, torch.Tensor, torch.Tensor]:
        """A new bucket's host set (n_i64 int64s, n_masks mask bytes; pinned on a GPU: copied
        to the device without a stall) and the device buffers of ``key`` (its layout and
        size), which every graph of that key shares: each launch fills all of them,
        stream-ordered after the replay before (the host sets are each bucket's own: a
        launch's copy from them may still be under way)."""
        host_i64 = torch.zeros(n_i64, dtype=torch.int64)
        host_masks = torch.zeros(n_masks, dtype=torch.bool)
        if self.capture:
            host_i64, host_masks = host_i64.pin_memory(), host_masks.pin_memory()
        if key not in self._step_inputs:
            dev = self.backend.device
            self._step_inputs[key] = (host_i64.to(dev), host_masks.to(dev))
        return (_HostSet(host_i64, host_masks), *self._step_inputs[key])

    def _inputs(self, g: _Graph, b: _Bucket) -> tuple:
        """(ids (B,), positions (B,), last (1,), per-layer views) over b's device buffers."""
        size, layers = b.size, {}
        for gi, group in enumerate(g.groups):
            start, width, in_place = b.mask_spans[gi]
            base = 2 * size + 1 + gi * size
            slots = b.dev_i64[base:base + size]
            mask = b.dev_masks[start:start + size * width].view(size, width)
            at = _span_index(size, len(g.groups), gi)
            for li in group.layers:
                layers[li] = _StepLayer(*g.stores[li], slots, mask, b.dev_i64[at:at + 1],
                                        group.slots, in_place, self.backend.kernels)
        i64 = b.dev_i64
        return (i64[:size], i64[size:2 * size], i64[2 * size:2 * size + 1],
                [layers[i] for i in range(len(layers))])

    @staticmethod
    def _warm_up(model, b: _Bucket) -> None:
        """Run b's step twice (triton compiles, kernels are tuned) with every key and value
        written to the spare row, then put the step's write slots back: the cache's rows
        are as before. A step over the rows before its write followed by the new ones
        (``writes_in_place`` False: a ring whose slice would overwrite keys it needs) reads
        the very rows its write replaces: a warm-up that kept its writes would have the
        step replayed after it attend over its own new keys where the old ones belonged
        (an H200 then parted from eager steps by up to 0.3 logit at a second turn's prompt
        once a window's ring had wrapped). (Copies of the rows, put back after, did the
        same with a bucket's rows of every layer held: 9.4 MB for Gemma 3's 512 tokens.)"""
        groups = {id(layer.slots): layer for layer in b.inputs[3]}.values()  # (shared)
        saved = [layer.slots.clone() for layer in groups]  # (B,) each
        for layer in groups:
            layer.slots.fill_(layer.stored)  # the spare row, which no query reads
        for _ in range(2):
            _step(model, *b.inputs)
        for layer, slots in zip(groups, saved, strict=True):
            layer.slots.copy_(slots)

    def _capture(self, model, b: _Bucket) -> None:
        """Warm up on a side stream (``_warm_up``: the cache as it was after), then capture
        one step (a capture runs nothing)."""
        start, tuned = time.perf_counter(), self.backend.tuning_seconds()

        if not b.members:  # (a batch's logits go to the host: sampled there)
            b.best_logit, b.best_id = self._outputs()

        def step():
            self.backend._rope_memo = (None, {})  # tables must be computed inside the graph
            logits = self._shared_logits(model, _step(model, *b.inputs))
            if not b.members:
                _greedy(logits, out=(b.best_logit, b.best_id))
            return logits

        b.graph, b.logits = self._record(lambda: self._warm_up(model, b), step)
        self.backend._rope_memo = (None, {})
        torch.cuda.synchronize()
        # kernel variants timed during the warm-up are the tuning's time (``tune_s``)
        tuning = self.backend.tuning_seconds() - tuned
        self.capture_seconds += time.perf_counter() - start - tuning
        self.captures += 1


def _make_room(graphs: list[_Graph], evict: bool) -> list[_Graph]:
    """Make room in a model's graphs for one more: graphs whose cache is gone (orphans:
    their storage waits for a new cache of their layout) go first, oldest first, and at
    most MAX_ORPHANS_PER_MODEL of them stay (each holds a dead cache's memory); then, at
    MAX_GRAPHS_PER_MODEL and with ``evict``, the oldest live cache's graphs go (without,
    the model keeps one more: ``StepGraphs.forward``). Returns the graphs removed."""
    gone = []
    orphans = [g for g in graphs if g.owner() is None]
    while orphans and (len(orphans) > MAX_ORPHANS_PER_MODEL
                       or len(graphs) >= MAX_GRAPHS_PER_MODEL):
        gone.append(orphans.pop(0))
        graphs.remove(gone[-1])
    if evict and len(graphs) >= MAX_GRAPHS_PER_MODEL:
        gone.append(graphs.pop(0))
    return gone


def _with_spare_row(t: torch.Tensor) -> torch.Tensor:
    """A graph's store (rows + 1, KVH, hd) for a cache layer's keys or values t (rows, KVH,
    hd): t's own base where t is a view of one from row 0 (``storage_for``'s), else new
    zeros that ``_attach`` copies t's rows into."""
    full = t._base  # (a plain tensor: a view's base loses the subclass)
    if full is None or full.shape[0] != t.shape[0] + 1 or full.data_ptr() != t.data_ptr():
        full = torch.zeros((t.shape[0] + 1, *t.shape[1:]), dtype=t.dtype, device=t.device)
    return full.as_subclass(type(t))


def _book(cache: KVCache, group: _Group, positions: np.ndarray, mask: np.ndarray,
          in_place: bool) -> np.ndarray:
    """What update_and_fetch does on the host for tokens at ``positions`` (n,) in the
    group's layers of ``cache`` (their slot positions and offsets), and their visibility in
    mask[:n] (over the group's storage after the write, or, not ``in_place``, over the rows
    before it followed by mask's rows of new ones); returns the write slots (n,)."""
    n = len(positions)
    lead = cache.layers[group.layers[0]]
    slots = lead.slot_of(positions)
    if not in_place:  # attends over the rows before the write, then the new ones
        old = np.where(lead.slot_pos < positions[0], lead.slot_pos, -1)
        pads = np.full(mask.shape[0] - n, -1)  # never seen
        mask[:n] = lead.mask(positions, np.concatenate([old, positions, pads]))
    for li in group.layers:
        layer = cache.layers[li]
        layer.slot_pos[slots] = positions
        layer.offset = int(positions[-1]) + 1
    if in_place:
        mask[:n] = lead.mask(positions, lead.slot_pos)
    return slots


def _span(mask: np.ndarray) -> int:
    """The columns of mask (rows, T) up to the last that any row sees."""
    seen = mask.any(axis=0)  # (T,)
    return mask.shape[1] - int(np.argmax(seen[::-1]))


def _batch_index(n: int, n_groups: int, part: str, group: int = 0) -> int:
    """Where a batch graph of n sequences keeps ``part`` of a group in its int64 buffer:
    tokens (n), positions (n), every group's write slots (n each), then every group's mask
    spans (n each); "end": the buffer's length."""
    slots = 2 * n
    spans = slots + n_groups * n
    return {"slots": slots + group * n, "spans": spans + group * n,
            "end": spans + n_groups * n}[part]


def _span_index(size: int, n_groups: int, group: int) -> int:
    """Where group's mask span sits in a bucket's int64 buffer: after the tokens, positions
    (size each), the last row (1) and every group's write slots (size each)."""
    return 2 * size + 1 + n_groups * size + group


def _step(model, ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor | None,
          layers: list) -> torch.Tensor:
    """Model.forward's steps for B tokens (ids, positions (B,) on the device): the logits
    (1, vocab) of row ``last``, or (``last`` None: a batch graph's) of every row (B,
    vocab)."""
    B = model.backend
    x = B.embed(model.tok_embd, ids)  # (B, d)
    if model.embed_scale != 1.0:
        x = B.scale(x, model.embed_scale)
    # each block's last add also applies the next norm (the last block's: the output norm)
    x = model.chained_blocks(x, positions, layers)
    if last is not None and x.shape[0] > 1:
        x = x.index_select(0, last)  # (1, d)
    logits = B.matmul(x, model.output)  # (1, vocab)
    if model.args.final_logit_softcap:
        logits = B.softcap(logits, model.args.final_logit_softcap)
    return logits


#: the most logits ``_sample`` draws among (a top-k above it samples on the host)
SAMPLE_CANDIDATES = 64
#: the most recent tokens a chain's penalties look back over on the device
#: (``penalty_last_n`` 1..this; llama.cpp's default and edgellm's is 64; a longer window,
#: or the whole history, samples on the host)
PENALTY_WINDOW = 64
#: the most logit_bias entries the device adds (more sample on the host)
SAMPLE_BIASES = 128
#: a row of ``_processed``'s inputs: int64 (the window's tokens the host knows, W - 1; the
#: bias's ids), f32 (the window's weights, W; the biases; repetition, frequency and presence
#: penalties), W = PENALTY_WINDOW
PROCESSING_WIDTHS = (PENALTY_WINDOW - 1 + SAMPLE_BIASES, PENALTY_WINDOW + SAMPLE_BIASES + 3)


def samplable(params, vocab: int, has_context: bool = True) -> bool:
    """Can the device draw params' tokens after ``_processed`` (logit bias, penalties over
    the last PENALTY_WINDOW tokens at most; ``has_context`` False: the caller gave no
    tokens so far, which penalties need) and ``_sample`` (top-k of 1..SAMPLE_CANDIDATES,
    below the vocabulary, or greedy over processed logits)? Not where only the argmax is
    wanted (``argmax_only``: ``_greedy``'s, in the step's own graph)."""
    window = not params.penalizes or (
        has_context and 0 < params.penalty_last_n <= PENALTY_WINDOW)
    bias = len(params.logit_bias) <= SAMPLE_BIASES and all(
        0 <= token < vocab for token in params.logit_bias)
    chain = params.greedy or 0 < params.top_k <= min(SAMPLE_CANDIDATES, vocab - 1)
    return not params.argmax_only and window and bias and chain


def _draws(params: list, rngs: list[np.random.Generator], vocab: int,
           contexts: list | None = None) -> list | None:
    """A sequence's ``_Draw`` with a copy of its generator (None: its argmax) for each of
    ``params`` (``contexts``: each one's tokens so far, its next input last, for the
    penalties), or None where a chain needs the host (``samplable``)."""
    if not all(p.argmax_only or samplable(p, vocab, contexts is not None) for p in params):
        return None
    contexts = contexts or [None] * len(params)
    return [None if p.argmax_only else _Draw(p, copy.deepcopy(rng), context)
            for p, rng, context in zip(params, rngs, contexts, strict=True)]


def _unprocessed(ints: np.ndarray, floats: np.ndarray) -> None:
    """Fill a row of ``_processed``'s inputs that changes nothing (a batch's argmax row):
    no token counted, no bias, penalties (1, 0, 0)."""
    ints[:], floats[:] = 0, 0.0
    floats[-3] = 1.0


class _Draw:
    """A sampled decode's knobs and generator: each step's (temperature, top-p (2: off),
    min-p, a uniform of the generator, top-k) for ``_sample``, and (``processes``: logit
    bias or penalties) its row of ``_processed``'s inputs, from the tokens so far
    (``context``: the last PENALTY_WINDOW of them where there are penalties, which the
    decode loop extends with each token it reads back)."""

    def __init__(self, params, rng: np.random.Generator, context=None):
        self.params, self.rng = params, rng
        self.context = (list(context[-PENALTY_WINDOW:])
                        if context is not None and params.penalizes else None)
        self.processes = bool(params.penalizes or params.logit_bias)
        self._row = self._fixed_row() if self.processes else None

    def knobs(self) -> list[float]:
        p = self.params
        if p.greedy:  # (penalised greedy: the host's argmax draws no uniform)
            return list(GREEDY_KNOBS)
        # (one uniform a token, as Generator.choice takes it: the host's draws, seed for seed)
        return [p.temperature, p.top_p if p.top_p < 1.0 else 2.0, p.min_p, self.rng.random(),
                float(p.top_k)]

    def taken(self, token: int) -> None:
        """A token read back: it is in the context of the steps after it."""
        if self.context is not None:
            self.context.append(token)

    def _fixed_row(self) -> tuple[np.ndarray, np.ndarray]:
        """What of this draw's ``_processed`` row every step shares: the bias, the
        penalties (no window yet)."""
        p, w = self.params, PENALTY_WINDOW
        ints, floats = np.zeros(PROCESSING_WIDTHS[0], np.int64), np.zeros(
            PROCESSING_WIDTHS[1], np.float32)
        floats[-3:] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        ids = list(p.logit_bias)
        ints[w - 1:w - 1 + len(ids)] = ids
        floats[w:w + len(ids)] = [p.logit_bias[t] for t in ids]
        return ints, floats

    def processing(self, chained: bool, vocab: int, ints: np.ndarray,
                   floats: np.ndarray) -> None:
        """Fill this step's row of ``_processed``'s inputs (``PROCESSING_WIDTHS``): the
        bias and penalties, and the window's tokens the host knows and their weights (the
        step's input token, the window's last, is read on the device: ``chained``, the
        step before drew it and the host has not read it, so every token of the context
        is before it; else it is the context's last)."""
        p, w = self.params, PENALTY_WINDOW
        ints[:], floats[:] = self._row
        if p.penalizes:
            end = len(self.context) - (0 if chained else 1)  # (past the known ones)
            start = max(0, end - (p.penalty_last_n - 1))
            before = np.asarray(self.context[start:end], dtype=np.int64)
            inside = before < vocab  # (the host's penalties skip ids past the logits)
            ints[:len(before)] = np.where(inside, before, 0)
            floats[:len(before)] = inside
            floats[w - 1] = 1.0  # the input token


def _processed(logits: torch.Tensor, tokens: torch.Tensor, ints: torch.Tensor,
               floats: torch.Tensor) -> torch.Tensor:
    """``edgellm.sampling.logits_processor`` over each row of logits (R, vocab) f32 on the
    device, bit for bit the host's: the logit bias added, then the repetition (divide a
    positive logit, multiply a negative one), frequency (times the count) and presence
    penalties of each token in the window. tokens (R,) int64: each row's input token of
    this step, the window's last; ints and floats (R, ``PROCESSING_WIDTHS``): the rows
    ``_Draw.processing`` fills (a weight of 0 and a bias of 0 on a pad; ``_unprocessed``:
    a row that changes nothing). Returns new logits (R, vocab)."""
    w = PENALTY_WINDOW
    window = torch.cat([ints[:, :w - 1], tokens.view(-1, 1)], 1)  # (R, W)
    out = logits.scatter_add(1, ints[:, w - 1:], floats[:, w:w + SAMPLE_BIASES])
    counts = torch.zeros_like(out).scatter_add_(1, window, floats[:, :w])  # (R, vocab)
    repeat, frequency, presence = floats[:, -3:-2], floats[:, -2:-1], floats[:, -1:]
    penalised = torch.where(out > 0, out / repeat, out * repeat) - counts * frequency - presence
    return torch.where(counts > 0, penalised, out)


def _sample(logits: torch.Tensor, knobs: torch.Tensor,
            out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``edgellm.sampling``'s chain over each row of logits (R, vocab) on the device with
    fixed shapes: the SAMPLE_CANDIDATES largest logits in token order, those >= the
    top_k-th (its ties too, up to the candidates), top-p over them by probability (ties by
    token), min-p, temperature, then the first token whose running probability passes the
    uniform u: knobs (R, 5) f64 = (temperature, top_p, min_p, u, top_k) a row
    (GREEDY_KNOBS: the argmax, the first of equal maxima). The host's arithmetic in f64,
    but its sums are not pairwise over the vocabulary: a draw can differ from the host's
    only where u falls within a few ulps of a running sum. Returns (each row's maximum
    logit (R,) f32: NaN or inf marks a fault, as ``_greedy``'s; its token (R,) int64),
    written into ``out`` where given."""
    k = min(SAMPLE_CANDIDATES, logits.shape[-1])
    top, ids = logits.topk(k, dim=-1)  # (R, k) largest first
    kth = top.gather(1, knobs[:, 4:5].long() - 1).double()  # (R, 1): the top_k-th largest
    ids, order = ids.sort(dim=-1)  # token order, as the host's
    values = top.double().gather(1, order)  # (R, k)
    # (no tensor made from a Python number: a capture allows no copy from the host)
    keep = values >= kth
    w = torch.where(keep, torch.exp(values - _row_max(values, keep)), 0.0)
    probs = w / w.sum(-1, keepdim=True)
    ranked = torch.sort(-probs, dim=-1, stable=True).indices  # by probability, ties by token
    cut = torch.searchsorted(torch.cumsum(probs.gather(1, ranked), -1),
                             knobs[:, 1:2].contiguous()) + 1
    places = torch.arange(k, device=logits.device).expand_as(ranked)
    within = torch.empty_like(keep).scatter_(1, ranked, places < cut)  # the one crossing p stays
    keep &= within & (probs >= knobs[:, 2:3] * probs.amax(-1, keepdim=True))
    scaled = values / knobs[:, 0:1]
    w = torch.where(keep, torch.exp(scaled - _row_max(scaled, keep)), 0.0)
    running = torch.cumsum(w / w.sum(-1, keepdim=True), -1)  # (R, k)
    at = torch.searchsorted(running / running[:, -1:], knobs[:, 3:4].contiguous(),
                          right=True)
    at = at.clamp_(max=k - 1)  # (R, 1)
    if out is None:
        return top[:, 0].float(), ids.gather(1, at)[:, 0]
    out[0].copy_(top[:, 0])
    torch.gather(ids, 1, at, out=out[1].view(-1, 1))
    return out


#: ``_sample``'s knobs for the argmax: the largest logit and its ties kept (top-k 1), drawn
#: at u = 0, which takes the first of them in token order (numpy's argmax)
GREEDY_KNOBS = (1.0, 2.0, 0.0, 0.0, 1.0)


def _row_max(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The largest kept value of each row of values (R, k): (R, 1)."""
    return values.masked_fill(~keep, -math.inf).amax(-1, keepdim=True)


def _greedy(logits: torch.Tensor, out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The maximum logit (1,) and its index (1,) of logits (1, vocab) in one reduction: the
    first index among equal maxima, as numpy's argmax; a NaN wins and shows in the value.
    ``out``: (float32, int64) buffers to write them into (float32 logits: the reduction's
    own outputs, no copy)."""
    row = logits[0]  # (vocab,)
    if out is not None and row.dtype == out[0].dtype:
        return tuple(torch.max(row, -1, keepdim=True, out=out))
    best, index = row.max(-1, keepdim=True)
    if out is None:
        return best.float(), index
    out[0].copy_(best)
    out[1].copy_(index)
    return out
