"""A structure-aware GGUF fuzzer: seeds, mutations, and a target that must never crash.

A seed file is parsed into its fields (``Doc``: header counts, key/value entries with their
types, tensor entries, data), one to three mutations change fields (counts, lengths, types,
offsets, alignment, string contents, nested arrays, hyper-parameters, tokenizer fields,
tensor shapes against data sizes, NaN scales) or bytes (truncation, a u64 overwritten with an
edge value, bit flips), and the result is serialized with whatever lies the mutation asked
for. ``run_target`` reads, loads and runs the file (tokenize, chat template, one forward
pass, two generated tokens); the only acceptable failure is a one-line ``ValueError``.

Used by ``tests/test_fuzz_gguf.py`` (a replay of ``tests/fuzz_corpus/`` plus a few hundred
fresh inputs) and by ``scripts/fuzz_gguf.py`` (the long run: a worker process per input
stream, 5 s and a memory budget per input).
"""

from __future__ import annotations

import copy
import os
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
               BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
EDGE_U64 = [0, 1, 2, 3, 7, 31, 32, 33, 255, 256, 4095, 4096, 65535, 65536, 2**31 - 1, 2**31,
            2**32 - 1, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
EDGE_INT = [0, 1, -1, 2, 3, 5, 7, 8, 16, 31, 32, 63, 64, 65, 100, 127, 128, 255, 256, 1000,
            4096, 65536, 2**20, 2**24, 2**31 - 1, -2**31, 2**32 - 1]
EDGE_FLOAT = [0.0, -0.0, 1.0, -1.0, 1e-30, 1e30, 3.4e38, float("nan"), float("inf"),
              float("-inf"), 1e6, 0.5]
HOSTILE_STRINGS = [
    b"", b"\xff\xfe\xfd", b"\x00" * 64, b"A" * 4096, "▁".encode() * 300, b"<|im_start|>",
    b"{{ ''.__class__ }}", b"{% for i in range(99999) %}{% for j in range(99999) %}"
    b"{% endfor %}{% endfor %}", b"{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    b"\xed\xa0\x80", b"<0xZZ>", b"<0x>", b"a b", b" ", b"\\u0000", "ĠĠ".encode(),
]


# -- the document ---------------------------------------------------------------------------
@dataclass
class KV:
    key: bytes
    vtype: int
    value: Any  # scalar, bytes (string) or (etype, [values]) for arrays
    len_lie: int | None = None  # declared byte length of a string / count of an array
    key_len_lie: int | None = None


@dataclass
class TensorInfo:
    name: bytes
    dims: list[int]
    ttype: int
    offset: int
    n_dims_lie: int | None = None


@dataclass
class Doc:
    magic: bytes = b"GGUF"
    version: int = 3
    kvs: list[KV] = field(default_factory=list)
    tensors: list[TensorInfo] = field(default_factory=list)
    data: bytes = b""
    alignment: int = 32  # the padding written before the data
    n_tensors_lie: int | None = None
    n_kv_lie: int | None = None

    def kv(self, key: str) -> KV | None:
        return next((k for k in self.kvs if k.key == key.encode()), None)


class _Reader:
    """Trusting parser for seed files (they are written by gguf-py)."""

    def __init__(self, raw: bytes):
        self.raw, self.pos = raw, 0

    def take(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.raw, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> bytes:
        n = self.take("<Q")
        s = self.raw[self.pos:self.pos + n]
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALAR_FMT:  # keep scalar arrays as numpy for speed
                dtype = np.dtype(_SCALAR_FMT[etype].replace("<?", "<b1"))
                arr = np.frombuffer(self.raw, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += dtype.itemsize * count
                return (etype, arr)
            return (etype, [self.value(etype) for _ in range(count)])
        return self.take(_SCALAR_FMT[vtype])


def parse_doc(raw: bytes) -> Doc:
    r = _Reader(raw)
    doc = Doc(magic=raw[:4])
    r.pos = 4
    doc.version = r.take("<I")
    n_tensors, n_kv = r.take("<Q"), r.take("<Q")
    for _ in range(n_kv):
        key = r.string()
        vtype = r.take("<I")
        doc.kvs.append(KV(key, vtype, r.value(vtype)))
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.take("<I")
        dims = [r.take("<Q") for _ in range(n_dims)]
        doc.tensors.append(TensorInfo(name, dims, r.take("<I"), r.take("<Q")))
    align_kv = doc.kv("general.alignment")
    doc.alignment = int(align_kv.value) if align_kv else 32
    start = -(-r.pos // doc.alignment) * doc.alignment
    doc.data = raw[start:]
    return doc


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v % 2**64)


def _value_bytes(vtype: int, value: Any, len_lie: int | None) -> bytes:
    if vtype == STRING:
        b = value if isinstance(value, bytes) else str(value).encode()
        return _u64(len(b) if len_lie is None else len_lie) + b
    if vtype == ARRAY and isinstance(value, bytes):  # a raw payload (deep nesting)
        return value
    if vtype == ARRAY:
        etype, items = value if isinstance(value, tuple) else (U32, [])
        count = len(items) if len_lie is None else len_lie
        head = struct.pack("<I", etype % 2**32) + _u64(count)
        if isinstance(items, np.ndarray):
            return head + items.tobytes()
        return head + b"".join(_value_bytes(etype, v, None) for v in items)
    if vtype in _SCALAR_FMT:
        fmt = _SCALAR_FMT[vtype]
        try:
            return struct.pack(fmt, value)
        except (struct.error, TypeError, OverflowError):
            return struct.pack(fmt, 0)
    return b""  # an unknown type: no payload (the reader must stop at the type)


def serialize(doc: Doc) -> bytes:
    n_t = len(doc.tensors) if doc.n_tensors_lie is None else doc.n_tensors_lie
    n_kv = len(doc.kvs) if doc.n_kv_lie is None else doc.n_kv_lie
    out = [doc.magic, struct.pack("<I", doc.version % 2**32), _u64(n_t), _u64(n_kv)]
    for kv in doc.kvs:
        out.append(_u64(len(kv.key) if kv.key_len_lie is None else kv.key_len_lie) + kv.key)
        out.append(struct.pack("<I", kv.vtype % 2**32))
        out.append(_value_bytes(kv.vtype, kv.value, kv.len_lie))
    for t in doc.tensors:
        out.append(_u64(len(t.name)) + t.name)
        out.append(struct.pack("<I", (len(t.dims) if t.n_dims_lie is None else t.n_dims_lie)
                               % 2**32))
        out.extend(_u64(d) for d in t.dims)
        out.append(struct.pack("<I", t.ttype % 2**32) + _u64(t.offset))
    raw = b"".join(out)
    align = doc.alignment if 0 < doc.alignment <= 1 << 16 else 32
    raw += b"\0" * (-len(raw) % align)
    return raw + doc.data


# -- mutations ------------------------------------------------------------------------------
HYPER_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "context_length", "attention.key_length",
              "rope.dimension_count", "rope.freq_base", "attention.layer_norm_rms_epsilon",
              "attention.sliding_window", "vocab_size", "rope.scaling.factor",
              "final_logit_softcapping")
TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges",
                  "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token",
                  "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")


def _arch(doc: Doc) -> str:
    kv = doc.kv("general.architecture")
    return kv.value.decode("utf-8", "replace") if kv and isinstance(kv.value, bytes) else "llama"


def _random_value(rng: random.Random, vtype: int, depth: int = 0) -> Any:
    if vtype == STRING:
        return rng.choice(HOSTILE_STRINGS + [bytes(rng.getrandbits(8) for _ in range(
            rng.randint(0, 40)))])
    if vtype == ARRAY:
        etype = rng.choice([U32, I32, F32, STRING, ARRAY, U8, I64] if depth < 6 else [U32])
        n = rng.choice([0, 1, 2, 3, 17])
        if etype in _SCALAR_FMT:
            return (etype, [_random_value(rng, etype) for _ in range(n)])
        return (etype, [_random_value(rng, etype, depth + 1) for _ in range(n)])
    if vtype in (F32, F64):
        return rng.choice(EDGE_FLOAT)
    if vtype == BOOL:
        return rng.random() < 0.5
    return rng.choice(EDGE_INT)


def _array_as_list(kv: KV) -> None:
    etype, items = kv.value
    if isinstance(items, np.ndarray):
        kv.value = (etype, items.tolist())


def mut_header(doc: Doc, rng: random.Random) -> str:
    what = rng.randrange(4)
    if what == 0:
        doc.version = rng.choice([0, 1, 2, 4, 2**31, 2**32 - 1])
        return f"version {doc.version}"
    if what == 1:
        doc.n_tensors_lie = rng.choice([len(doc.tensors) + rng.choice([-1, 1, 2])] + EDGE_U64)
        return f"tensor count {doc.n_tensors_lie}"
    if what == 2:
        doc.n_kv_lie = rng.choice([len(doc.kvs) + rng.choice([-1, 1, 2])] + EDGE_U64)
        return f"kv count {doc.n_kv_lie}"
    doc.magic = rng.choice([b"GGUF"[::-1], b"GGML", b"\0\0\0\0", b"GGUf"])
    return "magic"


def mut_kv_type(doc: Doc, rng: random.Random) -> str:
    kv = rng.choice(doc.kvs)
    kv.vtype = rng.choice(list(range(14)) + [2**32 - 1, 2**31, 99])
    if kv.vtype not in (STRING, ARRAY) and not isinstance(kv.value, int | float | bool):
        kv.value = _random_value(rng, kv.vtype) if rng.random() < 0.5 else kv.value
    return f"type of {kv.key!r} -> {kv.vtype}"


def mut_length_lie(doc: Doc, rng: random.Random) -> str:
    kv = rng.choice([k for k in doc.kvs if k.vtype in (STRING, ARRAY)] or doc.kvs)
    if rng.random() < 0.3:
        kv.key_len_lie = rng.choice(EDGE_U64 + [len(kv.key) + 1, len(kv.key) - 1])
        return f"key length of {kv.key!r} -> {kv.key_len_lie}"
    actual = (len(kv.value) if kv.vtype == STRING and isinstance(kv.value, bytes) else
              len(kv.value[1]) if kv.vtype == ARRAY and isinstance(kv.value, tuple) else 0)
    kv.len_lie = rng.choice(EDGE_U64 + [actual + 1, max(actual - 1, 0), actual * 2])
    return f"length of {kv.key!r} -> {kv.len_lie}"


def mut_string_content(doc: Doc, rng: random.Random) -> str:
    strings = [k for k in doc.kvs if k.vtype == STRING]
    if not strings:
        return "no strings"
    kv = rng.choice(strings)
    kv.value = _random_value(rng, STRING)
    return f"content of {kv.key!r}"


def mut_nested_array(doc: Doc, rng: random.Random) -> str:
    depth = rng.choice([1, 2, 3, 4, 8, 64, 2000, 100_000])
    # written as raw bytes: an array of one array of one array ... of two u32
    value = (struct.pack("<IQ", ARRAY, 1) * (depth - 1) + struct.pack("<IQ", U32, 2)
             + struct.pack("<II", 1, 2))
    key = rng.choice([b"nested", b"tokenizer.ggml.tokens", b"general.alignment",
                      f"{_arch(doc)}.attention.head_count_kv".encode()])
    doc.kvs.insert(rng.randrange(len(doc.kvs) + 1), KV(key, ARRAY, value))
    return f"nested array depth {depth} as {key!r}"


def mut_remove_kv(doc: Doc, rng: random.Random) -> str:
    kv = doc.kvs.pop(rng.randrange(len(doc.kvs)))
    return f"removed {kv.key!r}"


def mut_duplicate_kv(doc: Doc, rng: random.Random) -> str:
    kv = copy.deepcopy(rng.choice(doc.kvs))
    kv.value = _random_value(rng, kv.vtype) if rng.random() < 0.5 else kv.value
    doc.kvs.insert(rng.randrange(len(doc.kvs) + 1), kv)
    return f"duplicated {kv.key!r}"


def mut_hyper(doc: Doc, rng: random.Random) -> str:
    key = f"{_arch(doc)}.{rng.choice(HYPER_KEYS)}"
    kv = doc.kv(key)
    vtype = rng.choice([U32, I32, F32, U64, STRING, ARRAY, BOOL])
    if kv is None:
        kv = KV(key.encode(), vtype, None)
        doc.kvs.append(kv)
    else:
        vtype = kv.vtype if rng.random() < 0.7 else vtype
        kv.vtype = vtype
    kv.value = _random_value(rng, vtype)
    if vtype in (U32, U64) and isinstance(kv.value, int):
        kv.value %= 2**32
    return f"{key} = {kv.value!r:.40}"


def mut_alignment(doc: Doc, rng: random.Random) -> str:
    kv = doc.kv("general.alignment")
    if kv is None:
        kv = KV(b"general.alignment", U32, 32)
        doc.kvs.append(kv)
    kv.vtype = rng.choice([U32, U32, U32, I32, F32, STRING, U64])
    kv.value = rng.choice([0, 1, 3, 16, 64, 4096, 2**31, 2**32 - 1]) if kv.vtype != STRING \
        else b"32"
    if kv.vtype == I32 and kv.value >= 2**31:
        kv.value = -1
    if rng.random() < 0.5 and isinstance(kv.value, int) and 0 < kv.value <= 4096 and \
            kv.value & (kv.value - 1) == 0:
        doc.alignment = kv.value  # a consistent file under another alignment
    return f"alignment {kv.value!r}"


def mut_tokenizer(doc: Doc, rng: random.Random) -> str:
    key = rng.choice(TOKENIZER_KEYS)
    kv = doc.kv(key)
    if kv is None:
        return f"no {key}"
    if kv.vtype == ARRAY and isinstance(kv.value, tuple):
        _array_as_list(kv)
        etype, items = kv.value
        op = rng.randrange(5)
        if op == 0 and items:
            del items[rng.randrange(len(items)):]
            return f"{key} cut to {len(items)}"
        if op == 1 and items:
            i = rng.randrange(len(items))
            items[i] = _random_value(rng, etype) if etype != STRING else rng.choice(
                HOSTILE_STRINGS + [items[rng.randrange(len(items))]])
            return f"{key}[{i}] = {items[i]!r:.30}"
        if op == 2:
            kv.value = (rng.choice([U8, I32, F32, STRING, ARRAY]), items[:5])
            return f"{key} element type changed"
        if op == 3 and etype == STRING and items:
            dup = rng.choice(items)
            items.extend([dup] * rng.randint(1, 5))
            return f"{key} duplicates"
        items.extend(_random_value(rng, etype) for _ in range(rng.randint(1, 50)))
        return f"{key} extended"
    kv.vtype = rng.choice([kv.vtype, kv.vtype, STRING, U32, I32, BOOL])
    kv.value = _random_value(rng, kv.vtype)
    if key in ("tokenizer.ggml.model", "tokenizer.ggml.pre") and rng.random() < 0.5:
        kv.vtype, kv.value = STRING, rng.choice([b"llama", b"gpt2", b"qwen2", b"bert", b""])
    return f"{key} = {kv.value!r:.40}"


def mut_tensor(doc: Doc, rng: random.Random) -> str:
    if not doc.tensors:
        return "no tensors"
    t = rng.choice(doc.tensors)
    op = rng.randrange(9)
    if op == 0:
        i = rng.randrange(len(t.dims))
        t.dims[i] = rng.choice(EDGE_U64 + [t.dims[i] * 2, t.dims[i] // 2, t.dims[i] + 32])
        return f"dims of {t.name!r} -> {t.dims}"
    if op == 1:
        t.dims = t.dims[::-1] if len(t.dims) > 1 else t.dims + [rng.choice([1, 2, 2**33])]
        return f"dims of {t.name!r} reshaped -> {t.dims}"
    if op == 2:
        t.n_dims_lie = rng.choice([0, 3, 4, 5, 2**32 - 1])
        return f"rank of {t.name!r} -> {t.n_dims_lie}"
    if op == 3:
        t.ttype = rng.choice(list(range(0, 40)) + [2**31, 2**32 - 1])
        return f"type of {t.name!r} -> {t.ttype}"
    if op == 4:
        t.offset = rng.choice(EDGE_U64 + [t.offset + 1, t.offset + 32, t.offset - 32,
                                          len(doc.data), len(doc.data) - 32])
        return f"offset of {t.name!r} -> {t.offset}"
    if op == 5:
        other = rng.choice(doc.tensors)
        t.name = rng.choice([other.name, b"", b"\xff" * 3, b"x" * 70000, t.name + b"\0"])
        return f"name of a tensor -> {t.name[:20]!r}"
    if op == 6:
        doc.tensors.remove(t)
        return f"removed tensor {t.name!r}"
    if op == 7:  # the same data claimed by a second entry (overlap) or a fresh one past it
        doc.tensors.append(TensorInfo(t.name + b".x", list(t.dims), t.ttype,
                                      rng.choice([t.offset, len(doc.data), 0])))
        return f"added tensor near {t.name!r}"
    t.dims = [d * 2 for d in t.dims]  # shape and data size disagree
    return f"dims of {t.name!r} doubled"


def mut_nan_scale(doc: Doc, rng: random.Random) -> str:
    """An f16 NaN/inf at the start of a tensor's data (a Q8_0/Q4_0/Q5_0 scale, F16/F32 bits)."""
    if not doc.tensors:
        return "no tensors"
    t = rng.choice(doc.tensors)
    if t.offset + 4 > len(doc.data):
        return "tensor outside data"
    at = t.offset + rng.choice([0, 0, 2])
    bad = rng.choice([b"\x00\x7e", b"\x00\x7c", b"\x00\xfc", b"\x00\x00\xc0\x7f"])
    doc.data = doc.data[:at] + bad + doc.data[at + len(bad):]
    return f"non-finite bits in {t.name!r}"


DOC_MUTATIONS = [mut_header, mut_kv_type, mut_length_lie, mut_string_content, mut_nested_array,
                 mut_remove_kv, mut_duplicate_kv, mut_hyper, mut_hyper, mut_alignment,
                 mut_tokenizer, mut_tokenizer, mut_tensor, mut_tensor, mut_tensor,
                 mut_nan_scale]


def mut_bytes(raw: bytes, rng: random.Random, header_end: int) -> tuple[bytes, str]:
    """Byte-level damage, mostly in the header (where the parser's decisions are)."""
    op = rng.randrange(4)
    if op == 0:
        cut = rng.randrange(len(raw))
        return raw[:cut], f"truncated at {cut}"
    if op == 1:
        at = rng.randrange(max(1, min(header_end, len(raw) - 8)))
        return raw[:at] + _u64(rng.choice(EDGE_U64)) + raw[at + 8:], f"u64 at {at}"
    if op == 2:
        out = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(min(header_end, len(out)))
            out[i] ^= 1 << rng.randrange(8)
        return bytes(out), "bit flips"
    return raw + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))), "junk appended"


