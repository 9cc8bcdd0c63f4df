"""Importance matrices in llama.cpp's imatrix GGUF layout (files interchange both ways).

For each matmul weight ``NAME`` (a GGUF tensor name) the file holds ``NAME.in_sum2`` (f32,
ggml ne = (n_cols, n_mat): the sum over calibration tokens of each input column's squared
activation) and ``NAME.counts`` (f32, ne = (1, n_mat): how many tokens were summed), plus
``general.type = imatrix``, ``imatrix.datasets``, ``imatrix.chunk_count``, ``imatrix.chunk_size``.
The quantizers take the mean, in_sum2 / counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgellm.converters.gguf_reader import read_gguf

IN_SUM2, COUNTS = ".in_sum2", ".counts"


@dataclass
class ImportanceMatrix:
    """Per weight name: summed squared activations (n_cols,) and the token count."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    source: str = ""  # the file it was read from, as given

    def add(self, name: str, x: np.ndarray) -> None:
        """Accumulate the activations (n_tokens, n_cols) that entered weight ``name``."""
        x = np.asarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
        sq = np.einsum("ij,ij->j", x, x, dtype=np.float64)
        if name in self.sums:
            self.sums[name] += sq
            self.counts[name] += x.shape[0]
        else:
            self.sums[name] = sq
            self.counts[name] = x.shape[0]

    def provenance(self) -> dict[str, str | int]:
        """The ``quantize.imatrix.*`` keys llama-quantize writes into a file it made with one."""
        return {"quantize.imatrix.file": self.source,
                "quantize.imatrix.dataset": self.datasets[0] if self.datasets else "",
                "quantize.imatrix.entries_count": len(self.sums),
                "quantize.imatrix.chunks_count": self.chunk_count}

    def weights(self, name: str) -> np.ndarray | None:
        """Mean squared activation per input column, or None where the weight was not seen."""
        if name not in self.sums or not self.counts.get(name):
            return None
        return (self.sums[name] / self.counts[name]).astype(np.float32)


def read_imatrix(path: str | os.PathLike) -> ImportanceMatrix:
    """Read an imatrix GGUF (ours or llama-imatrix's); ValueError if it is not one."""
    g = read_gguf(path)
    if g.metadata.get("general.type") != "imatrix":
        raise ValueError(f"{path}: not an importance-matrix GGUF (general.type is "
                         f"{g.metadata.get('general.type')!r}); make one with `edgellm imatrix`")
    out = ImportanceMatrix(datasets=list(g.metadata.get("imatrix.datasets", [])),
                           chunk_count=int(g.metadata.get("imatrix.chunk_count", 0)),
                           chunk_size=int(g.metadata.get("imatrix.chunk_size", 0)),
                           source=os.fspath(path))
    for tname, t in g.tensors.items():
        if not tname.endswith(IN_SUM2):
            continue
        name = tname[: -len(IN_SUM2)]
        counts = g.tensors.get(name + COUNTS)
        if counts is None:
            raise ValueError(f"{path}: {tname} has no matching {name + COUNTS}")
        sums = t.dequantize().reshape(-1, t.shape[-1])  # (n_mat, n_cols)
        if sums.shape[0] != 1:
            raise ValueError(f"{path}: {name} has {sums.shape[0]} expert matrices; only dense "
                             "models are supported")
        out.sums[name] = sums[0].astype(np.float64)
        out.counts[name] = int(round(float(counts.dequantize().reshape(-1)[0])))
    return out


def write_imatrix(imatrix: ImportanceMatrix, path: str | os.PathLike) -> Path:
    """Write ``imatrix`` as a GGUF (via ``.partial``, fsynced, renamed)."""
    from gguf import GGUFWriter

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    w = GGUFWriter(str(partial), arch="")
    w.kv_data[0].pop("general.architecture", None)  # an imatrix file has none
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", imatrix.datasets or [""])
    w.add_uint32("imatrix.chunk_count", imatrix.chunk_count)
    w.add_uint32("imatrix.chunk_size", imatrix.chunk_size)
    for name in sorted(imatrix.sums):
        w.add_tensor(name + IN_SUM2, imatrix.sums[name].astype(np.float32).reshape(1, -1))
        w.add_tensor(name + COUNTS, np.array([[imatrix.counts[name]]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.fout[0].flush()
    os.fsync(w.fout[0].fileno())
    w.close()
    os.replace(partial, path)
    return path
