"""Decode on the torch backend (CUDA graphs) three ways, interleaved in one process:

- ``host``: ``forward`` then the argmax on the host (the logits copied back every step:
  the loop ``edgellm bench`` ran before ``Model.greedy_tokens``);
- ``device``: ``Model.greedy_tokens`` (the argmax on the device, each step queued before
  the token of the one before is read back);
- ``replay``: the decode graph replayed back to back, timed with CUDA events (the GPU's
  own time per step: what neither loop can beat).

    python benchmarks/torch_decode_ab.py MODEL.gguf [--steps 128] [--rounds 3] [--ctx N]
        [--pdl 0,1,2]

Run it under EDGELLM_FUSE_LAUNCHES=0 and =1 (alternating processes) to see the launch
fusions' share, EDGELLM_UNFUSE=glu (etc.: backend.FUSIONS) for one fusion's, or
EDGELLM_TUNE=0 and =1 for the tuned tiles' (backends/torch/tuning.py), or
EDGELLM_MATVEC_PIPELINE=0 and =1 for the mat-vecs' loads a step ahead. ``--turns VAR=a,b``:
an environment variable's values taking turns within every round in this one process, each
value with graphs of its own (a graph keeps the launches it captured), for the variables
kernels read at their launches (what they keep of them is cleared at each turn):
``--turns EDGELLM_MATVEC_PIPELINE=0,1`` (the mat-vecs' loops, ``kernels.matvec_pipeline``);
``--pdl 0,1,2`` is ``--turns EDGELLM_PDL=0,1,2`` (programmatic dependent launches,
``kernels._pdl``). ``--ctx N``: a cache of N slots (default: the steps + 16, as
``edgellm bench``): a graph attends over its cache's whole storage, so this is decode's cost
in a chat's cache (4096 by default) against the bench's. Needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

import edgellm
from edgellm.bench import time_generation


def _host(net, make_cache, steps: int, token: int) -> float:
    """Seconds for ``steps`` greedy tokens with the logits copied back and the argmax taken
    on the host (time_generation's signature)."""
    cache = make_cache()
    start = time.perf_counter()
    for _ in range(steps):
        token = int(net.forward(np.array([token]), cache)[0].argmax())
    return time.perf_counter() - start


def _synced(run):
    """``run`` timed until the GPU has finished."""
    def timed(*args) -> float:
        start = time.perf_counter()
        run(*args)
        torch.cuda.synchronize()
        return time.perf_counter() - start
    return timed


def _turns(model, var: str, values: list[str]):
    """A function that switches ``model`` to one of ``values`` of environment variable
    ``var``: kernels launch as that value asks and steps replay that value's own graphs."""
    backend = model.backend
    stores = {value: type(backend.graphs)(backend) for value in values}

    def use(value: str) -> None:
        backend.kernels._pdl_devices.clear()  # (_pdl reads EDGELLM_PDL again, and
        backend.kernels._env_flags.clear()  # the mat-vecs theirs)
        os.environ[var] = value
        backend.graphs = stores[value]
    return use


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=0, help="cache slots (default steps + 16)")
    ap.add_argument("--turns", default="", metavar="VAR=a,b",
                    help="values of an environment variable to take turns, e.g. "
                    "EDGELLM_MATVEC_PIPELINE=0,1 (default: the environment's, alone)")
    ap.add_argument("--pdl", default="", help="PDL modes to take turns: --turns "
                    "EDGELLM_PDL=MODES")
    args = ap.parse_args()
    turns = f"EDGELLM_PDL={args.pdl}" if args.pdl else args.turns
    var, _, values = turns.partition("=")
    modes = values.split(",") if values else [None]

    model = edgellm.load(args.model, backend="torch")
    net = model.net
    runs = {"host": _synced(_host), "device": _synced(time_generation)}

    slots = max(args.ctx, args.steps + 16)

    def make_cache():
        return model.make_cache(slots)

    use = _turns(model, var, modes) if modes != [None] else lambda mode: None
    for mode in modes:  # warm-up: captures, compiles
        use(mode)
        for run in runs.values():
            run(net, make_cache, 8, 100)
    rates = {mode: {name: [] for name in (*runs, "replay")} for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            use(mode)
            for name, run in runs.items():
                rates[mode][name].append(args.steps / run(net, make_cache, args.steps, 100))
            rates[mode]["replay"].append(_replay_rate(model, net, args.steps))
    fuse = os.environ.get("EDGELLM_FUSE_LAUNCHES", "1")
    tune = os.environ.get("EDGELLM_TUNE", "1")
    unfused = ",".join(sorted(model.backend.unfused)) or "-"
    kernels = model.backend.kernels
    for mode in modes:
        use(mode)
        pdl = kernels._pdl(torch.device("cuda", torch.cuda.current_device()))
        print(f"{os.path.basename(args.model)} fuse_launches={fuse} tune={tune} "
              f"unfused={unfused} pipeline={int(kernels.matvec_pipeline(1))} pdl={pdl} "
              f"ctx={slots}: " + ", ".join(
            f"{name} {statistics.median(r):.1f} t/s ({' '.join(f'{v:.0f}' for v in r)})"
            for name, r in rates[mode].items()))


def _replay_rate(model, net, steps: int) -> float:
    """Steps a second of the decode graph replayed back to back (CUDA events' time)."""
    replay = model.backend.graphs.decode_graph(net)
    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    begin.record()
    for _ in range(steps):
        replay.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * steps / begin.elapsed_time(end)


if __name__ == "__main__":
    main()
