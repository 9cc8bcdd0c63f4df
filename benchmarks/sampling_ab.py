"""Decode with the default sampling chain (what ``edgellm chat`` runs) against greedy decode,
with this tree's sampler and with the sampler of another git revision, in turns in one
process: tokens/s of ``generate_step`` after the prompt, medians of the rounds. The two
samplers must draw the same tokens for the same seed (asserted: a speed change only).

    python benchmarks/sampling_ab.py MODEL.gguf --against REV [--tokens 64] [--rounds 3]
        [--backend cpu]

``edgellm bench`` decodes greedily (the argmax alone), so this is where the sampler's own
cost shows.
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


def decode_speed(model, params: SamplingParams, make_sampler, tokens: int):
    """(tokens/s after the first token, the tokens) of one generate_step run."""
    generate.make_sampler = make_sampler
    prompt = model.tokenizer.encode(PROMPT)
    steps = generate.generate_step(prompt, model.net, model.make_cache(1024), params)
    try:
        next(steps)  # the prompt and the first token
        start = time.perf_counter()
        drawn = [next(steps)[0] for _ in range(tokens)]
        return tokens / (time.perf_counter() - start), drawn
    finally:
        steps.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--against", required=True, help="git revision of the other sampler")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    other = sampling_module_at(args.against)
    model = edgellm.load(args.model, backend=args.backend)
    runs = {"greedy": (SamplingParams(temperature=0), generate.make_sampler),
            "default, this tree": (SamplingParams(seed=5), generate.make_sampler),
            f"default, {args.against}": (SamplingParams(seed=5), other.make_sampler)}
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    drawn: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for name, (params, make) in runs.items():
            speed, tokens = decode_speed(model, params, make, args.tokens)
            speeds[name].append(speed)
            drawn.setdefault(name, tokens)
    mine, theirs = (drawn[name] for name in list(runs)[1:])
    assert mine == theirs, "the two samplers drew different tokens for the same seed"
    for name, values in speeds.items():
        spread = " ".join(f"{v:.1f}" for v in values)
        print(f"{name}: {statistics.median(values):.1f} t/s ({spread})")


if __name__ == "__main__":
    main()
