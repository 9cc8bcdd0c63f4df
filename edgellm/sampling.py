"""SamplingParams (one frozen dataclass) and the sampler built from it.

The order of operations follows llama.cpp's default chain: penalties on the raw logits, then
top-k, top-p, min-p, temperature, and a draw. Temperature 0 is greedy and deterministic.
"""

from __future__ import annotations

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
    """The distribution the sampler draws from: top-k, top-p, min-p, temperature (f64, sums to 1).

    Speculative decoding needs this distribution itself (p and q), not just a draw from it.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        probs = np.zeros_like(logits)
        probs[int(np.argmax(logits))] = 1.0
        return probs
    keep = np.ones(logits.shape, dtype=bool)
    if 0 < params.top_k < logits.shape[-1]:
        kth = np.partition(logits, -params.top_k)[-params.top_k]
        keep &= logits >= kth
    masked = np.where(keep, logits, -np.inf)
    probs = np.exp(masked - masked.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        # sort only the tokens still in play (top-k leaves 40 of a 150k vocab: sorting them
        # all cost ~20 ms a token); the others have probability 0 and stay out either way
        live = np.flatnonzero(keep)  # ascending, so the stable sort breaks ties as before
        order = live[np.argsort(-probs[live], kind="stable")]
        cumulative = np.cumsum(probs[order])
        cut = int(np.searchsorted(cumulative, params.top_p)) + 1  # keep the token crossing p
        drop = order[cut:]
        keep[drop] = False
    if params.min_p > 0.0:
        keep &= probs >= params.min_p * probs.max()
    scaled = np.where(keep, logits / params.temperature, -np.inf)
    probs = np.exp(scaled - scaled.max())
    return probs / probs.sum()


def make_sampler(params: SamplingParams) -> Callable[[np.ndarray], int]:
    """A function logits (vocab,) -> token id; seeded for reproducible draws."""
    rng = np.random.default_rng(params.seed)

    def sample(logits: np.ndarray) -> int:
        if params.greedy:
            return int(np.argmax(logits))
        probs = probabilities(logits, params)
        return int(rng.choice(probs.shape[-1], p=probs))

    return sample
