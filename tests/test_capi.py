"""The C ABI end to end: libedgellm built with cffi's embedding mode, C programs compiled
with the system's C compiler against edgellm.h, run in their own processes on real models.

tests/capi_check.c drives the library (bad input, cancellation from a second pthread, four
threads on one model, load/free cycles); native/examples/chat.c is the example app.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from edgellm.sampling import SamplingParams

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
QWEN = "qwen2.5-coder-0.5b-instruct"
GEMMA = "gemma-3-270m"


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    pytest.skip("no C compiler")


@pytest.fixture(scope="module")
def capi(tmp_path_factory):
    """(folder with libedgellm + edgellm.h, compile(source) -> executable)."""
    pytest.importorskip("cffi")
    from edgellm.native import capi_build

    cc = _compiler()
    out = tmp_path_factory.mktemp("capi")
    lib = capi_build.build(out)
    assert lib.is_file() and (out / "edgellm.h").is_file()

    def compile_c(source: Path) -> Path:
        exe = out / source.stem
        subprocess.run([cc, "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-O1",
                        "-I", str(out), str(source), "-L", str(out), "-ledgellm",
                        f"-Wl,-rpath,{out}", "-pthread", "-o", str(exe)],
                       check=True, capture_output=True, text=True)
        return exe

    return out, compile_c


def run(exe: Path, *args: str, stdin: str = "", timeout: float = 600) -> dict[str, str]:
    """Run a C program; its "key value" lines as a dict. It must exit 0 (never crash)."""
    proc = subprocess.run([str(exe), *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        out[key] = value
    out["_stdout"], out["_stderr"] = proc.stdout, proc.stderr
    return out


@pytest.fixture(scope="module")
def check(capi):
    return capi[1](ROOT / "tests" / "capi_check.c")


def test_build_command_says_where_the_files_are_and_how_to_link(capi, capsys):
    from edgellm.apps.cli import main

    out = capi[0]
    assert main(["capi", "build", "--out", str(out)]) == 0  # up to date: no recompilation
    printed = capsys.readouterr().out
    assert str(out / "edgellm.h") in printed and "-ledgellm" in printed
    assert "EDGELLM_PYTHON" in printed


# -- the example app streams what the Python API generates ----------------------------------
def test_example_chat_streams_the_python_api_tokens(capi, model_path):
    from edgellm.api import load

    exe = capi[1](ROOT / "native" / "examples" / "chat.c")
    path = str(model_path(QWEN))
    question = "Write a Python function that checks whether a number is prime."
    c = subprocess.run([str(exe), "-m", path, "-n", "24", "-t", "0", "--ids"], input=question,
                       capture_output=True, text=True, timeout=600)
    assert c.returncode == 0, c.stderr
    c_ids = [int(t) for t in c.stderr.split("ids:")[1].split()]
    with load(path) as model:
        model.start_engine(max_seqs=1)
        reply = model.complete_chat([{"role": "user", "content": question}],
                                    SamplingParams(temperature=0, max_tokens=24))
    assert c_ids == reply.tokens and len(c_ids) == 24
    assert c.stdout == reply.text + "\n"


def test_a_missing_python_runtime_is_a_status_and_a_message(capi):
    exe = capi[1](ROOT / "native" / "examples" / "chat.c")
    env = {**os.environ, "EDGELLM_PYTHON": "/nonexistent/venv/bin/python"}
    c = subprocess.run([str(exe)], input="hi\n", capture_output=True, text=True, env=env,
                       timeout=60)
    assert c.returncode == 1
    assert "EDGELLM_ERR_RUNTIME" in c.stderr and "/nonexistent/venv/bin/python" in c.stderr
    assert "EDGELLM_PYTHON" in c.stderr  # and what to do about it


# -- bad input: a status and a message, never a crash --------------------------------------
BAD_INPUT = {
    "null_out_model": "INVALID_ARGUMENT",
    "null_options": "INVALID_ARGUMENT",
    "null_model_free": "INVALID_ARGUMENT",
    "null_model_tokenize": "INVALID_ARGUMENT",
    "null_request_cancel": "INVALID_ARGUMENT",
    "null_chat_request": "INVALID_ARGUMENT",
    "null_tokenize_text": "INVALID_ARGUMENT",
    "null_tokenize_count": "INVALID_ARGUMENT",
    "null_tokens_with_capacity": "INVALID_ARGUMENT",
    "chat_null_json": "INVALID_ARGUMENT",
    "json_invalid": "INVALID_JSON",
    "json_not_object": "INVALID_JSON",
    "json_wrong_type": "INVALID_JSON",
    "json_unknown_key": "INVALID_JSON",
    "json_bad_utf8": "INVALID_JSON",
    "chat_json_invalid": "INVALID_JSON",
    "chat_wrong_type": "INVALID_JSON",
    "chat_message_wrong_type": "INVALID_JSON",
    "chat_bad_role": "INVALID_JSON",
    "chat_unsupported_key": "INVALID_JSON",
    "chat_bad_temperature": "INVALID_JSON",
    "complete_missing_prompt": "INVALID_JSON",
    "bad_backend": "INVALID_JSON",
    "unknown_model": "NOT_FOUND",
    "missing_file": "NOT_FOUND",
    "not_a_model": "BAD_MODEL",
    "load_cancelled_by_progress": "CANCELLED",
    "bad_tokenize_flags": "INVALID_ARGUMENT",
    "detokenize_bad_id": "INVALID_ARGUMENT",
    "chat_beyond_context": "CONTEXT",
    "tokenize_too_small": "BUFFER_TOO_SMALL",
    "detokenize_too_small": "BUFFER_TOO_SMALL",
    "info_too_small": "BUFFER_TOO_SMALL",
    "result_too_small": "BUFFER_TOO_SMALL",
    "result_before_run": "BUSY",
    "chat_runs_once": "BUSY",
    "request_used_after_free": "INVALID_HANDLE",
    "request_freed_twice": "INVALID_HANDLE",
    "request_as_model": "INVALID_HANDLE",
    "forged_handle": "INVALID_HANDLE",
    "model_used_after_free": "INVALID_HANDLE",
    "model_freed_twice": "INVALID_HANDLE",
    "request_create_after_free": "INVALID_HANDLE",
    "orphan_request_runs": "INVALID_HANDLE",
    "stale_handle_after_reuse": "INVALID_HANDLE",
}
#: calls between the failures that must succeed (the library keeps working)
GOOD_CALLS = ("model_after_failures_is_null", "request_free", "model_free",
              "orphan_request_free", "new_handle_works")


@pytest.fixture(scope="module")
def bad_input(check, model_path, tmp_path_factory) -> dict[str, tuple[str, str]]:
    garbage = tmp_path_factory.mktemp("garbage") / "not-a-model.gguf"
    garbage.write_bytes(b"GGUF" + os.urandom(4096))
    out = run(check, "bad", str(model_path(GEMMA)), "/nonexistent/dir/model.gguf",
              str(garbage))
    assert "done" in out, out["_stdout"]
    cases = {}
    for line in out["_stdout"].splitlines():
        if line.startswith("case "):
            _, name, status, message = (line.split(" ", 3) + [""])[:4]
            cases[name] = (status, message)
    # the two-call sizing worked where the buffers were right
    assert out["tokenize_size"] == out["tokenize_full"] == "EDGELLM_OK 7"
    assert out["detokenize_full"].startswith("EDGELLM_OK 27 Hello, world! Hello again.")
    assert out["chat_ok"] == "EDGELLM_OK"
    assert int(out["progress_calls"]) >= 2  # the progress callback ran ("file", "weights")
    assert out["last_error_per_thread"] == "1"
    return cases


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_gives_a_status_and_a_message(bad_input, case):
    status, message = bad_input[case]
    assert status == f"EDGELLM_ERR_{BAD_INPUT[case]}", message
    assert message.strip(), "no message from edgellm_last_error()"


def test_good_calls_between_bad_ones_still_work(bad_input):
    for case in GOOD_CALLS:
        assert bad_input[case][0] == "EDGELLM_OK", case
    assert "needed" in bad_input["tokenize_too_small"][1] or "holds" in \
        bad_input["tokenize_too_small"][1]
    assert "colour" in bad_input["json_unknown_key"][1]  # the message names the key
    assert "tools" in bad_input["chat_unsupported_key"][1]


# -- cancellation from a second pthread ----------------------------------------------------
def test_cancel_from_another_thread_stops_within_one_token(check, model_path):
    out = run(check, "cancel", str(model_path(QWEN)))
    assert out["cancel_status"] == "EDGELLM_ERR_CANCELLED"
    # the engine ran at most the step in flight after the cancel, and no chunk came after it
    assert int(out["cancel_steps_max"]) <= 1
    assert int(out["chunks_total"]) - int(out["chunks_at_cancel"]) <= 1
    assert out["cancel_before_run"].startswith("EDGELLM_ERR_CANCELLED 0")
    # the model is still usable: the same request gives the same tokens as before
    assert out["usable_after_cancel"] == "1", (out["ids_before"], out["ids_after"])
    # freeing the model cancels a request running on another thread; its handle stays freeable
    assert out["free_while_running"] == "EDGELLM_OK EDGELLM_ERR_CANCELLED"
    assert out["request_free_after_model"] == "EDGELLM_OK"


def test_cancel_stops_a_long_prefill_within_one_slice(check, model_path):
    out = run(check, "prefill", str(model_path(QWEN)))
    prompt = int(out["prompt_tokens"])
    assert prompt >= 2000
    assert out["cancel_status"] == "EDGELLM_ERR_CANCELLED" and out["chunks"] == "0"
    # cancelled after the first slice: at most the slice in flight ran after it
    assert int(out["cancel_steps_max"]) <= 1
    at_cancel, total = int(out["prefilled_at_cancel"]), int(out["prefilled_total"])
    assert total - at_cancel <= 512 and total < prompt
    assert out["usable_after_cancel"] == "1"


# -- four threads on one model --------------------------------------------------------------
def test_four_threads_get_their_solo_outputs(check, model_path):
    out = run(check, "threads", str(model_path(QWEN)))
    for i in range(4):
        assert out[f"status_{i}"] == "EDGELLM_OK EDGELLM_OK"
        assert out[f"solo_{i}"] == out[f"together_{i}"] and out[f"solo_{i}"].strip()
    assert out["all_same"] == "1"
    assert int(out["most_active"]) >= 2  # they really ran at the same time, in one batch


# -- load and free ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", [GEMMA, QWEN])
def test_load_and_free_20_times_keeps_rss_flat(check, model_path, name):
    # the 0.5B's 151k-token vocabulary and its attribute names once grew RSS ~1 MB a cycle
    # (names held by CPython's type cache pinned pymalloc arenas); ~1 minute on 2 cores
    out = run(check, "cycles", str(model_path(name)), "20")
    freed = [int(line.split()[5]) for line in out["_stdout"].splitlines()
             if line.startswith("cycle ")]
    loaded = [int(line.split()[3]) for line in out["_stdout"].splitlines()
              if line.startswith("cycle ")]
    assert len(freed) == 20
    # after the first cycle (the interpreter's imports, the C kernels) RSS stays put
    assert max(freed[1:]) - min(freed[1:]) <= 10 * 1024, freed
    assert max(freed) - freed[0] <= 10 * 1024, freed
    assert min(loaded) - max(freed) > 100 * 1024  # the model really was resident, then freed
