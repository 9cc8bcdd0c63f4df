"""Where CUDA prefill and decode time goes: kernels and device time per kernel name, from
torch's profiler over a prompt and over eager (uncaptured) decode steps, then the same steps
replayed as CUDA graphs, timed with events. Needs CUDA.

    python benchmarks/torch_profile.py MODEL.gguf [--steps 16] [--prompt 512]

Eager steps show what a graph holds (kernel count, the device time each kernel type takes);
the graph's time per step against the sum of its kernels' device time is the launch and
dependency overhead that fusing kernels would remove.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import edgellm


def _decode(net, cache, steps: int, token: int = 100) -> None:
    ids = np.array([token])
    for _ in range(steps):
        net.forward(ids, cache)


def _profiled(label: str, run, per: int) -> None:
    """Device time per kernel name over ``run()``, divided by ``per`` (steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    launches = sum(e.count for e in events) / per
    device_us = sum(e.self_device_time_total for e in events) / per
    print(f"{label}: {launches:.0f} kernels/step, {device_us:.0f} us device time/step")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"  {e.self_device_time_total / per:8.1f} us  "
              f"{e.count / per:6.1f}/step  {e.key[:90]}")


def _one_step_trace(run, first: int, count: int) -> None:
    """Kernels first..first+count of one step in launch order, with their device time: a
    layer's sequence (which mat-vec is slow, what runs between them)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                     key=lambda e: e.time_range.start)
    print(f"one step, kernels {first}..{first + count} of {len(kernels)}:")
    for e in kernels[first:first + count]:
        print(f"  {e.time_range.elapsed_us():7.1f} us  {e.name[:70]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512, help="prefill profiled (0: none)")
    args = ap.parse_args()

    os.environ["EDGELLM_CUDA_GRAPHS"] = "0"
    eager = edgellm.load(args.model, backend="torch")
    if args.prompt:
        tokens = np.arange(100, 100 + args.prompt)
        eager.net.forward(tokens, eager.make_cache(args.prompt))  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        eager.net.forward(tokens, eager.make_cache(args.prompt))
        torch.cuda.synchronize()
        print(f"prefill {args.prompt}: {1e3 * (time.perf_counter() - start):.1f} ms wall")
        _profiled(f"prefill {args.prompt}",
                  lambda: eager.net.forward(tokens, eager.make_cache(args.prompt)), 1)
    cache = eager.make_cache(256)
    eager.net.forward(np.arange(100, 132), cache)  # a 32-token prompt
    _decode(eager.net, cache, 4)  # warm-up: triton compiles
    torch.cuda.synchronize()
    _profiled("eager decode", lambda: _decode(eager.net, cache, args.steps), args.steps)
    _one_step_trace(lambda: _decode(eager.net, cache, 1), 0, 60)
    start = time.perf_counter()
    _decode(eager.net, cache, args.steps)
    torch.cuda.synchronize()
    print(f"eager wall: {1e3 * (time.perf_counter() - start) / args.steps:.2f} ms/step")
    eager.close()  # (frees the eager copy before the graphed one loads)

    os.environ["EDGELLM_CUDA_GRAPHS"] = "1"
    graphed = edgellm.load(args.model, backend="torch")
    if args.prompt:  # the prompt as one replayed graph
        tokens = np.arange(100, 100 + args.prompt)
        for _ in range(2):  # capture, then a fresh cache that adopts the graph
            graphed.net.forward(tokens, graphed.make_cache(args.prompt))
        torch.cuda.synchronize()
        start = time.perf_counter()
        graphed.net.forward(tokens, graphed.make_cache(args.prompt))
        torch.cuda.synchronize()
        print(f"prefill {args.prompt} (graph): {1e3 * (time.perf_counter() - start):.1f} ms wall")
    cache = graphed.make_cache(256)
    graphed.net.forward(np.arange(100, 132), cache)
    _decode(graphed.net, cache, 4)  # capture
    torch.cuda.synchronize()
    start = time.perf_counter()
    _decode(graphed.net, cache, args.steps)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    g = graphed.backend.graphs
    replay = g.decode_graph(graphed.net)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(args.steps):
        replay.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"graph: {1e3 * wall:.2f} ms/step wall (forward, logits to host), "
          f"{begin.elapsed_time(end) / args.steps:.3f} ms/step replay alone, "
          f"capture {1e3 * g.capture_seconds / max(g.captures, 1):.0f} ms")


if __name__ == "__main__":
    main()
