"""Load bench for an OpenAI-compatible server: 1, 2, 4, 8 concurrent streams.

    python benchmarks/serve_load.py --url http://127.0.0.1:8080 --model qwen2.5-coder-0.5b-instruct
    python benchmarks/serve_load.py --spawn "edgellm serve -m qwen2.5-coder-0.5b-instruct -t 2 \
        --port 8090" --url http://127.0.0.1:8090 --model qwen2.5-coder-0.5b-instruct
    python benchmarks/serve_load.py --spawn "/work/llama/build/bin/llama-server -m FILE.gguf \
        -t 2 -np 8 -c 8192 --port 8091" --url http://127.0.0.1:8091 --label llama-server

Each level starts C streaming ``/v1/completions`` requests at once (distinct prompts of about
the same length, temperature 0 unless ``--temperature`` (then the server's other sampling
defaults), ``ignore_eos``, ``max_tokens`` tokens each) and reports:
aggregate decode tokens/s (every stream's tokens after its first, over the span from the
earliest first token to the latest last one), its ratio to one stream, time to first token
and inter-token latency (p50/p95 over all streams); ``--rounds R`` interleaves R runs of the
levels and reports medians. The same requests drive edgellm's server
and llama.cpp's ``llama-server`` (which takes ``ignore_eos`` too). ``--spawn`` starts the
server first (waiting for /health) and stops it at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import time

import httpx

TEXT = ("Write a detailed explanation of how a hash map works, covering hashing, buckets, "
        "collisions, resizing and the cost of each operation, with an example in Python. ")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def one_stream(http: httpx.AsyncClient, url: str, model: str, prompt: str,
                     max_tokens: int, headers: dict, temperature: float = 0.0) -> dict:
    """One streaming completion: send time, each content chunk's arrival, token count."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals: list[float] = []
    usage = None
    async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            record = json.loads(line[6:])
            if record.get("usage"):
                usage = record["usage"]
            choices = record.get("choices") or []
            if choices and choices[0].get("text"):
                arrivals.append(time.perf_counter())
    tokens = usage["completion_tokens"] if usage else len(arrivals)
    return {"start": start, "arrivals": arrivals, "tokens": tokens}


async def level(url: str, model: str, streams: int, max_tokens: int, headers: dict,
                tag: str = "", temperature: float = 0.0) -> dict:
    """C streams at once; the level's aggregate tokens/s and latencies. Prompts are
    "[C.i] ..." (with ``tag`` before the C): a server that reuses cached prefixes finds the
    same level's prompts again in a later round, as any client's repeated request would."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:
        runs = await asyncio.gather(*[
            one_stream(http, url, model, f"[{tag}{streams}.{i}] {TEXT}", max_tokens, headers,
                       temperature)
            for i in range(streams)])
    firsts = [r["arrivals"][0] for r in runs if r["arrivals"]]
    lasts = [r["arrivals"][-1] for r in runs if r["arrivals"]]
    decode_tokens = sum(max(0, r["tokens"] - 1) for r in runs)
    span = max(lasts) - min(firsts)
    itl = [b - a for r in runs for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    ttft = [r["arrivals"][0] - r["start"] for r in runs if r["arrivals"]]
    return {"streams": streams, "tokens": sum(r["tokens"] for r in runs),
            "decode_tps": decode_tokens / span if span > 0 else float("nan"),
            "ttft_p50": percentile(ttft, 50), "ttft_p95": percentile(ttft, 95),
            "itl_p50": percentile(itl, 50), "itl_p95": percentile(itl, 95)}


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 300) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the spawned server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s")


def table(label: str, rows: list[dict]) -> str:
    """One row per level; with several rounds, each level's median (the runs in brackets)."""
    levels: dict[int, list[dict]] = {}
    for r in rows:
        levels.setdefault(r["streams"], []).append(r)

    def median(runs: list[dict], key: str) -> float:
        return percentile([r[key] for r in runs], 50)

    base = median(levels[1], "decode_tps") if 1 in levels else None
    out = [f"### {label}", "", "| streams | decode tok/s (aggregate) | x one stream | TTFT p50 ms "
           "| TTFT p95 ms | ITL p50 ms | ITL p95 ms |", "|---|---|---|---|---|---|---|"]
    for streams, runs in levels.items():
        tps = median(runs, "decode_tps")
        each = (" (" + " / ".join(f"{r['decode_tps']:.1f}" for r in runs) + ")"
                if len(runs) > 1 else "")
        ratio = f"{tps / base:.2f}" if base else ""
        out.append(f"| {streams} | {tps:.1f}{each} | {ratio} | "
                   f"{median(runs, 'ttft_p50') * 1e3:.0f} | {median(runs, 'ttft_p95') * 1e3:.0f} | "
                   f"{median(runs, 'itl_p50') * 1e3:.0f} | {median(runs, 'itl_p95') * 1e3:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                   help="the model id the server expects (llama-server takes any)")
    p.add_argument("--streams", default="1,2,4,8", help="concurrency levels")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the levels this many times, interleaved, and report each "
                        "level's median (a VM's speed drifts over minutes: a level measured "
                        "once, minutes after one stream, moves its ratio with the drift)")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens per stream")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default=None, help="table title (default: the URL)")
    p.add_argument("--spawn", default=None, metavar="CMD",
                   help="start this server command first, stop it at the end")
    p.add_argument("--warmup", type=int, default=8, help="tokens of one warm-up request")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc = None
    if args.spawn:
        proc = subprocess.Popen(shlex.split(args.spawn), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        wait_ready(args.url, proc)
        if args.warmup:
            # its own prompt: the first one-stream level must not find its prompt cached
            asyncio.run(level(args.url, args.model, 1, args.warmup, headers, tag="warm-up "))
        rows = []
        levels = [int(x) for x in args.streams.split(",")]
        for c in levels * args.rounds:
            rows.append(asyncio.run(level(args.url, args.model, c, args.max_tokens, headers,
                                          temperature=args.temperature)))
            print(f"streams={c}: {rows[-1]['decode_tps']:.1f} tok/s", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(table(args.label or args.url, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label or args.url, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
