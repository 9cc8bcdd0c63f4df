"""Fuzzing the other files a user hands us: chat ``/load`` files and safetensors headers.
Every input either loads or fails with one ``ValueError`` line (hypothesis generates them:
arbitrary JSON, and structured damage to valid files)."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgellm.chat import ChatSession

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner,
                                                                 max_size=5),
    max_leaves=30,
)
PARAM_NAMES = ["temperature", "top_k", "top_p", "min_p", "max_tokens", "seed", "stop",
               "logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "ignore_eos", "bogus"]


def _one_line_value_error(exc: BaseException) -> None:
    assert isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}"
    assert str(exc).strip() and "\n" not in str(exc).strip(), repr(str(exc))


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    from edgellm.api import load
    from tests.tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    return ChatSession(load(path, backend="numpy"))


def _try_load(session: ChatSession, data) -> None:
    try:
        session.load_dict(data)
    except Exception as exc:  # noqa: BLE001 - anything but a one-line ValueError fails
        _one_line_value_error(exc)
        return
    # what loaded must be usable: the template renders it
    session.model.apply_chat_template(session.conversation())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=JSON)
def test_load_arbitrary_json(session, data):
    _try_load(session, data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(params=st.dictionaries(st.sampled_from(PARAM_NAMES), JSON, max_size=6),
       messages=st.lists(st.dictionaries(st.sampled_from(["role", "content", "cut", "x"]),
                                         JSON | st.sampled_from(["user", "assistant"]),
                                         max_size=4), max_size=4),
       system=JSON)
def test_load_damaged_saves(session, params, messages, system):
    _try_load(session, {"format": 1, "model": "m", "system": system, "params": params,
                        "messages": messages})


def test_load_file_errors_are_one_line(session, tmp_path):
    for raw in (b"", b"\xff\xfe", b"{", b"[]", b'{"messages": [1]}', b"\x00" * 10,
                json.dumps({"messages": [], "params": {"stop": 5}}).encode()):
        path = tmp_path / "chat.json"
        path.write_bytes(raw)
        with pytest.raises(ValueError) as info:
            session.load(path)
        _one_line_value_error(info.value)


# -- safetensors headers (the converter reads them; issue 12) ----------------------------------
def _safetensors(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(blob) if length is None else length) + blob + data


ENTRY = st.fixed_dictionaries(
    {}, optional={"dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "F8_E4M3"]) | JSON,
                  "shape": st.lists(st.integers(-3, 2**40), max_size=4) | JSON,
                  "data_offsets": st.lists(st.integers(-8, 2**64), max_size=3) | JSON})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(header=st.dictionaries(st.text(max_size=8), ENTRY | JSON, max_size=4) | JSON,
       data_len=st.integers(0, 256), length_lie=st.none() | st.integers(0, 2**64 - 1))
def test_safetensors_headers(tmp_path, header, data_len, length_lie):
    hf_folder = pytest.importorskip("edgellm.converters.hf_folder")
    path = tmp_path / "model.safetensors"
    path.write_bytes(_safetensors(header, bytes(data_len), length_lie))
    try:
        entries = hf_folder.read_safetensors_header(path)
    except Exception as exc:  # noqa: BLE001
        _one_line_value_error(exc)
        return
    for entry in entries.values():  # what was accepted lies inside the file, sized right
        assert 0 <= entry.start <= entry.end <= path.stat().st_size
        assert all(isinstance(d, int) and d >= 0 for d in entry.shape)


# -- server request bodies (the server: issue 13) ---------------------------------------------
ROLES = st.sampled_from(["system", "user", "assistant", "developer", "tool", "bogus"])
MESSAGE = st.fixed_dictionaries({}, optional={"role": ROLES | JSON, "content": st.text(max_size=30)
                                              | JSON, "name": JSON})
CHAT_BODY = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "other"])},
    optional={"messages": st.lists(MESSAGE, max_size=3) | JSON,
              "max_tokens": st.integers(-2, 6) | JSON, "temperature": st.floats() | JSON,
              "top_p": st.floats() | JSON, "top_k": st.integers(-5, 2**40) | JSON,
              "n": st.integers(-1, 3) | JSON, "stop": st.text(max_size=4) | JSON,
              "logit_bias": st.dictionaries(st.text(max_size=6), JSON, max_size=3) | JSON,
              "seed": st.integers(-2**70, 2**70) | JSON, "stream": st.booleans() | JSON,
              "logprobs": JSON, "top_logprobs": st.integers(-2, 30) | JSON,
              "response_format": JSON, "tools": JSON})


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    server = pytest.importorskip("edgellm.server")
    from fastapi.testclient import TestClient

    from edgellm.api import load
    from edgellm.engine import Engine
    from tests.tiny_models import write_tiny_llama

    model = load(write_tiny_llama(tmp_path_factory.mktemp("srv") / "tiny.gguf"),
                 backend="numpy")
    engine = Engine(model, ctx=128, max_seqs=2)
    with TestClient(server.create_app(engine, "tiny"), raise_server_exceptions=False) as c:
        yield c
    engine.close()


def _check_response(response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"].strip() and "\n" not in error["message"].strip(), error


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(body=CHAT_BODY)
def test_server_chat_bodies(client, body):
    raw = json.dumps(body).encode()  # NaN and Infinity as Python writes them: a parser test
    _check_response(client.post("/v1/chat/completions", content=raw,
                                headers={"content-type": "application/json"}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize",
                             "/detokenize"]),
       raw=st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
def test_server_arbitrary_bodies(client, path, raw):
    _check_response(client.post(path, content=raw, headers={"content-type": "application/json"}))


# -- tokenizer.json (the converter reads it; issue 12) ----------------------------------------
VOCAB = st.dictionaries(st.text(max_size=6), st.integers(-5, 2**40) | JSON, max_size=6)
TOKENIZER_JSON = st.fixed_dictionaries(
    {}, optional={
        "model": st.fixed_dictionaries({}, optional={
            "type": st.sampled_from(["BPE", "Unigram", "WordPiece"]) | JSON,
            "vocab": VOCAB | JSON,
            "merges": st.lists(st.text(max_size=6) | st.lists(st.text(max_size=3), max_size=3)
                               | JSON, max_size=4) | JSON}) | JSON,
        "pre_tokenizer": st.just({"type": "ByteLevel", "add_prefix_space": False,
                                  "trim_offsets": True, "use_regex": True}) | JSON,
        "added_tokens": st.lists(st.fixed_dictionaries({}, optional={
            "id": st.integers(-5, 2**40) | JSON, "content": st.text(max_size=8) | JSON,
            "special": JSON}) | JSON, max_size=3) | JSON})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=TOKENIZER_JSON | JSON, vocab_size=st.integers(1, 64))
@example(data={"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                                 "trim_offsets": True, "use_regex": True},
               "model": {"type": "BPE"}}, vocab_size=1)  # no vocab: was a KeyError
def test_tokenizer_json(tmp_path, data, vocab_size):
    hf_folder = pytest.importorskip("edgellm.converters.hf_folder")
    hf_tokenizer = pytest.importorskip("edgellm.converters.hf_tokenizer")
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    folder = hf_folder.HFFolder(tmp_path, {"architectures": ["LlamaForCausalLM"]}, {})
    try:
        meta = hf_tokenizer.tokenizer_metadata(folder, vocab_size)
    except Exception as exc:  # noqa: BLE001
        _one_line_value_error(exc)
        return
    assert len(meta["tokenizer.ggml.tokens"]) < 1 << 20  # no vocabulary blown up by one id
