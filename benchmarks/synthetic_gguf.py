"""A real GGUF's skeleton, and a full-size file of random blocks made from it, for speed runs
on a machine the real weights cannot reach (a lent GPU whose uploads are capped).

    python benchmarks/synthetic_gguf.py skeleton MODEL.gguf OUT.skel.gz
    python benchmarks/synthetic_gguf.py fill OUT.skel.gz SYNTH.gguf

``skeleton`` keeps everything before the tensor data (metadata, vocabulary, tensor table:
~6 MB for the Qwen 2.5 files) plus each tensor's offset and size. ``fill`` writes that header
back and random blocks of each tensor's own type in place of the weights: every f16 scale
field a small positive value (as tests/test_backend_conformance.py draws them), F32 tensors
(norms) near 1. Same shapes, types, sizes and layout as the real file, so timings and memory
are representative; the outputs are noise, so correctness is shown on the real files elsewhere.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
import sys

import numpy as np

# byte offsets of the f16 scale fields in each block (ggml-common.h)
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def skeleton(src: str, dst: str) -> None:
    from edgellm.converters.gguf_reader import read_gguf
    from edgellm.quants import GGML_QUANT_SIZES

    f = read_gguf(src)
    with open(src, "rb") as fh:
        header = fh.read(f.data_offset)
    table = []
    for t in f.tensors.values():
        offset = int(t.data.ctypes.data)  # made relative to the first tensor below
        table.append({"name": t.name, "type": t.qtype.name, "offset": offset,
                      "nbytes": t.nbytes, "block": list(GGML_QUANT_SIZES[t.qtype])})
    base = min(e["offset"] for e in table)
    for e in table:
        e["offset"] -= base
    meta = json.dumps({"data_offset": f.data_offset, "size": os.path.getsize(src),
                       "tensors": table}).encode()
    with gzip.open(dst, "wb") as out:
        out.write(struct.pack("<Q", len(meta)) + meta + header)


def fill(src: str, dst: str, seed: int = 0) -> None:
    with gzip.open(src, "rb") as fh:
        blob = fh.read()
    n = struct.unpack("<Q", blob[:8])[0]
    meta = json.loads(blob[8:8 + n])
    header = blob[8 + n:]
    rng = np.random.default_rng(seed)
    data = np.zeros(meta["size"] - meta["data_offset"], dtype=np.uint8)
    for e in meta["tensors"]:
        view = data[e["offset"]:e["offset"] + e["nbytes"]]
        if e["type"] == "F32":
            view.view(np.float32)[:] = 1.0 + 0.05 * rng.standard_normal(e["nbytes"] // 4)
            continue
        if e["type"] == "F16":
            view.view(np.float16)[:] = 0.05 * rng.standard_normal(e["nbytes"] // 2)
            continue
        view[:] = rng.integers(0, 256, e["nbytes"], dtype=np.uint8)
        ts = e["block"][1]
        blocks = view.reshape(-1, ts)
        for off in F16_FIELDS.get(e["type"], ()):
            scales = rng.uniform(0.001, 0.02, len(blocks)).astype(np.float16)
            blocks[:, off:off + 2] = scales.view(np.uint8).reshape(-1, 2)
    with open(dst + ".partial", "wb") as out:
        out.write(header)
        data.tofile(out)
    os.replace(dst + ".partial", dst)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("skeleton", "fill"):
        sys.exit(__doc__)
    (skeleton if sys.argv[1] == "skeleton" else fill)(sys.argv[2], sys.argv[3])
