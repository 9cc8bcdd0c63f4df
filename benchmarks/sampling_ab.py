"""Decode with the default sampling chain (what ``edgellm chat`` runs) against greedy decode,
in turns in one process: tokens/s of ``generate_step`` after the prompt, medians of the
rounds. The runs:

- ``greedy``: the argmax alone (what ``edgellm bench`` measures);
- ``default``: the chain as ``generate_step`` runs it (a device backend with graphs draws
  it on the device: ``Model.sampled_tokens``);
- ``default, host``: the chain sampled on the host (``sampled_tokens`` off);
- ``penalised`` and ``penalised, host``: the default chain with repetition, frequency and
  presence penalties and a logit bias (on the device: ``graphs._processed`` first);
- ``default, host at REV`` (``--against REV``): another git revision's host sampler.

The host samplers must draw the same tokens for the same seed (asserted); whether the
device's draws equal them (the default chain's, the penalised one's) is printed (they may
part only where a uniform falls within a few ulps of a running sum).

    python benchmarks/sampling_ab.py MODEL.gguf [--against REV] [--tokens 64] [--rounds 3]
        [--backend cpu]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import edgellm
from edgellm.sampling import SamplingParams

generate = importlib.import_module("edgellm.generate")  # (edgellm.generate is a function)
PROMPT = "Write a Python function that parses a CSV file."


def sampling_module_at(rev: str):
    """edgellm/sampling.py as it was at git revision ``rev``, imported on its own."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:edgellm/sampling.py"], cwd=root,
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampling_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampling_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def decode_speed(model, params: SamplingParams, make_sampler, on_device: bool,
                 tokens: int):
    """(tokens/s after the first token, the tokens) of one generate_step run."""
    generate.make_sampler = make_sampler
    net = model.net
    if not on_device:
        # (an instance attribute over the method)
        net.sampled_tokens = lambda *args, **kwargs: None
    prompt = model.tokenizer.encode(PROMPT)
    steps = generate.generate_step(prompt, net, model.make_cache(1024), params)
    try:
        next(steps)  # the prompt and the first token
        start = time.perf_counter()
        drawn = [next(steps)[0] for _ in range(tokens)]
        return tokens / (time.perf_counter() - start), drawn
    finally:
        steps.close()
        vars(net).pop("sampled_tokens", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--against", help="git revision of another host sampler to time")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    model = edgellm.load(args.model, backend=args.backend)
    ours, chain = generate.make_sampler, SamplingParams(seed=5)
    bias = {model.tokenizer.encode(" the")[-1]: -5.0}
    penalised = SamplingParams(seed=5, repetition_penalty=1.1, frequency_penalty=0.2,
                               presence_penalty=0.1, logit_bias=bias)
    runs = {"greedy": (SamplingParams(temperature=0), ours, True),
            "default": (chain, ours, True),
            "default, host": (chain, ours, False),
            "penalised": (penalised, ours, True),
            "penalised, host": (penalised, ours, False)}
    if args.against:
        theirs = sampling_module_at(args.against).make_sampler
        # (a revision's make_sampler may take params alone: seeded alike, the same draws)
        runs[f"default, host at {args.against}"] = (
            chain, lambda params, rng=None: theirs(params), False)
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    drawn: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, (params, make, on_device) in runs.items():
            speed, tokens = decode_speed(model, params, make, on_device, args.tokens)
            speeds[name].append(speed)
            drawn.setdefault(name, tokens)
    host = [drawn[name] for name in runs if name.startswith("default, host")]
    assert all(t == host[0] for t in host), "the host samplers drew different tokens"
    for name, values in speeds.items():
        spread = " ".join(f"{v:.1f}" for v in values)
        print(f"{name}: {statistics.median(values):.1f} t/s ({spread})")
    print(f"device draws equal the host's: {drawn['default'] == host[0]}")
    print(f"penalised device draws equal the host's: "
          f"{drawn['penalised'] == drawn['penalised, host']}")


if __name__ == "__main__":
    main()