def mutate(doc: Doc, rng: random.Random) -> tuple[bytes, list[str]]:
    """A mutated copy of ``doc`` as bytes, and what was done to it."""
    doc = copy.deepcopy(doc)
    steps = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        steps.append(rng.choice(DOC_MUTATIONS)(doc, rng))
    raw = serialize(doc)
    if rng.random() < 0.25:
        raw, what = mut_bytes(raw, rng, len(raw) - len(doc.data))
        steps.append(what)
    return raw, steps


# -- seeds ----------------------------------------------------------------------------------
def _write(path: Path, arch: str, kv: dict[str, Any], tensors: dict[str, Any]) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    for key, (kind, value) in kv.items():
        getattr(w, f"add_{kind}")(key, value)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            qtype, data = t
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_weights(arch: str, vocab: int, d: int = 32, n_layers: int = 1, n_heads: int = 2,
                  n_kv: int = 1, hd: int = 16, d_ff: int = 64, qtype=None) -> dict[str, Any]:
    from edgellm.quants import quantize

    rng = np.random.default_rng(1)

    def mat(rows: int, cols: int) -> Any:
        w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        return (qtype, quantize(w, qtype)) if qtype is not None else w

    def vec(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, Any] = {"token_embd.weight": mat(vocab, d), "output_norm.weight": vec(d)}
    if arch != "gemma3":
        t["output.weight"] = mat(vocab, d)
    for i in range(n_layers):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": vec(d), p + "ffn_norm.weight": vec(d),
                  p + "attn_q.weight": mat(n_heads * hd, d), p + "attn_k.weight": mat(n_kv * hd, d),
                  p + "attn_v.weight": mat(n_kv * hd, d), p + "attn_output.weight":
                  mat(d, n_heads * hd), p + "ffn_gate.weight": mat(d_ff, d),
                  p + "ffn_up.weight": mat(d_ff, d), p + "ffn_down.weight": mat(d, d_ff)})
        if arch == "qwen2":
            t.update({p + "attn_q.bias": vec(n_heads * hd), p + "attn_k.bias": vec(n_kv * hd),
                      p + "attn_v.bias": vec(n_kv * hd)})
        if arch == "gemma3":
            t.update({p + "attn_q_norm.weight": vec(hd), p + "attn_k_norm.weight": vec(hd),
                      p + "post_attention_norm.weight": vec(d),
                      p + "post_ffw_norm.weight": vec(d)})
    return t


