"""The C ABI's Python side without a compiler or a model: handle tables (generation
counters), JSON validation, request translation and the two-call buffer sizing rules."""

from __future__ import annotations

import pytest

from edgellm import capi
from edgellm.capi import CapiError, HandleTable


def status_of(fn, *args) -> int:
    with pytest.raises(CapiError) as info:
        fn(*args)
    assert str(info.value).strip()
    return info.value.status


def test_a_freed_handle_stays_invalid_when_its_slot_is_reused():
    table = HandleTable(capi.MODEL_KIND)
    first = table.add("a")
    assert table.get(first) == "a"
    assert table.remove(first) == "a"
    second = table.add("b")  # the same slot, the next generation
    assert second != first and second & 0xFFFFFF == first & 0xFFFFFF
    assert table.get(second) == "b"
    assert status_of(table.get, first) == capi.INVALID_HANDLE
    assert status_of(table.remove, first) == capi.INVALID_HANDLE
    assert table.get(second) == "b"  # the failed remove took nothing


def test_handles_of_another_kind_or_forged_are_refused():
    models, requests = HandleTable(capi.MODEL_KIND), HandleTable(capi.REQUEST_KIND)
    request = requests.add("r")
    assert status_of(models.get, request) == capi.INVALID_HANDLE
    for forged in (0, 1, 0x1234, (capi.MODEL_KIND << 56) | (7 << 24) | 5, 2**64 - 1):
        assert status_of(models.get, forged) == capi.INVALID_HANDLE
    assert "request handle" in str(pytest.raises(CapiError, models.get, request).value)


@pytest.mark.parametrize("text, expected", [
    ("", "not valid JSON"),
    ("{", "not valid JSON"),
    ("[]", "not an array"),
    ('"model"', "not a string"),
    ("null", "not null"),
    ("[" * 100000, "not valid JSON"),  # deep nesting: an error, not a RecursionError crash
])
def test_parse_object_refuses_what_is_not_an_object(text, expected):
    with pytest.raises(CapiError) as info:
        capi.parse_object(text, "load options")
    assert info.value.status == capi.INVALID_JSON
    assert expected.split()[-1] in str(info.value)


@pytest.mark.parametrize("options, key", [
    ({}, "'model' is required"),
    ({"model": ""}, "'model' must not be empty"),
    ({"model": 3}, "'model' must be a string"),
    ({"model": "m", "threads": True}, "'threads' must be an integer"),
    ({"model": "m", "threads": 1.5}, "'threads' must be an integer"),
    ({"model": "m", "threads": 0}, "'threads' must be >= 1"),
    ({"model": "m", "context_length": "4096"}, "'context_length' must be an integer"),
    ({"model": "m", "max_sequences": 1000}, "'max_sequences' must be between"),
    ({"model": "m", "ctx": 5}, "unsupported key 'ctx'"),
])
def test_load_options_name_the_key_at_fault(options, key):
    with pytest.raises(CapiError) as info:
        capi.validate(options, capi.LOAD_OPTIONS, "load options")
    assert info.value.status == capi.INVALID_JSON
    assert key in str(info.value)


def test_null_counts_as_absent_and_good_options_pass():
    fields = capi.validate({"model": "m", "threads": None, "backend": "cpu"}, capi.LOAD_OPTIONS,
                           "load options")
    assert fields == {"model": "m", "backend": "cpu"}


def test_chat_requests_become_sampling_params():
    fields = capi.validate({"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                            "max_completion_tokens": 7, "stop": "\n", "seed": 3, "top_k": 5,
                            "model": "ignored", "stream": True},
                           capi.CHAT_FIELDS, "chat request")
    params = capi.sampling_params(fields)
    assert (params.temperature, params.max_tokens, params.stop, params.seed, params.top_k) == \
        (0, 7, ("\n",), 3, 5)
    assert capi.chat_messages(fields["messages"]) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, message", [
    ({"messages": []}, "must not be empty"),
    ({"messages": ["hi"]}, "messages[0] must be an object"),
    ({"messages": [{"role": "user"}]}, "'content' is required"),
    ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "unsupported key 'name'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role must be one of"),
])
def test_bad_messages_are_refused_naming_the_message(body, message):
    fields = capi.validate(body, capi.CHAT_FIELDS, "chat request")
    with pytest.raises(CapiError) as info:
        capi.chat_messages(fields["messages"])
    assert info.value.status == capi.INVALID_JSON and message in str(info.value)


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"prompt": "x", "stop": [1]}, "array of strings"),
    ({"prompt": "x", "top_p": 0}, "(0, 1]"),
    ({"prompt": "x", "max_tokens": -1}, ">= 0"),
    ({"prompt": ["x"]}, "'prompt' must be a string"),
    ({"prompt": "x", "logprobs": 2}, "unsupported key 'logprobs'"),
])
def test_bad_completion_requests_name_the_key(body, message):
    with pytest.raises(CapiError) as info:
        capi.validate(body, capi.COMPLETION_FIELDS, "completion request")
    assert info.value.status == capi.INVALID_JSON and message in str(info.value)


def test_status_codes_match_the_header():
    from pathlib import Path

    header = (Path(__file__).resolve().parents[1] / "native" / "edgellm.h").read_text()
    names = {"OK": "OK", "INVALID_ARGUMENT": "ERR_INVALID_ARGUMENT",
             "INVALID_JSON": "ERR_INVALID_JSON", "NOT_FOUND": "ERR_NOT_FOUND",
             "BAD_MODEL": "ERR_BAD_MODEL", "BUFFER_TOO_SMALL": "ERR_BUFFER_TOO_SMALL",
             "INVALID_HANDLE": "ERR_INVALID_HANDLE", "CANCELLED": "ERR_CANCELLED",
             "CONTEXT": "ERR_CONTEXT", "BUSY": "ERR_BUSY", "VERSION": "ERR_VERSION",
             "RUNTIME": "ERR_RUNTIME", "INTERNAL": "ERR_INTERNAL"}
    for py, c in names.items():
        assert f"#define EDGELLM_{c} {getattr(capi, py)}" in header.replace("  ", " ")
    assert f"#define EDGELLM_TOKENIZE_ADD_BOS {capi.TOKENIZE_ADD_BOS}" in header
    assert f"#define EDGELLM_TOKENIZE_PARSE_SPECIAL {capi.TOKENIZE_PARSE_SPECIAL}" in header
