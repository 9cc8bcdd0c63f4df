"""Importance matrices computed by our own runtime: mean squared input activation per column
of every matmul weight, over calibration text (llama.cpp's imatrix method and file layout).

Recording is a backend wrapper, off unless asked for: ``RecordingBackend`` forwards every op
to the real backend and, for the ops that multiply by weights (``matmul``, ``matmuls``,
``project_qkv``, ``gated_projection``), adds the input rows' squares to each weight's entry
(weights are known by the name they were prepared under). The text is run in chunks of
``ctx`` tokens, each from an empty cache, as ``llama-imatrix`` does; the output matrix is
left out, as llama-imatrix leaves it out by default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from edgellm.converters.imatrix import ImportanceMatrix

#: weights llama-imatrix does not record by default (the output matrix / tied embedding)
SKIPPED = ("output.weight", "token_embd.weight")


class RecordingBackend:
    """A backend that records matmul inputs into an ImportanceMatrix; all else forwards."""

    def __init__(self, backend: Any, imatrix: ImportanceMatrix):
        self._backend, self.imatrix = backend, imatrix
        self._names: dict[int, str] = {}
        self._keep: list[Any] = []  # prepared weights stay alive, so their ids stay theirs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def prepare(self, tensor: Any) -> Any:
        weight = self._backend.prepare(tensor)
        if tensor.name not in SKIPPED:
            self._names[id(weight)] = tensor.name
            self._keep.append(weight)
        return weight

    def _record(self, x: Any, weight: Any) -> None:
        name = self._names.get(id(weight))
        if name is not None:
            self.imatrix.add(name, self._backend.to_numpy(x))

    def matmul(self, x: Any, weight: Any, bias: Any = None) -> Any:
        self._record(x, weight)
        return self._backend.matmul(x, weight, bias)

    def matmuls(self, x: Any, weights: tuple, biases: tuple | None = None) -> list[Any]:
        for w in weights:
            self._record(x, w)
        return self._backend.matmuls(x, weights, biases)

    def project_qkv(self, x: Any, weights: tuple, biases: tuple, *rope: Any) -> tuple:
        for w in weights:
            self._record(x, w)
        return self._backend.project_qkv(x, weights, biases, *rope)

    def gated_projection(self, x: Any, w_gate: Any, w_up: Any, gelu: bool) -> Any:
        self._record(x, w_gate)
        self._record(x, w_up)
        return self._backend.gated_projection(x, w_gate, w_up, gelu)


def compute_imatrix(model_path: str | os.PathLike, text: str, ctx: int = 512,
                    chunks: int | None = None, backend: str = "auto",
                    threads: int | None = None,
                    progress: Callable[[int, int], None] | None = None,
                    quant: str = "q8_0") -> ImportanceMatrix:
    """Run the model over ``text`` in chunks of ``ctx`` tokens, recording activations.

    ``model_path`` is a .gguf file or a Hugging Face folder, converted in memory to ``quant``
    first (the matrix then comes from the checkpoint itself, before any file is written)."""
    from pathlib import Path

    from edgellm.backends import get_backend
    from edgellm.converters.gguf_reader import read_gguf
    from edgellm.models import build_model
    from edgellm.tokenizer import Tokenizer

    if Path(model_path).is_dir():
        from edgellm.converters.hf_convert import folder_as_gguf

        gguf = folder_as_gguf(model_path, quant, threads)
    else:
        gguf = read_gguf(model_path)
    imatrix = ImportanceMatrix(datasets=[str(getattr(text, "name", "calibration text"))],
                               chunk_size=ctx)
    be = RecordingBackend(get_backend(backend, **({"threads": threads} if threads else {})),
                          imatrix)
    net = build_model(gguf.metadata, gguf.tensors, be)
    tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    ids = tokenizer.encode(text, add_bos=False, parse_special=False)
    n_chunks = len(ids) // ctx
    if chunks:
        n_chunks = min(n_chunks, chunks)
    if n_chunks < 1:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than one chunk of "
                         f"{ctx}; give a longer text or a smaller --ctx")
    bos = tokenizer.bos_id if tokenizer.add_bos else None
    for c in range(n_chunks):
        chunk = np.array(ids[c * ctx:(c + 1) * ctx], dtype=np.int64)
        if bos is not None:
            chunk[0] = bos  # as llama-imatrix: the chunk's first token becomes BOS
        cache = net.make_cache(ctx)
        net.forward(chunk, cache)
        imatrix.chunk_count = c + 1
        if progress:
            progress(c + 1, n_chunks)
    return imatrix