def _hyper(arch: str, d: int = 32, n_heads: int = 2, n_kv: int = 1, hd: int = 16,
           d_ff: int = 64) -> dict[str, Any]:
    kv = {f"{arch}.context_length": ("uint32", 128), f"{arch}.embedding_length": ("uint32", d),
          f"{arch}.block_count": ("uint32", 1), f"{arch}.feed_forward_length": ("uint32", d_ff),
          f"{arch}.attention.head_count": ("uint32", n_heads),
          f"{arch}.attention.head_count_kv": ("uint32", n_kv),
          f"{arch}.attention.key_length": ("uint32", hd),
          f"{arch}.rope.freq_base": ("float32", 10000.0),
          f"{arch}.attention.layer_norm_rms_epsilon": ("float32", 1e-6)}
    if arch == "gemma3":
        kv[f"{arch}.attention.sliding_window"] = ("uint32", 16)
    return kv


def qwen_vocab_slice(metadata: dict[str, Any], n: int = 1500) -> dict[str, Any]:
    """The first ``n`` tokens of a Qwen2 vocabulary, the merges among them, its specials."""
    tokens = list(metadata["tokenizer.ggml.tokens"][:n])
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += specials
    have = set(tokens)
    merges = [m for m in metadata["tokenizer.ggml.merges"][:20000]
              if m.replace(" ", "", 1) in have and all(p in have for p in m.split(" ", 1))]
    types = [1] * n + [3] * len(specials)
    return {"tokenizer.ggml.model": ("string", "gpt2"), "tokenizer.ggml.pre": ("string", "qwen2"),
            "tokenizer.ggml.tokens": ("array", tokens), "tokenizer.ggml.token_type":
            ("array", types), "tokenizer.ggml.merges": ("array", merges),
            "tokenizer.ggml.eos_token_id": ("uint32", n + 2),
            "tokenizer.ggml.bos_token_id": ("uint32", n),
            "tokenizer.ggml.add_bos_token": ("bool", False),
            "tokenizer.chat_template": ("string", metadata["tokenizer.chat_template"])}


