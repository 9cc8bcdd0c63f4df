"""NaN and infinite weights are refused at load, naming the tensor; NaN logits stop
generation with a clear error instead of a stream of garbage tokens."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from edgellm.api import load
from edgellm.converters.gguf_reader import read_gguf
from edgellm.generate import NonFiniteLogits, generate
from edgellm.model_checks import NonFiniteWeights, check_finite, first_nonfinite
from edgellm.sampling import SamplingParams
from tests.tiny_models import TinyConfig, write_tiny_llama

Q8_0 = GGMLQuantizationType.Q8_0
NAN_F16, INF_F16 = b"\x00\x7e", b"\x00\x7c"


def _poke(path, tensor: str, row: int, block: int, value: bytes) -> None:
    """Overwrite the f16 scale of one Q8_0 block of ``tensor`` in the file."""
    g = read_gguf(path)
    t = g.tensors[tensor]
    raw = path.read_bytes()
    start = raw.find(t.data.tobytes())  # the tensor's bytes are unique in the file
    assert start > 0
    at = start + row * t.data.shape[-1] + block * 34
    del g, t
    path.write_bytes(raw[:at] + value + raw[at + 2:])


@pytest.fixture
def q8_model(tmp_path):
    return write_tiny_llama(tmp_path / "q8.gguf", TinyConfig(qtype=Q8_0))


@pytest.mark.parametrize("value", [NAN_F16, INF_F16, b"\xff\xff"])
def test_nan_or_inf_scale_is_refused_naming_the_tensor(q8_model, value):
    _poke(q8_model, "blk.1.ffn_up.weight", row=17, block=1, value=value)
    with pytest.raises(NonFiniteWeights, match=r"'blk\.1\.ffn_up\.weight'.*row 17"):
        load(q8_model, backend="numpy")


def test_nan_in_f32_weight_is_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "f32.gguf")
    g = read_gguf(path)
    t = g.tensors["blk.0.attn_norm.weight"]
    raw = path.read_bytes()
    start = raw.find(t.data.tobytes())
    del g, t
    path.write_bytes(raw[:start + 8] + np.float32(np.nan).tobytes() + raw[start + 12:])
    with pytest.raises(NonFiniteWeights, match="'blk.0.attn_norm.weight'"):
        load(path, backend="numpy")


def test_clean_models_pass_and_a_nan_outside_the_scales_cannot_exist(q8_model):
    check_finite(read_gguf(q8_model).tensors)  # nothing raised
    # the quants are int8: every byte pattern is a finite value, only the scales can be NaN
    g = read_gguf(q8_model)
    assert all(first_nonfinite(t) is None for t in g.tensors.values())


def test_real_model_passes(model_path):
    check_finite(read_gguf(model_path("gemma-3-270m")).tensors)


def test_cli_names_the_tensor_in_one_line(q8_model):
    _poke(q8_model, "blk.0.attn_k.weight", row=3, block=0, value=NAN_F16)
    result = subprocess.run([sys.executable, "-m", "edgellm.apps.cli", "generate", "-m",
                             str(q8_model), "-p", "hi", "--backend", "numpy"],
                            capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("edgellm: error:") and "'blk.0.attn_k.weight'" in lines[0]


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_nan_logits_stop_generation(tmp_path, backend):
    """A weight that turns NaN after load (a numeric fault) stops generation at once."""
    model = load(write_tiny_llama(tmp_path / "tiny.gguf"), backend=backend)
    params = SamplingParams(temperature=0, max_tokens=8)
    assert generate(model, "hello", params)  # healthy first
    model.net.output_norm = np.full_like(np.asarray(model.net.output_norm), np.nan)  # (d,)
    with pytest.raises(NonFiniteLogits, match="NaN or infinite at generated token 0"):
        generate(model, "hello", params)
