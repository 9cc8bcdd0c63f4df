"""SamplingParams and the sampler: each knob does what it says, on plain logits."""

from __future__ import annotations

import numpy as np
import pytest

from edgellm.generate import StopMatcher
from edgellm.sampling import SamplingParams, apply_penalties, make_sampler, probabilities

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.06, 0.04], dtype=np.float32))


def test_greedy_is_argmax_and_deterministic():
    sample = make_sampler(SamplingParams(temperature=0))
    assert {sample(LOGITS) for _ in range(20)} == {0}


def test_top_k_keeps_k_tokens():
    p = probabilities(LOGITS, SamplingParams(temperature=1, top_k=2, top_p=1, min_p=0))
    assert np.count_nonzero(p) == 2 and p[:2].sum() == pytest.approx(1)
    assert p[0] / p[1] == pytest.approx(2.0, rel=1e-5)


def test_top_p_keeps_the_token_that_crosses_p():
    p = probabilities(LOGITS, SamplingParams(temperature=1, top_k=0, top_p=0.8, min_p=0))
    assert np.flatnonzero(p).tolist() == [0, 1, 2]  # 0.5 + 0.25 < 0.8 <= 0.9


def test_min_p_is_relative_to_the_top_token():
    p = probabilities(LOGITS, SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0.25))
    assert np.flatnonzero(p).tolist() == [0, 1, 2]  # >= 0.25 * 0.5, 0.06 is not


def test_temperature_sharpens_and_flattens():
    cold = probabilities(LOGITS, SamplingParams(temperature=0.5, top_k=0, top_p=1, min_p=0))
    hot = probabilities(LOGITS, SamplingParams(temperature=2.0, top_k=0, top_p=1, min_p=0))
    assert cold[0] > 0.5 > hot[0]


def test_seed_reproduces_draws_and_follows_distribution():
    params = SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, seed=7)
    a = [make_sampler(params)(LOGITS) for _ in range(1)]
    sample = make_sampler(params)
    draws = np.array([sample(LOGITS) for _ in range(4000)])
    again = make_sampler(params)
    assert a[0] == draws[0] == again(LOGITS)
    freq = np.bincount(draws, minlength=5) / len(draws)
    np.testing.assert_allclose(freq, np.exp(LOGITS), atol=0.03)


def test_repetition_penalty_like_llama_cpp():
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    out = apply_penalties(logits, [0, 1], SamplingParams(repetition_penalty=2.0))
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0])  # divide positive, multiply negative


def test_presence_and_frequency_penalties():
    logits = np.zeros(3, dtype=np.float32)
    out = apply_penalties(logits, [1, 1, 2], SamplingParams(presence_penalty=0.5,
                                                            frequency_penalty=0.25))
    np.testing.assert_allclose(out, [0.0, -1.0, -0.75])


def test_invalid_params_are_refused():
    for bad in (dict(temperature=-1), dict(top_p=0), dict(min_p=1.5), dict(max_tokens=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_stop_matcher_holds_back_partial_stops():
    m = StopMatcher(["\n\nUser:"])
    assert m.feed("Hello\n") == ("Hello", False)
    assert m.feed("\nUs") == ("", False)
    assert m.feed("er: hi") == ("", True)
    m = StopMatcher(["END"])
    assert m.feed("the EN") == ("the ", False)
    assert m.feed("gine") == ("ENgine", False)


def full_sort_probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution with top-p over the whole vocabulary sorted (the plain definition)."""
    logits = np.asarray(logits, dtype=np.float64)
    keep = np.ones(logits.shape, dtype=bool)
    if 0 < params.top_k < logits.shape[-1]:
        keep &= logits >= np.partition(logits, -params.top_k)[-params.top_k]
    masked = np.where(keep, logits, -np.inf)
    probs = np.exp(masked - masked.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cut = int(np.searchsorted(np.cumsum(probs[order]), params.top_p)) + 1
        keep[order[cut:]] = False
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    scaled = np.where(keep, logits / params.temperature, -np.inf)
    probs = np.exp(scaled - scaled.max())
    return probs / probs.sum()


def test_top_p_over_the_live_tokens_equals_sorting_the_whole_vocabulary():
    """probabilities() sorts only the tokens top-k left in play: bit-identical to sorting all
    (ties, tiny and huge logits, top_p at both ends)."""
    rng = np.random.default_rng(0)
    for trial in range(600):
        logits = rng.normal(size=int(rng.choice([5, 50, 1000]))) * rng.choice([0.1, 1, 10, 100])
        if trial % 3 == 0:
            logits = np.round(logits)  # ties
        params = SamplingParams(temperature=float(rng.choice([0.3, 1.0, 1.5])),
                                top_k=int(rng.choice([0, 1, 3, 40])),
                                top_p=float(rng.choice([0.01, 0.5, 0.95, 0.999999, 1.0])),
                                min_p=float(rng.choice([0.0, 0.05])))
        assert np.array_equal(probabilities(logits, params),
                              full_sort_probabilities(logits, params))


@pytest.mark.parametrize("vocab", [151936, 262144, 10000])
def test_probabilities_over_a_real_vocabulary_equal_the_plain_definition(vocab):
    """At real vocabulary sizes top-k finds its k-th logit in the blocks whose maxima can
    hold it and the chain works on the tokens in play: bit-identical to the plain
    definition (ties at the k-th logit, peaked and flat logits, every knob)."""
    rng = np.random.default_rng(vocab)
    for trial in range(24):
        logits = (rng.normal(size=vocab) * rng.choice([0.5, 3, 30])).astype(np.float32)
        if trial % 4 == 0:
            logits = np.round(logits)  # many ties at the k-th
        if trial % 4 == 1:
            logits[rng.integers(vocab, size=60)] = logits.max()  # 60 equal maxima
        params = SamplingParams(temperature=float(rng.choice([0.3, 0.8, 1.5])),
                                top_k=int(rng.choice([1, 40, 100, 0])),
                                top_p=float(rng.choice([0.5, 0.95, 1.0])),
                                min_p=float(rng.choice([0.0, 0.05])))
        assert np.array_equal(probabilities(logits, params),
                              full_sort_probabilities(logits, params))


def test_draws_equal_draws_over_the_whole_vocabulary():
    """The sampler draws over the tokens in play: the same tokens, seed for seed, as a draw
    over the whole vocabulary's distribution (zeros elsewhere) with the same generator."""
    rng = np.random.default_rng(3)
    for seed in range(40):
        logits = (rng.normal(size=151936) * 2).astype(np.float32)
        params = SamplingParams(temperature=float(rng.choice([0.5, 0.8, 2.0])),
                                top_k=int(rng.choice([40, 0])), top_p=0.95, min_p=0.0,
                                seed=seed)
        sample, plain = make_sampler(params), np.random.default_rng(seed)
        p = full_sort_probabilities(logits, params)
        for _ in range(5):
            assert sample(logits) == int(plain.choice(p.size, p=p))