def gemma_vocab_slice(metadata: dict[str, Any], n: int = 1500) -> dict[str, Any]:
    """The first ``n`` tokens of Gemma 3's SentencePiece vocabulary with scores and types."""
    return {"tokenizer.ggml.model": ("string", "llama"),
            "tokenizer.ggml.tokens": ("array", list(metadata["tokenizer.ggml.tokens"][:n])),
            "tokenizer.ggml.scores": ("array", [float(x) for x in
                                                metadata["tokenizer.ggml.scores"][:n]]),
            "tokenizer.ggml.token_type": ("array", [int(x) for x in
                                                    metadata["tokenizer.ggml.token_type"][:n]]),
            "tokenizer.ggml.bos_token_id": ("uint32", 2),
            "tokenizer.ggml.eos_token_id": ("uint32", 1),
            "tokenizer.ggml.unknown_token_id": ("uint32", 3),
            "tokenizer.ggml.add_bos_token": ("bool", True),
            "tokenizer.ggml.add_space_prefix": ("bool", False),
            "tokenizer.chat_template": ("string", GEMMA_TEMPLATE)}


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == "
    "'assistant' else message['role'] %}{{ '<start_of_turn>' + role + '\n' + "
    "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<start_of_turn>model\n' }}{% endif %}")


def write_seeds(folder: Path, real_models: dict[str, Path] | None = None) -> list[Path]:
    """The seed corpus: tiny valid models (llama F32/Q8_0/Q4_0; qwen2 and gemma3 with a
    slice of the real vocabularies when those models are installed)."""
    from gguf import GGMLQuantizationType as Q

    from edgellm.converters.gguf_reader import read_gguf
    from tests.tiny_models import TinyConfig, write_tiny_llama

    folder.mkdir(parents=True, exist_ok=True)
    seeds = [write_tiny_llama(folder / "seed_llama_f32.gguf",
                              TinyConfig(n_layers=1, vocab_size=280, d_model=32, n_heads=2,
                                         n_kv_heads=1, d_ff=64)),
             write_tiny_llama(folder / "seed_llama_q8_0.gguf",
                              TinyConfig(n_layers=1, vocab_size=280, d_model=32, n_heads=2,
                                         n_kv_heads=1, d_ff=64, qtype=Q.Q8_0)),
             write_tiny_llama(folder / "seed_llama_q4_0.gguf",
                              TinyConfig(n_layers=1, vocab_size=280, d_model=32, n_heads=2,
                                         n_kv_heads=1, d_ff=64, qtype=Q.Q4_0))]
    for arch, name, slicer, qtype in (("qwen2", "qwen2.5-coder-0.5b-instruct", qwen_vocab_slice,
                                       Q.Q8_0),
                                      ("gemma3", "gemma-3-270m", gemma_vocab_slice, Q.Q5_0)):
        path = (real_models or {}).get(name)
        if path is None:
            continue
        kv = {**_hyper(arch), **slicer(read_gguf(path).metadata)}
        vocab = len(kv["tokenizer.ggml.tokens"][1])
        seeds.append(_write(folder / f"seed_{arch}_vocab.gguf", arch, kv,
                            _tiny_weights(arch, vocab, qtype=qtype)))
    return seeds


