"""GGUF fuzzing in the suite: the committed corpus (seeds and every input that once crashed,
hung or over-allocated) replays through read, load and a forward pass on both backends, and a
few hundred fresh structure-aware mutations run in-process with time and allocation checks.
The long run is ``scripts/fuzz_gguf.py``."""

from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

import pytest

from edgellm import store
from tests import gguf_fuzz

CORPUS = Path(__file__).parent / "fuzz_corpus"
FRESH_INPUTS = 240
TIME_LIMIT_S = 5.0
ALLOC_FACTOR, ALLOC_SLACK = 16, 64 << 20  # as scripts/fuzz_gguf.py


def corpus_files() -> list[Path]:
    return sorted(CORPUS.glob("*.gguf"))


def test_corpus_is_present():
    names = [p.name for p in corpus_files()]
    assert any(n.startswith("seed_") for n in names)
    assert sum(n.startswith("crash-") for n in names) >= 10


@pytest.mark.parametrize("path", corpus_files(), ids=lambda p: p.name)
def test_corpus_replays_without_crash(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # garbage weights overflow: expected, not a failure
        for backend in ("numpy", "cpu"):
            start = time.monotonic()
            message = gguf_fuzz.run_target(path, backend=backend)  # raises Crash on a bug
            assert time.monotonic() - start < TIME_LIMIT_S * 3, "far too slow"
            if path.name.startswith("seed_"):
                assert message == "ok", message


@pytest.fixture(scope="module")
def seed_docs(tmp_path_factory):
    real = {name: store.model_file(name) for name in ("qwen2.5-coder-0.5b-instruct",
                                                      "gemma-3-270m") if store.is_installed(name)}
    seeds = gguf_fuzz.write_seeds(tmp_path_factory.mktemp("seeds"), real)
    return [gguf_fuzz.parse_doc(p.read_bytes()) for p in seeds]


def test_seeds_round_trip_through_the_mutator_model(seed_docs, tmp_path):
    """The fuzzer's parse/serialize is exact, so its mutations start from real files."""
    for i, doc in enumerate(seed_docs):
        path = tmp_path / f"rt{i}.gguf"
        path.write_bytes(gguf_fuzz.serialize(doc))
        assert gguf_fuzz.run_target(path) == "ok"


def test_fresh_mutations_are_rejected_cleanly(seed_docs, tmp_path):
    """A few hundred new inputs: one-line ValueErrors or a working model, within 5 s each and
    an allocation budget proportional to the file's size."""
    import random

    rng = random.Random(20261123)
    path = tmp_path / "input.gguf"
    outcomes = {"ok": 0, "rejected": 0}
    tracemalloc.start()
    try:
        for i in range(FRESH_INPUTS):
            raw, steps = gguf_fuzz.mutate(seed_docs[i % len(seed_docs)], rng)
            path.write_bytes(raw)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            start = time.monotonic()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    message = gguf_fuzz.run_target(path, backend="numpy" if i % 2 else "cpu")
                except gguf_fuzz.Crash as exc:
                    pytest.fail(f"input {i} ({steps}) crashed: {exc}")
            elapsed = time.monotonic() - start
            peak = tracemalloc.get_traced_memory()[1] - base
            assert elapsed < TIME_LIMIT_S, f"input {i} ({steps}) took {elapsed:.1f} s"
            assert peak < ALLOC_FACTOR * len(raw) + ALLOC_SLACK, \
                f"input {i} ({steps}) allocated {peak} bytes for a {len(raw)}-byte file"
            outcomes["ok" if message == "ok" else "rejected"] += 1
    finally:
        tracemalloc.stop()
    assert outcomes["rejected"] > FRESH_INPUTS // 2 and outcomes["ok"] > 0, outcomes


@pytest.mark.parametrize("name", ["crash-", "seed_llama_q8_0"])
def test_cli_reports_a_corpus_file_in_one_line(name):
    bad = [p for p in corpus_files() if p.name.startswith(name)]
    path = bad[0]
    result = subprocess.run([sys.executable, "-m", "edgellm.apps.cli", "generate", "-m",
                             str(path), "-p", "hi", "-n", "2", "--backend", "numpy"],
                            capture_output=True, text=True, timeout=120)
    assert "Traceback" not in result.stderr
    if result.returncode:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("edgellm: error:"), result.stderr


def test_half_of_a_qk_norm_pair_is_refused(seed_docs, tmp_path):
    """Found by the fuzzer on the Gemma seed (not committed: Gemma's vocabulary is not ours to
    ship): a file with attn_q_norm but no attn_k_norm crashed the forward pass."""
    gemma = [d for d in seed_docs if d.kv("general.architecture").value == b"gemma3"]
    if not gemma:
        pytest.skip("needs gemma-3-270m installed for the Gemma seed")
    doc = gguf_fuzz.copy.deepcopy(gemma[0])
    for t in doc.tensors:
        if t.name == b"blk.0.attn_k_norm.weight":
            t.name = b""
    path = tmp_path / "half_qk_norm.gguf"
    path.write_bytes(gguf_fuzz.serialize(doc))
    assert "lacks 'blk.0.attn_k_norm.weight'" in gguf_fuzz.run_target(path)
