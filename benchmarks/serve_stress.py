"""Load test for a running edgellm server: many clients, mixed requests, some disconnecting.

    edgellm serve -m qwen2.5-coder-0.5b-instruct -t 2 --parallel 8 --max-queue 4 --port 8092 &
    python benchmarks/serve_stress.py --url http://127.0.0.1:8092 \
        --model qwen2.5-coder-0.5b-instruct --requests 200 --clients 16 --disconnect 0.1

Clients retry a 503 after 0.5 s (so all the requests run, and the 503s are counted).
Requests mix chat and text completions, streamed and not, prompts of a few to several hundred
tokens and 4 to 48 output tokens; a share of the streams is dropped by the client after a
few chunks. Checks and reports: no 5xx (503 = the queue limit, intended, counted apart), every
finished response complete (a finish_reason, usage that agrees with it, ``[DONE]`` for
streams), every slot free and nothing queued at the end (``/metrics``), and the server's
resident memory after a warm-up round against the end (``process_resident_memory_bytes``).
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter

import httpx

#: attempts per request while the server answers 503 (its queue is full)
RETRIES_503 = 120
WORDS = ("alpha beta gamma delta epsilon zeta theta lambda function return class import value "
         "list dict string number loop memory cache thread server client token model").split()


def make_specs(n: int, rng: random.Random, disconnect: float) -> list[dict]:
    specs = []
    for i in range(n):
        words = rng.choice((4, 16, 48, 120))
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        stream = rng.random() < 0.7
        specs.append({
            "i": i, "chat": rng.random() < 0.5, "stream": stream,
            "prompt": f"Request {i}: summarise: {text}",
            "max_tokens": rng.choice((4, 8, 24, 48)),
            "drop_after": rng.randint(1, 4) if stream and rng.random() < disconnect else None,
        })
    return specs


async def run_one(http: httpx.AsyncClient, url: str, model: str, spec: dict,
                  headers: dict) -> str:
    """One request; returns its outcome: ok, dropped, 503, 5xx, 4xx or incomplete."""
    if spec["chat"]:
        path, body = "/v1/chat/completions", {
            "messages": [{"role": "user", "content": spec["prompt"]}]}
    else:
        path, body = "/v1/completions", {"prompt": spec["prompt"]}
    body |= {"model": model, "max_tokens": spec["max_tokens"], "temperature": 0.7,
             "seed": spec["i"], "stream": spec["stream"]}
    if spec["stream"]:
        body["stream_options"] = {"include_usage": True}
        async with http.stream("POST", url + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return classify(r.status_code)
            chunks, finish, usage, done = 0, None, None, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                record = json.loads(line[6:])
                if "error" in record:
                    return "5xx"
                usage = record.get("usage") or usage
                for c in record.get("choices") or []:
                    chunks += 1
                    finish = c.get("finish_reason") or finish
                if spec["drop_after"] is not None and chunks >= spec["drop_after"]:
                    return "dropped"  # leaving the block closes the connection mid-stream
            return "ok" if complete(done, finish, usage, spec) else "incomplete"
    r = await http.post(url + path, json=body, headers=headers)
    if r.status_code != 200:
        return classify(r.status_code)
    record = r.json()
    choice = record["choices"][0]
    return "ok" if complete(True, choice.get("finish_reason"), record.get("usage"),
                            spec) else "incomplete"


def classify(status: int) -> str:
    if status == 503:
        return "503"
    return "5xx" if status >= 500 else f"{status}"


def complete(done: bool, finish: str | None, usage: dict | None, spec: dict) -> bool:
    """A finished response: [DONE] seen, a finish reason, usage agreeing with it."""
    if not done or finish not in ("stop", "length") or not usage:
        return False
    n = usage["completion_tokens"]
    return 0 < n <= spec["max_tokens"] and (finish != "length" or n == spec["max_tokens"])


async def drive(url: str, model: str, specs: list[dict], clients: int,
                headers: dict) -> Counter:
    queue: asyncio.Queue = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    outcomes: Counter = Counter()

    async def client() -> None:
        async with httpx.AsyncClient(timeout=600) as http:
            while not queue.empty():
                spec = queue.get_nowait()
                for _ in range(RETRIES_503):  # a 503 (queue full) is retried, as clients do
                    try:
                        outcome = await run_one(http, url, model, spec, headers)
                    except httpx.HTTPError as exc:
                        outcome = f"transport:{type(exc).__name__}"
                    outcomes[outcome] += 1
                    if outcome != "503":
                        break
                    await asyncio.sleep(0.5)

    await asyncio.gather(*[client() for _ in range(clients)])
    return outcomes


def read_metrics(url: str, headers: dict) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_idle(url: str, headers: dict, timeout: float = 120) -> dict[str, float]:
    """Metrics once nothing runs or waits (and the engine has had a moment to go idle)."""
    end = time.time() + timeout
    while time.time() < end:
        m = read_metrics(url, headers)
        if m["edgellm_slots_active"] == 0 and m["edgellm_queue_depth"] == 0:
            time.sleep(1.0)
            return read_metrics(url, headers)
        time.sleep(0.2)
    return read_metrics(url, headers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--disconnect", type=float, default=0.1, help="share of streams dropped")
    p.add_argument("--warmup", type=int, default=32, help="requests in the warm-up round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    args = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    warm = asyncio.run(drive(args.url, args.model, make_specs(args.warmup, rng, args.disconnect),
                             args.clients, headers))
    before = wait_idle(args.url, headers)
    specs = make_specs(args.requests, rng, args.disconnect)
    start = time.time()
    outcomes = asyncio.run(drive(args.url, args.model, specs, args.clients, headers))
    seconds = time.time() - start
    after = wait_idle(args.url, headers)
    rss0, rss1 = before["process_resident_memory_bytes"], after["process_resident_memory_bytes"]
    print(f"warm-up: {dict(warm)}")
    print(f"{args.requests} requests, {args.clients} clients, {seconds:.0f} s: {dict(outcomes)}")
    print(f"dropped by the client: {sum(s['drop_after'] is not None for s in specs)} planned")
    print(f"slots free at the end: {after['edgellm_slots_free']:.0f} of "
          f"{after['edgellm_slots']:.0f}; active {after['edgellm_slots_active']:.0f}; queue "
          f"{after['edgellm_queue_depth']:.0f}; cancel steps max "
          f"{after['edgellm_cancel_steps_max']:.0f}")
    print(f"RSS after warm-up {rss0 / 2**20:.1f} MiB, at the end {rss1 / 2**20:.1f} MiB "
          f"({(rss1 - rss0) / 2**20:+.1f} MiB)")
    failures = []
    if outcomes.get("5xx"):
        failures.append(f"{outcomes['5xx']} responses with 5xx")
    bad = {k: v for k, v in outcomes.items() if k not in ("ok", "dropped", "503")}
    if bad:
        failures.append(f"unexpected outcomes {bad}")
    if after["edgellm_slots_free"] != after["edgellm_slots"] or after["edgellm_queue_depth"]:
        failures.append("slots still busy at the end")
    if abs(rss1 - rss0) > 5 * 2**20:
        failures.append("RSS moved by more than 5 MB")
    for f in failures:
        print(f"FAIL: {f}")
    print("PASS" if not failures else "FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