# -- the target -----------------------------------------------------------------------------
class Crash(Exception):
    """The target failed in a way a user must never see."""


def run_target(path: str | os.PathLike, backend: str = "numpy") -> str:
    """Read, load and run ``path``. Returns "ok" or the one-line rejection message; raises
    ``Crash`` for any other exception or a multi-line/empty message."""
    from edgellm.api import load
    from edgellm.converters.gguf_reader import read_gguf
    from edgellm.sampling import SamplingParams

    try:
        g = read_gguf(path)
        del g
        model = load(path, backend=backend, context_length=64)
        text = model.apply_chat_template([{"role": "user", "content": "Hello wörld ▁ <|im_end|>"}])
        ids = model.encode(text)[:24] or [0]
        model.tokenizer.decode(ids)
        from edgellm.generate import generate

        generate(model, ids, SamplingParams(temperature=0, max_tokens=2))
        return "ok"
    except ValueError as exc:  # the one acceptable failure: a clear ValueError
        message = str(exc)
        if not message.strip() or "\n" in message.strip():
            raise Crash(f"ValueError message is not one line: {message!r}") from exc
        return message
    except Exception as exc:  # noqa: BLE001 - anything else is a bug to fix
        raise Crash(f"{type(exc).__name__}: {exc}") from exc
