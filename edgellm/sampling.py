"""SamplingParams (one frozen dataclass) and the sampler built from it.

The order of operations follows llama.cpp's default chain: penalties on the raw logits, then
top-k, top-p, min-p, temperature, and a draw. Temperature 0 is greedy and deterministic.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Everything that decides the next token and when generation stops."""

    temperature: float = 0.8
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off; applied to the last `penalty_last_n` tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p < 1.0, "min_p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.max_tokens >= 0, "max_tokens must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if isinstance(self.stop, str):  # a single stop string is a common slip
            object.__setattr__(self, "stop", (self.stop,))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes(self) -> bool:
        """Do the repetition, presence or frequency penalties change any logit?"""
        return self.penalty_last_n != 0 and bool(
            self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty)

    @property
    def argmax_only(self) -> bool:
        """Greedy, and nothing changes the logits first (no bias, no penalties): the token
        is their argmax, which a device backend can take without sending them back."""
        return self.greedy and not self.logit_bias and not self.penalizes


LogitsProcessor = Callable[[np.ndarray, Sequence[int]], np.ndarray]


def apply_penalties(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """Repetition (llama.cpp style: divide positive, multiply negative), presence, frequency."""
    if not p.penalizes or not history:
        return logits
    window = history[-p.penalty_last_n:] if p.penalty_last_n > 0 else history
    counts = Counter(window)
    ids = np.fromiter(counts.keys(), dtype=np.int64)
    freq = np.fromiter(counts.values(), dtype=np.float32)
    ids_ok = ids < logits.shape[-1]
    ids, freq = ids[ids_ok], freq[ids_ok]
    out = logits.copy()
    sel = out[ids]
    if p.repetition_penalty != 1.0:
        sel = np.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
    sel = sel - freq * p.frequency_penalty - p.presence_penalty
    out[ids] = sel
    return out


def logits_processor(params: SamplingParams) -> LogitsProcessor:
    """Logit bias and penalties, as one function of (logits, history)."""

    def process(logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        if params.logit_bias:
            logits = logits.copy()
            for token, bias in params.logit_bias.items():
                logits[token] += bias
        return apply_penalties(logits, history, params)

    return process


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution the sampler draws from logits (vocab,): top-k, top-p, min-p,
    temperature ((vocab,) f64, sums to 1).

    Speculative decoding needs this distribution itself (p and q), not just a draw from it.
    """
    logits = np.asarray(logits)
    full = np.zeros(logits.shape[-1])
    if params.greedy:
        full[int(np.argmax(logits))] = 1.0
        return full
    ids, probs = _in_play(logits, params)
    full[ids] = probs
    return full


def _in_play(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens top-k, top-p and min-p leave in play (ascending ids, (m,)) and their
    probabilities after temperature, bit for bit those of the whole vocabulary's arrays
    (zeros elsewhere): each step works on the m tokens alone, and only the sums see the
    whole vocabulary (numpy sums pairwise, so the zeros' places decide the rounding).
    A default chain (top-k 40) over a 152k vocabulary took 4.5-7 ms a token over every
    logit (a partition, two exps, a draw's cumulative sum): a third of the 0.5B's decode
    step on two cores. logits (vocab,) in any float dtype: the k-th is found in it
    (f64 would order them alike), the tokens in play are taken to f64."""
    n = logits.shape[-1]
    if 0 < params.top_k < n:
        kth = _kth_largest(logits, params.top_k)
        ids = np.flatnonzero(logits >= kth)  # (ties at the k-th all stay)
    else:
        ids = np.arange(n)
    kept = logits[ids].astype(np.float64)
    keep = np.ones(ids.shape, dtype=bool)
    if params.top_p < 1.0 or params.min_p > 0.0:  # (their cut-offs read T=1 probabilities)
        probs = _normalized(np.exp(kept - kept.max()), ids, n)
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")  # (ids ascending: ties as a full sort)
        cut = int(np.searchsorted(np.cumsum(probs[order]), params.top_p)) + 1
        keep[order[cut:]] = False  # (the token crossing p stays)
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    ids = ids[keep]
    scaled = kept[keep] / params.temperature
    return ids, _normalized(np.exp(scaled - scaled.max()), ids, n)


def _normalized(weights: np.ndarray, ids: np.ndarray, n: int) -> np.ndarray:
    """weights (m,) of tokens ids over their sum as a vocabulary of n with zeros elsewhere
    would give it (the same pairwise rounding)."""
    if ids.size == n:
        return weights / weights.sum()
    full = _zeros(n)
    full[ids] = weights
    total = full.sum()
    full[ids] = 0.0
    return weights / total


_local = threading.local()


def _zeros(n: int) -> np.ndarray:
    """n f64 zeros, this thread's own and kept (a new 1-2 MB array a token cost 0.2-0.5 ms in
    page faults): the caller puts back the zeros it overwrites."""
    zeros = getattr(_local, "zeros", None)
    if zeros is None or zeros.size != n:
        zeros = _local.zeros = np.zeros(n)
    return zeros


#: logits per block whose maximum ``_kth_largest`` takes
_BLOCK = 64


def _kth_largest(logits: np.ndarray, k: int) -> float:
    """The k-th largest logit (np.partition's), partitioning only the blocks of _BLOCK
    logits whose maximum is at least the k-th largest maximum (and the ragged tail): a
    logit in any other block is below k larger ones (those maxima), so the top k all lie
    in these. One pass of maxima over the vocabulary, then a partition of <= k blocks."""
    n = logits.shape[-1]
    blocks = n // _BLOCK
    if blocks < 4 * k:  # (few blocks: no saving)
        return float(np.partition(logits, -k)[-k])
    tiles = logits[:blocks * _BLOCK].reshape(blocks, _BLOCK)
    maxima = tiles.max(axis=1)  # (blocks,)
    if np.isnan(maxima).any():  # (NaN: the plain partition's order)
        return float(np.partition(logits, -k)[-k])
    floor = np.partition(maxima, -k)[-k]
    candidates = np.concatenate([tiles[maxima >= floor].ravel(), logits[blocks * _BLOCK:]])
    return float(np.partition(candidates, -k)[-k])


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn from probs (vocab,): ``rng.choice(len(probs), p=probs)``'s token for the
    same generator state, drawn over the non-zero entries alone (the running sums are the
    same where they step, zeros add nothing), without a pass of the draw's over the whole
    vocabulary."""
    ids = np.flatnonzero(probs)
    return int(ids[rng.choice(ids.size, p=probs[ids])])


def make_sampler(params: SamplingParams,
                 rng: np.random.Generator | None = None) -> Callable[[np.ndarray], int]:
    """A function logits (vocab,) -> token id; seeded for reproducible draws (``rng``: draw
    with this generator instead of one seeded with ``params.seed``)."""
    rng = rng if rng is not None else np.random.default_rng(params.seed)

    def sample(logits: np.ndarray) -> int:
        if params.greedy:
            return int(np.argmax(logits))
        # the draw over the tokens in play equals a draw over the vocabulary with zeros
        # elsewhere (the same uniform, the same running sums where they step)
        ids, probs = _in_play(np.asarray(logits), params)
        return int(ids[rng.choice(ids.size, p=probs)])

    return sample
