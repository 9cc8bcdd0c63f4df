"""One request at a time through the engine (what ``edgellm serve``, the C ABI and
``Model.complete`` run), with the backend's graphs and without them, in turns in one
process: decode tokens/s after the first token, medians of the rounds. ``--streams N``:
N requests at once instead (an engine of N slots, 4 at least), their tokens/s in all
(from the first token of any to the last of all, first tokens left out), with graphs also
as each sequence's own graph in turn ("one a sequence") beside one graph of the set (the
default; past 8 sequences, the graphs of their sets), and after the timed
rounds the same N prompts through each way, their tokens compared with the eager path's
(greedy on the GPU path's per-token arithmetic: they should be the same tokens).

    python benchmarks/engine_one_stream.py MODEL.gguf [--backend torch] [--tokens 128]
        [--rounds 3] [--temperature 0] [--streams 1] [--churn K]

``--churn K``: K x N requests kept N at a time, each that ends replaced by the next, of
spread lengths (tokens/s in all, prompts included, and the CUDA graph captures the runs
made: a set of sequences decoding together with no batch graph takes over an idle one of
its size, or a new one is captured).

Where the backend has no graphs (the CPU backend) both runs are the same path. Each request
has its own prompt (no prefix reuse between runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import edgellm
from edgellm.api import DEFAULT_ENGINE_SEQS
from edgellm.sampling import SamplingParams


def one_stream(model, prompt: str, params: SamplingParams) -> float:
    """Decode tokens/s of one completion through the engine, after its first token."""
    times: list[float] = []
    reply = model.complete(prompt, params, on_token=lambda event: times.append(
        time.perf_counter()))
    assert reply.error is None, reply.error
    return (len(times) - 1) / (times[-1] - times[0])


def many_streams(model, prompts: list[str], params: SamplingParams) -> float:
    """Decode tokens/s in all of len(prompts) completions submitted at once."""
    from edgellm.engine import Request

    times: list[list[float]] = [[] for _ in prompts]  # each event's time, on the engine's thread
    handles = [model.engine.submit(Request(model.encode(p), params),
                                   on_event=lambda e, t=t: t.append(time.perf_counter()))
               for p, t in zip(prompts, times, strict=True)]
    for h in handles:
        assert h.wait(600), "a request did not finish"
    start = min(t[0] for t in times)
    return sum(len(t) - 1 for t in times) / (max(t[-1] for t in times) - start)


def streams_tokens(model, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    """The tokens of len(prompts) completions submitted at once."""
    from edgellm.engine import Request

    handles = [model.engine.submit(Request(model.encode(p), params)) for p in prompts]
    return [h.result(600).tokens for h in handles]


def churned_streams(model, prompts: list[str], params: SamplingParams, streams: int) -> float:
    """Tokens/s in all of len(prompts) completions kept ``streams`` at a time, each one
    that ends replaced by the next (their lengths spread over half to all of
    params.max_tokens), so the set decoding together changes as a busy server's does; from
    the first request's submission to the last token, prompts included."""
    from dataclasses import replace

    from edgellm.engine import Request

    lengths = [params.max_tokens // 2 + (i * 7 % 8) * params.max_tokens // 16
               for i in range(len(prompts))]
    start, handles, made = time.perf_counter(), [], 0
    for prompt, length in zip(prompts, lengths, strict=True):
        while sum(not h.done for h in handles) >= streams:
            time.sleep(0.0005)
        handles.append(model.engine.submit(Request(model.encode(prompt),
                                                   replace(params, max_tokens=length))))
    for h in handles:
        made += len(h.result(600).tokens)
    return made / (time.perf_counter() - start)


def captures(model) -> tuple[int, float]:
    """(CUDA graph captures so far, their seconds) of the model's backend; (0, 0) without."""
    graphs = getattr(model.backend, "graphs", None)
    return (graphs.captures, graphs.capture_seconds) if graphs is not None else (0, 0.0)


def set_batch_graphs(on: bool) -> None:
    """Several sequences' decode steps as one graph of their set (on: the default), or
    each sequence's own graph replayed in turn (``EDGELLM_BATCH_GRAPHS=0``)."""
    try:
        from edgellm.backends.torch import graphs as graphs_module
    except ImportError:  # (no torch: no graphs)
        return
    graphs_module.BATCH_GRAPHS = on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--churn", type=int, default=0, metavar="K",
                    help="with --streams N: K*N requests kept N at a time, of spread lengths "
                         "(tokens/s in all, prompts included; CUDA graph captures counted)")
    args = ap.parse_args()
    model = edgellm.load(args.model, backend=args.backend)
    if args.streams > 1:  # a slot a stream (the API's engine has DEFAULT_ENGINE_SEQS)
        model.start_engine(max_seqs=max(args.streams, DEFAULT_ENGINE_SEQS))
    graphs = getattr(model.backend, "graphs", None)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens,
                            ignore_eos=True, seed=1)
    speeds: dict[str, list[float]] = {"graphs": [], "eager": []}
    if args.streams > 1 and graphs is not None:  # their decode steps as one graph, or not
        speeds["graphs, one a sequence"] = []
    one_stream(model, "warm-up: a haiku about caches", params)  # (captures, tuning)
    churned: dict[str, list[str]] = {}  # each churned run's captures
    for r in range(args.rounds):
        for name in speeds:
            model.backend.graphs = None if name == "eager" else graphs
            set_batch_graphs(name != "graphs, one a sequence")
            churn = args.churn if args.streams > 1 else 0
            prompts = [f"[{r} {name} {i}] Write a Python function that parses a CSV file."
                       for i in range(max(churn, 1) * args.streams)]
            if churn:
                before = captures(model)
                speeds[name].append(churned_streams(model, prompts, params, args.streams))
                made = [a - b for a, b in zip(captures(model), before, strict=True)]
                churned.setdefault(name, []).append(f"{made[0]} captures, {made[1]:.2f} s")
            else:
                speeds[name].append(one_stream(model, prompts[0], params) if args.streams == 1
                                    else many_streams(model, prompts, params))
    same = {}
    if args.streams > 1:  # the same prompts each way: are they the same tokens?
        prompts = [f"[check {i}] Write a Python function that parses a CSV file."
                   for i in range(args.streams)]
        tokens = {}
        for name in speeds:
            model.backend.graphs = None if name == "eager" else graphs
            set_batch_graphs(name != "graphs, one a sequence")
            tokens[name] = streams_tokens(model, prompts, params)
        for name in speeds:
            same[name] = sum(a == b for a, b in zip(tokens[name], tokens["eager"], strict=True))
    model.backend.graphs = graphs
    set_batch_graphs(True)
    for name, values in speeds.items():
        spread = " ".join(f"{v:.1f}" for v in values)
        streams = "one stream" if args.streams == 1 else f"{args.streams} streams"
        check = f", {same[name]}/{args.streams} as eager's tokens" if name in same else ""
        if name in churned:
            streams += f" churned x{args.churn}"
            check += f"; {'; '.join(churned[name])}"
        print(f"engine, {streams}, {name}: {statistics.median(values):.1f} t/s ({spread}){check}")
    model.close()


if __name__ == "__main__":
    main()
