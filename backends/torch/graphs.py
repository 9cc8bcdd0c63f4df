"""Single-token decode steps as CUDA graphs: a small model's step is ~30 launches per layer,
and replaying them as one graph removes the launch gaps that otherwise set its pace.

A graph is captured once per model and cache layout (``LayerPlan`` per layer) and replayed
for every step after. What changes from step to step lives in static device buffers filled
from pinned host memory before each replay: the token, its position, each distinct layout's
write slot and mask (layers with the same plan share them: two for Gemma 3, one for Qwen).
The host still keeps the cache's books (``slot_pos``, ``offset``) exactly as
``LayerCache.update_and_fetch`` does, so trim, prefill and everything else see the same
cache. The captured pass is ``Model.forward``'s own steps (embed, ``block_forward`` per
layer, norm, output), over a cache view whose ``update_and_fetch`` writes at the static slot.

A graph's KV storage is the tensors it was captured with. A new cache of the same layout whose
predecessor is gone adopts them (its contents copied in), so a benchmark's or a chat's fresh
caches do not capture again; a cache whose graph is in use by a live cache gets its own.
Caches that rotate with sink tokens or store Q8_0 run eagerly.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from edgellm.cache import FloatStore, KVCache

#: graphs kept per model (each holds its own KV storage and activation pool)
MAX_GRAPHS_PER_MODEL = 4


class _StepLayer:
    """Model.attention's view of one layer inside a captured step."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor,
                 mask: torch.Tensor, kernels=None):
        self.keys, self.values, self.slot, self.mask = keys, values, slot, mask
        self.kernels = kernels  # the triton kernels (GPU path), or None (CPU torch)

    def update_and_fetch(self, k, v):
        """Write k, v (1, KVH, hd) at the static slot; the storage (slots, KVH, hd) and the
        static mask (1, slots) to attend with."""
        keys, values = self.keys, self.values
        if self.kernels is not None:
            self.kernels.store_kv(keys, values, self.slot, k.contiguous(), v.contiguous())
        else:
            keys.index_copy_(0, self.slot, k.to(keys.dtype))
            values.index_copy_(0, self.slot, v.to(values.dtype))
        return keys, values, self.mask


@dataclass
class _Graph:
    signature: tuple
    owner: weakref.ref
    groups: list  # per distinct layout: list of layer indices
    host_i64: torch.Tensor  # pinned: token, position, slot per group
    host_masks: torch.Tensor  # pinned: every group's mask, concatenated
    dev_i64: torch.Tensor
    dev_masks: torch.Tensor
    mask_spans: list  # (start, length) of each group's mask in the flat buffer
    stores: list = field(default_factory=list)  # (keys, values) per layer
    inputs: tuple | None = None  # (ids, positions, layer views) over the static buffers
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None
    token: torch.Tensor | None = None  # argmax of the logits, on the device


def _signature(cache: KVCache) -> tuple:
    return tuple((layer.plan, tuple(layer.store.keys.shape), layer.store.keys.dtype)
                 for layer in cache.layers)


def supported(cache: KVCache) -> bool:
    """Can this cache's steps run as a graph? (f16/f32 torch storage, no sink tokens)"""
    return all(isinstance(layer.store, FloatStore) and isinstance(layer.store.keys, torch.Tensor)
               and layer.plan.keep == 0 for layer in cache.layers)


