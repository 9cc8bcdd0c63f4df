"""`edgellm serve` end to end: a live server on loopback (a subprocess on a free port) driven
with the official `openai` client and raw HTTP. Chat and completions, streamed and not, usage,
logprobs, n > 1, seeds, stop strings, every error path, concurrency, client disconnects."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b-instruct"
KEY = "test-key-123"
CTX = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """(base url, log path): `edgellm serve` in a subprocess, stopped after the module."""
    model_path(MODEL)
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "edgellm.apps.cli", "serve", "-m", MODEL, "-t", "2",
           "--ctx", str(CTX), "--parallel", "8", "--max-queue", "16", "--port", str(port),
           "--api-key", KEY, "--max-body", "64KB"]
    env = dict(os.environ, EDGELLM_API_KEY="")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):  # loading the model takes a few seconds (more on a busy machine)
            if proc.poll() is not None:
                pytest.fail(f"server exited: {Path(log).read_text()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("server did not come up in 120 s")
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=300)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def ask(client, content: str, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": content}], **kw)


def test_chat_streamed_and_not_agree_with_usage_in_the_stream(client):
    whole = ask(client, "Name three colors.")
    assert whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 5 and 0 < whole.usage.completion_tokens <= 12
    pieces, usage, finish = [], None, None
    for chunk in ask(client, "Name three colors.", stream=True,
                     stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt: its prefix reused


def test_completions_streamed_and_not(client):
    whole = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=10,
                                      temperature=0)
    text = whole.choices[0].text
    assert text and whole.object == "text_completion"
    stream = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=10,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == text


def test_logprobs_chat_and_completions(client):
    r = ask(client, "Say yes.", logprobs=True, top_logprobs=3, max_tokens=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy took the most likely
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
    c = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == c.choices[0].text
    assert all(len(t) == 2 for t in lp.top_logprobs)


def test_n_choices_and_seeded_sampling_repeat(client):
    kw = {"temperature": 1.2, "top_p": 1.0, "seed": 1234, "max_tokens": 12}
    first = ask(client, "Write a word.", n=2, **kw)
    again = ask(client, "Write a word.", n=2, **kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in again.choices]  # same seed, same choices
    solo = [ask(client, "Write a word.", **(kw | {"seed": 1234 + i})) for i in range(2)]
    assert texts == [r.choices[0].message.content for r in solo]  # choice i: seed + i
    assert first.usage.completion_tokens == sum(r.usage.completion_tokens for r in solo)
    assert first.usage.prompt_tokens == solo[0].usage.prompt_tokens  # the prompt counts once
    other = ask(client, "Write a word.", n=2, **(kw | {"seed": 99}))
    assert [c.message.content for c in other.choices] != texts


def test_stop_strings(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=30,
                                  temperature=0, stop=[" 8", "zzz"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text.startswith(" 6, 7,") and " 8" not in r.choices[0].text


def test_models_list_and_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    headers = {"Authorization": f"Bearer {KEY}"}
    ids = httpx.post(server[0] + "/tokenize", headers=headers,
                     json={"content": "hello world", "add_special": False}).json()["tokens"]
    assert ids
    back = httpx.post(server[0] + "/detokenize", headers=headers, json={"tokens": ids}).json()
    assert back["content"] == "hello world"


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_every_error_path_then_still_serving(server, client):
    url = server[0]
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    chat = url + "/v1/chat/completions"
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    r = httpx.post(chat, headers=auth, content=b'{"model": "x", "messages": [')
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    r = httpx.post(chat, headers=auth, json=ok | {"max_tokens": "ten"})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
    r = httpx.post(chat, headers=auth, json=ok | {"messages": "hi"})
    assert r.status_code == 400 and error_of(r)["param"].startswith("messages")
    r = httpx.post(chat, headers=auth, json=ok | {"temperature": 5})
    assert r.status_code == 400 and error_of(r)["param"] == "temperature"
    r = httpx.post(chat, headers=auth, json=ok | {"tools": [{"type": "function"}]})
    assert r.status_code == 400 and error_of(r)["param"] == "tools"
    assert "tools" in error_of(r)["message"]
    r = httpx.post(url + "/v1/completions", headers=auth,
                   json={"model": MODEL, "prompt": "x", "echo": True})
    assert r.status_code == 400 and error_of(r)["param"] == "echo"
    r = httpx.post(chat, headers=auth, json=ok | {"model": "gpt-4"})
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    long_prompt = "word " * (CTX + 50)
    r = httpx.post(chat, headers=auth, json=ok | {"messages": [{"role": "user",
                                                                  "content": long_prompt}]})
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded"
    r = httpx.post(chat, headers=auth, json=ok | {"max_tokens": CTX})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
    r = httpx.post(chat, headers=auth, content=b"x" * (65 * 1000))
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    r = httpx.get(url + "/v1/nowhere", headers=auth)
    assert r.status_code == 404 and error_of(r)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(chat, headers=headers, json=ok)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # the one open route
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, "hi", extra_body={"response_format": {"type": "json_object"}})
    assert info.value.status_code == 400
    # still serving
    assert ask(client, "Say hi.", max_tokens=3).choices[0].message.content
    assert metrics(url)["edgellm_slots_free"] == 8


PROMPTS = ["def add(a, b):", "The sky is", "import os\n", "SELECT * FROM", "class Node:",
           "# sort a list\n", "Hello, my name is", "for i in range(10):"]


def complete(client, prompt: str) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                     temperature=0).choices[0].text


def test_eight_concurrent_greedy_requests_equal_sequential_ones(client):
    one_by_one = [complete(client, p) for p in PROMPTS]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: complete(client, p), PROMPTS))
    assert together == one_by_one


def test_disconnect_mid_stream_stops_generation_within_one_step(server):
    url = server[0]
    before = metrics(url)
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 3:
                        break  # leaving the block closes the connection mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(url)
        if m["edgellm_slots_active"] == 0:
            break
        time.sleep(0.05)
    assert m["edgellm_slots_active"] == 0
    assert m['edgellm_requests_finished_total{reason="cancelled"}'] == \
        before.get('edgellm_requests_finished_total{reason="cancelled"}', 0) + 1
    assert m["edgellm_cancel_steps_max"] <= 1  # dropped at the step after the cancel
    generated = m["edgellm_generated_tokens_total"] - before["edgellm_generated_tokens_total"]
    assert generated < 40  # far from the 400 asked for
    time.sleep(0.5)
    assert metrics(url)["edgellm_generated_tokens_total"] == m["edgellm_generated_tokens_total"]


def test_one_log_line_per_request(server, client):
    ask(client, "Log me.", max_tokens=2)
    lines = [x for x in Path(server[1]).read_text().splitlines()
             if "POST /v1/chat/completions 200" in x]
    assert lines and "completion=" in lines[-1] and "t/s" in lines[-1]
