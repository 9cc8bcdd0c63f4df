"""GGUF reading: real files parse; every kind of bad file fails with one clear message,
both from the library (ValueError) and from the CLI (one line, exit status 1, no traceback)."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgellm.converters.gguf_reader import read_gguf
from tests.tiny_models import write_tiny_llama

F32 = 0


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def build_gguf(tensors=(("a", (32,), F32, 0), ("b", (32,), F32, 128)), *, magic=b"GGUF",
               version=3, n_tensors=None, kv=None, data_bytes=256, extra_kv=b"") -> bytes:
    """A hand-made GGUF whose every field the test controls."""
    kv = {"general.architecture": "llama"} if kv is None else kv
    body = b""
    for key, value in kv.items():
        body += _str(key) + struct.pack("<I", 8) + _str(value)
    body += extra_kv
    infos = b""
    for name, dims, ttype, offset in tensors:
        infos += _str(name) + struct.pack("<I", len(dims))
        infos += b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", ttype, offset)
    n_kv = len(kv) + (1 if extra_kv else 0)
    header = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 n_kv)
    raw = header + body + infos
    raw += b"\0" * (-len(raw) % 32)
    return raw + bytes(data_bytes)


def write(tmp_path: Path, raw: bytes, name: str = "bad.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(raw)
    return path


BAD_FILES = {
    "bad_magic": (dict(magic=b"GGML"), "bad magic"),
    "version_1": (dict(version=1), "unsupported GGUF version 1"),
    "version_99": (dict(version=99), "unsupported GGUF version 99"),
    "absurd_tensor_count": (dict(n_tensors=1 << 62), "absurd counts"),
    "past_the_end": (dict(tensors=(("a", (32,), F32, 0), ("b", (64,), F32, 128))),
                     "runs past the end"),
    "overlap": (dict(tensors=(("a", (64,), F32, 0), ("b", (32,), F32, 128))), "overlap"),
    "misaligned": (dict(tensors=(("a", (32,), F32, 8),)), "not aligned"),
    "unknown_type": (dict(tensors=(("a", (32,), 999, 0),)), "unknown type id 999"),
    "too_many_dims": (dict(tensors=(("a", (1, 1, 1, 1, 32), F32, 0),)), "dimensions"),
    "absurd_array": (dict(extra_kv=_str("x") + struct.pack("<IIQ", 9, 4, 1 << 60)),
                     "truncated while reading"),
    "absurd_string": (dict(extra_kv=_str("y") + struct.pack("<IQ", 8, 1 << 50)),
                      "truncated while reading"),
    # an array of 3 strings whose second claims more bytes than the file has
    "string_array_past_the_end": (dict(extra_kv=_str("z") + struct.pack("<IIQ", 9, 8, 3)
                                       + _str("ok") + struct.pack("<Q", 1 << 31)),
                                  "truncated while reading element 1"),
}


def test_string_arrays_read_compactly(tmp_path):
    """A string array comes back as a sequence over the file's bytes that reads like a list
    (items, slices, iteration, equality), with bad UTF-8 replaced, not raised."""
    words = ["", "héllo", "Ġworld", "<0x0A>"]
    raw_items = [_str(w) for w in words] + [struct.pack("<Q", 2) + b"\xff\xfe"]
    extra = _str("tokens") + struct.pack("<IIQ", 9, 8, len(raw_items)) + b"".join(raw_items)
    g = read_gguf(write(tmp_path, build_gguf(extra_kv=extra), "strings.gguf"))
    tokens = g.metadata["tokens"]
    assert len(tokens) == 5 and tokens[1] == "héllo" and tokens[-2] == "<0x0A>"
    assert tokens[1:3] == ["héllo", "Ġworld"] and list(tokens)[:4] == words
    assert tokens == [*words, "\ufffd\ufffd"] and tokens != words
    assert list(tokens.lengths) == [0, 6, 7, 6, 2]


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_a_clear_value_error(tmp_path, case):
    kwargs, message = BAD_FILES[case]
    path = write(tmp_path, build_gguf(**kwargs))
    with pytest.raises(ValueError, match=message):
        read_gguf(path)


def test_good_handmade_file_reads(tmp_path):
    path = write(tmp_path, build_gguf(), "good.gguf")
    g = read_gguf(path)
    assert list(g.tensors) == ["a", "b"]
    assert g.tensors["a"].dequantize().shape == (32,)


def test_truncated_real_file(tmp_path):
    full = write_tiny_llama(tmp_path / "tiny.gguf").read_bytes()
    for cut in (10, 100, len(full) // 2, len(full) - 1):
        path = write(tmp_path, full[:cut], f"cut{cut}.gguf")
        with pytest.raises(ValueError, match="truncated|only"):
            read_gguf(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="directory"):
        read_gguf(tmp_path)


def test_tensors_are_zero_copy_views(tmp_path):
    g = read_gguf(write_tiny_llama(tmp_path / "tiny.gguf"))
    t = g.tensors["blk.0.attn_q.weight"]
    assert not t.data.flags.owndata and not t.data.flags.writeable
    assert t.shape == (64, 64) and t.dequantize().dtype == np.float32


def test_real_model_metadata(model_path):
    g = read_gguf(model_path("gemma-3-270m"))
    assert g.architecture == "gemma3"
    assert g.metadata["gemma3.attention.sliding_window"] == 512
    assert g.tensors["token_embd.weight"].shape == (262144, 640)


# -- the same failures through the CLI ------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm.apps.cli", *args],
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgellm: error:"), result.stderr
    assert message in lines[0]


@pytest.mark.parametrize("case", ["bad_magic", "version_99", "past_the_end", "overlap",
                                  "misaligned", "absurd_tensor_count", "absurd_array"])
def test_cli_reports_bad_file_in_one_line(tmp_path, case):
    kwargs, message = BAD_FILES[case]
    path = write(tmp_path, build_gguf(**kwargs))
    assert_one_line_error(run_cli("info", str(path)), message)


def test_cli_truncated_model_for_generate(tmp_path):
    full = write_tiny_llama(tmp_path / "tiny.gguf").read_bytes()
    path = write(tmp_path, full[: len(full) - 1000], "cut.gguf")
    assert_one_line_error(run_cli("generate", "-m", str(path), "-p", "hi", "--backend", "numpy"),
                          "truncated")


def test_cli_missing_file_and_unknown_model(tmp_path):
    assert_one_line_error(run_cli("info", str(tmp_path / "missing.gguf")), "no such model file")
    assert_one_line_error(run_cli("info", "no-such-model"), "unknown model 'no-such-model'")


def test_cli_unknown_architecture(tmp_path):
    path = write(tmp_path, build_gguf(kv={"general.architecture": "mamba9"}))
    result = run_cli("generate", "-m", str(path), "-p", "hi", "--backend", "numpy")
    assert_one_line_error(result, "unsupported architecture 'mamba9'")