class DecodeGraphs:
    """Captures and replays single-token decode steps for a TorchBackend on CUDA.

    On the CPU (``capture`` False: tests) the same static-buffer step runs eagerly each time,
    so everything but the capture itself (the host books, the buffers, adoption) is tested
    without a GPU.
    """

    def __init__(self, backend):
        self.backend = backend
        self.capture = backend.cuda
        self._graphs: dict[int, list[_Graph]] = {}
        self.capture_seconds = 0.0  # total time spent capturing (reported apart from speed)
        self.captures = 0
        self.last_token: torch.Tensor | None = None  # greedy token of the last step (device)

    def decode(self, model, tokens: np.ndarray, cache: KVCache) -> np.ndarray | None:
        """Logits (1, vocab) of one token, as ``model.forward`` returns them; None when the
        cache cannot run as a graph (the caller then runs the step eagerly)."""
        if len(tokens) != 1 or not supported(cache):
            return None
        positions = cache.begin(1)  # ContextOverflow as forward would raise it
        g = self._graph_for(model, cache)
        self._advance(g, cache, int(tokens[0]), int(positions[0]))
        g.dev_i64.copy_(g.host_i64, non_blocking=True)
        g.dev_masks.copy_(g.host_masks, non_blocking=True)
        if g.inputs is None:
            g.inputs = self._inputs(cache, g)
        if not self.capture:
            self.backend._rope_memo = (None, {})  # same positions tensor, new value
            g.logits, g.token = _step(model, *g.inputs)
        else:
            if g.graph is None:
                self._capture(model, g)
            g.graph.replay()
        self.last_token = g.token
        return g.logits.cpu().numpy()

    # -- host books ------------------------------------------------------------------------
    def _advance(self, g: _Graph, cache: KVCache, token: int, pos: int) -> None:
        """What update_and_fetch does on the host for a 1-token step, once per layout."""
        i64 = g.host_i64.numpy()
        masks = g.host_masks.numpy()
        i64[0], i64[1] = token, pos
        new_pos = np.array([pos])
        for gi, layer_ids in enumerate(g.groups):
            lead = cache.layers[layer_ids[0]]
            slot = int(lead.slot_of(new_pos)[0])
            for li in layer_ids:
                layer = cache.layers[li]
                layer.slot_pos[slot] = pos
                layer.offset = pos + 1
            i64[2 + gi] = slot
            start, length = g.mask_spans[gi]
            masks[start:start + length] = lead.mask(new_pos, lead.slot_pos)[0]

    # -- graphs ----------------------------------------------------------------------------
    def _graph_for(self, model, cache: KVCache) -> _Graph:
        graphs = self._graphs.setdefault(id(model), [])
        for g in graphs:  # every step but the first: no signature (~0.1 ms of host time)
            if g.owner() is cache:
                return g
        sig = _signature(cache)
        for g in graphs:  # adopt a graph whose cache is gone
            if g.signature == sig and g.owner() is None:
                for layer, (keys, values) in zip(cache.layers, g.stores, strict=True):
                    keys.copy_(layer.store.keys)
                    values.copy_(layer.store.values)
                    layer.store.keys, layer.store.values = keys, values
                g.owner = weakref.ref(cache)
                return g
        if len(graphs) >= MAX_GRAPHS_PER_MODEL:
            graphs.pop(0)
        g = self._new_graph(cache, sig)
        graphs.append(g)
        return g

    def _new_graph(self, cache: KVCache, sig: tuple) -> _Graph:
        groups: dict = {}
        for i, layer in enumerate(cache.layers):
            groups.setdefault(layer.plan, []).append(i)
        group_list = list(groups.values())
        spans, total = [], 0
        for ids in group_list:
            length = cache.layers[ids[0]].plan.slots
            spans.append((total, length))
            total += length
        dev = self.backend.device
        host_i64 = torch.zeros(2 + len(group_list), dtype=torch.int64)
        host_masks = torch.zeros(total, dtype=torch.bool)
        if self.capture:  # pinned: copied to the device without a stall
            host_i64, host_masks = host_i64.pin_memory(), host_masks.pin_memory()
        return _Graph(sig, weakref.ref(cache), group_list, host_i64, host_masks,
                      host_i64.to(dev), host_masks.to(dev), spans,
                      stores=[(layer.store.keys, layer.store.values) for layer in cache.layers])

    def _inputs(self, cache: KVCache, g: _Graph) -> tuple:
        """(ids (1,), positions (1,), per-layer views) over the graph's device buffers."""
        layers = {}
        for gi, layer_ids in enumerate(g.groups):
            s, length = g.mask_spans[gi]
            slot = g.dev_i64[2 + gi:3 + gi]
            mask = g.dev_masks[s:s + length].view(1, length)
            for li in layer_ids:
                layers[li] = _StepLayer(*g.stores[li], slot, mask, self.backend.kernels)
        return g.dev_i64[0:1], g.dev_i64[1:2], [layers[i] for i in range(len(layers))]

    def _capture(self, model, g: _Graph) -> None:
        """Warm up (triton compiles) on a side stream, then capture one step. Both write only
        the slot this step writes anyway, which the replay then overwrites."""
        start = time.perf_counter()
        ids, positions, view = g.inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                _step(model, ids, positions, view)
        torch.cuda.current_stream().wait_stream(side)
        self.backend._rope_memo = (None, {})  # tables must be computed inside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g.logits, g.token = _step(model, ids, positions, view)
        self.backend._rope_memo = (None, {})
        g.graph = graph
        torch.cuda.synchronize()
        self.capture_seconds += time.perf_counter() - start
        self.captures += 1


def _step(model, ids: torch.Tensor, positions: torch.Tensor, layers: list):
    """Model.forward's steps for one token (ids (1,), positions (1,) on the device):
    logits (1, vocab) and their argmax."""
    B = model.backend
    x = B.embed(model.tok_embd, ids)  # (1, d)
    if model.embed_scale != 1.0:
        x = B.scale(x, model.embed_scale)
    for i, (block, layer) in enumerate(zip(model.blocks, layers, strict=True)):
        x = model.block_forward(i, block, x, positions, layer)
    x = B.rms_norm(x, model.output_norm, model.args.norm_eps)
    logits = B.matmul(x, model.output)  # (1, vocab)
    if model.args.final_logit_softcap:
        logits = B.softcap(logits, model.args.final_logit_softcap)
    return logits, torch.argmax(logits[0])
