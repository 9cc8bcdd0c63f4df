"""Checks of a loaded model against llama.cpp's reference outputs (tests/reference/*.json).

Shared by the model tests of every backend: teacher-forced top-1 agreement and free-running
greedy continuations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REFERENCE_FILES = {
    "qwen2.5-coder-0.5b-instruct": "qwen05",
    "qwen2.5-coder-1.5b-instruct": "qwen15",
    "gemma-3-270m": "gemma3",
}
REFERENCE_DIR = Path(__file__).parent / "reference"

#: Teacher-forced top-1 agreement with llama.cpp every model and backend must reach.
MIN_TOP1_AGREEMENT = 0.97


def load_reference(model_name: str, kind: str = "greedy") -> dict:
    return json.loads((REFERENCE_DIR / f"{REFERENCE_FILES[model_name]}.{kind}.json").read_text())


@dataclass
class Agreement:
    positions: int
    matches: int
    misses: list[tuple[int, int, float]]  # (entry, position, reference margin)

    @property
    def rate(self) -> float:
        return self.matches / self.positions

    @property
    def max_missed_margin(self) -> float:
        return max((m for _, _, m in self.misses), default=0.0)


def reference_top1(entry: dict) -> tuple[list[int], list[float]]:
    """Top-1 id and margin at every prompt position (from the top-20 lists) and generated step.

    Position i predicts token i+1: prompt positions 0..P-2 predict prompt tokens, P-1 and on
    predict the greedy tokens.
    """
    top1, margin = [], []
    for cands in entry["prompt_top20"][:-1] if "prompt_top20" in entry else []:
        top1.append(int(cands[0][0]))
        margin.append(float(cands[0][1] - cands[1][1]))
    for tok, m in zip(entry["greedy_ids"], entry["top1_margin"], strict=True):
        top1.append(int(tok))
        margin.append(float(m))
    return top1, margin


def teacher_forced_agreement(model, reference: dict) -> Agreement:
    """Feed prompt + greedy ids in one pass; compare argmax with the reference's top-1."""
    positions = matches = 0
    misses = []
    for e_idx, entry in enumerate(reference["generate"]):
        ids = entry["prompt_ids"] + entry["greedy_ids"]
        cache = model.make_cache(len(ids) + 8)
        logits = model.net.forward(np.asarray(ids), cache, all_logits=True)
        ours = logits.argmax(-1)
        top1, margin = reference_top1(entry)
        n_prompt = len(entry["prompt_ids"])
        first = n_prompt - 1 - (len(top1) - len(entry["greedy_ids"]))
        for j, (want, m) in enumerate(zip(top1, margin, strict=True)):
            got = int(ours[first + j])
            positions += 1
            if got == want:
                matches += 1
            else:
                misses.append((e_idx, first + j, m))
    return Agreement(positions, matches, misses)


def greedy_continuations_matching(model, reference: dict, n_tokens: int = 32) -> int:
    """How many free-running greedy continuations equal the reference's in full."""
    from edgellm.generate import generate_step
    from edgellm.sampling import SamplingParams

    full = 0
    params = SamplingParams(temperature=0)
    for entry in reference["generate"]:
        cache = model.make_cache(len(entry["prompt_ids"]) + n_tokens + 8)
        steps = generate_step(entry["prompt_ids"], model.net, cache, params)
        out = [next(steps)[0] for _ in range(n_tokens)]
        full += out == entry["greedy_ids"][:n_tokens]
    return full
