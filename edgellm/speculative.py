"""Speculative decoding: drafters, the draft-length controller, and exact verification.

A drafter proposes k tokens after the context; the target scores all of them in one forward
pass; ``verify`` keeps the longest prefix the target agrees with, plus one token of its own.

Exactness (Leviathan et al. 2023, Chen et al. 2023): drafted token d with draft probability
q(d) is accepted with probability min(1, p(d) / q(d)); on rejection the replacement is drawn
from max(0, p - q), renormalised. The emitted tokens then follow the target's distribution p
whatever the draft does, so a cheaper, cruder draft (a cut-down output head, an n-gram lookup)
changes only speed. At temperature 0, p and q are one-hot and this is "accept while the draft
token is the target's argmax".

Pieces:
- ``ModelDrafter``: a smaller model of the same vocabulary, optionally with its output matrix
  cut to the token ids that matter (``draft_vocabulary``), which makes a draft step cheaper.
- ``NgramDrafter``: prompt lookup: continue the latest earlier occurrence of the context's tail.
- ``DraftLengthController``: picks k each round from measured costs and acceptance (or a fixed k).
- ``SpeculativeStats``: drafted, accepted, acceptance rate, mean accepted length, tokens per pass.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from edgellm.cache import ContextOverflow, KVCache
from edgellm.sampling import SamplingParams, draw, probabilities

if TYPE_CHECKING:
    from edgellm.api import Model

Processor = Callable[[np.ndarray, Sequence[int]], np.ndarray]

#: Draft vocabulary default: the first ids of a BPE vocab are its earliest (most frequent)
#: merges; the prompt's own ids and the control tokens are added on top.
DEFAULT_DRAFT_VOCAB = 32768


# ----------------------------------------------------------------------------- statistics


@dataclass
class SpeculativeStats:
    """Running counts of one speculative generation."""

    drafted: int = 0  # tokens proposed by the drafter
    accepted: int = 0  # of those, accepted by the target
    rounds: int = 0  # verification rounds that had at least one drafted token
    target_passes: int = 0  # target forward passes after the prompt
    draft_passes: int = 0  # draft forward passes after the prompt (0 for n-gram drafting)
    tokens: int = 0  # tokens emitted
    draft_lengths: list[int] = field(default_factory=list)  # k of each round (0 = plain step)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Accepted drafted tokens per round that drafted."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        """Tokens per decode pass of the target (the first token comes from the prompt's pass,
        so plain decoding scores exactly 1)."""
        return (self.tokens - 1) / self.target_passes if self.target_passes else 0.0

    def as_dict(self) -> dict:
        lengths = self.draft_lengths
        return {
            "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 3),
            "tokens_per_target_pass": round(self.tokens_per_target_pass, 3),
            "target_passes": self.target_passes, "draft_passes": self.draft_passes,
            "rounds": self.rounds,
            "mean_draft_length": round(sum(lengths) / len(lengths), 3) if lengths else 0.0,
        }


# ------------------------------------------------------------------------------ drafters


@dataclass
class Draft:
    """k proposed tokens and, per token, the draft distribution q it was drawn from.

    ``q[i]`` is (vocab,) f64, or None when the proposal was deterministic (q one-hot).
    """

    tokens: list[int]
    q: list[np.ndarray | None]


class Drafter(Protocol):
    """Proposes tokens after ``context``; told afterwards how much of its proposal survived."""

    seconds: float  # time spent proposing so far (the controller measures draft cost with it)
    steps: int  # draft forward passes charged to ``seconds`` (0 for a drafter without a model)

    def prefill(self, context: Sequence[int]) -> None:
        """Take in the context up front (outside the per-token cost measurements)."""

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                process: Processor, rng: np.random.Generator) -> Draft: ...

    def accept(self, context_len: int) -> None:
        """Verification done: the first ``context_len`` tokens of the context are final."""

    def close(self, context_len: int) -> None:
        """Generation ends with ``context_len`` tokens final (the rest may be rolled back)."""


def check_same_vocabulary(target: Model, draft: Model) -> None:
    """Refuse a draft whose tokenizer differs from the target's (padding rows are allowed)."""
    t_tokens, d_tokens = target.tokenizer.tokens, draft.tokenizer.tokens
    n = min(len(t_tokens), len(d_tokens))
    if hasattr(t_tokens, "first_difference"):  # (a Vocabulary: the file's bytes at once)
        mismatch = t_tokens.first_difference(d_tokens, n)
    else:
        mismatch = next((i for i in range(n) if t_tokens[i] != d_tokens[i]), None)
    extra = list(t_tokens[n:]) + list(d_tokens[n:])
    padding = all(str(t).startswith(("[PAD", "<pad", "<|PAD", "<unused")) for t in extra)
    if mismatch is not None or not padding:
        where = (f"token {mismatch} is {t_tokens[mismatch]!r} in the target but "
                 f"{d_tokens[mismatch]!r} in the draft" if mismatch is not None
                 else f"vocab sizes {len(t_tokens)} and {len(d_tokens)} differ by real tokens")
        raise ValueError(f"draft model {draft.name!r} does not share the tokenizer of "
                         f"{target.name!r} ({where}); pick a draft from the same model family")


def draft_vocabulary(model: Model, prompt: Sequence[int], size: int = DEFAULT_DRAFT_VOCAB
                     ) -> np.ndarray:
    """Token ids (sorted, unique) for a cut-down draft head: the first ``size`` ids of the vocab
    (a BPE vocab's earliest merges are its most frequent), the prompt's ids, the control ids."""
    vocab = model.args.vocab_size
    tok = model.tokenizer
    extra = [*prompt, *tok.eos_ids, *(i for i in (tok.bos_id, tok.eos_id) if i is not None)]
    ids = np.concatenate([np.arange(min(size, vocab)), np.asarray(extra, dtype=np.int64)])
    return np.unique(ids[(ids >= 0) & (ids < vocab)])


def restrict_head(model: Model, ids: np.ndarray):
    """A shallow copy of ``model.net`` whose output matrix keeps only rows ``ids`` (m,).

    Its forward returns (n, m) logits; blocks and weights are shared with ``model.net``.
    Returns None when the network has no ``output`` weight to cut.
    """
    from edgellm.converters.gguf_reader import QTensor, read_gguf

    net = model.net
    if not hasattr(net, "output"):
        return None
    tensors = read_gguf(model.path).tensors
    full = tensors.get("output.weight") or tensors["token_embd.weight"]  # tied when absent
    rows = np.ascontiguousarray(full.data[ids])  # (m, row_bytes): same encoding, fewer rows
    cut = copy.copy(net)
    cut.output = net.backend.prepare(QTensor(full.name, full.qtype, (len(ids), full.shape[1]),
                                             rows))
    return cut


class ModelDrafter:
    """Draft with a smaller model of the same vocabulary, one token per forward pass.

    Its cache holds a prefix of the context (``fed`` tokens); each proposal first feeds the
    missing tail in one pass, so plain steps taken while drafting is off cost nothing here.
    """

    def __init__(self, net, cache: KVCache, vocab_size: int, head_ids: np.ndarray | None = None,
                 min_confidence: float = 0.5):
        self.net, self.cache = net, cache
        self.vocab_size = vocab_size  # the target's: draft logits are mapped onto it
        self.head_ids = head_ids  # (m,) ids of a cut-down head, or None for the full head
        # stop a proposal at the first token the draft itself gives less than this probability
        # (at temperature 1): such tokens are rarely accepted and cost a draft step each
        self.min_confidence = min_confidence
        self.fed = cache.offset  # the cache holds context[:fed]
        self.seconds = 0.0  # time spent in draft steps (the controller reads it)
        self.steps = 0  # draft steps charged to ``seconds``
        self.catchup_seconds = 0.0  # time spent feeding tokens decoded while drafting was off
        self.passes = 0  # forward passes of the draft model after prefill
        self.broken = False  # set when the draft cache is full: drafting stops

    def prefill(self, context: Sequence[int]) -> None:
        pending = list(context[self.fed:len(context) - 1])  # the last is fed by propose()
        if pending and not self.broken:
            try:
                self.net.forward(np.asarray(pending), self.cache)
                self.fed += len(pending)
            except ContextOverflow:
                self.broken = True

    def _logits(self, tokens: Sequence[int]) -> tuple[np.ndarray, float]:
        """Draft logits (vocab,) over the target's vocabulary after feeding ``tokens``, and
        the draft's own probability of its top token (softmax at temperature 1)."""
        out = self.net.forward(np.asarray(tokens), self.cache)[-1]  # (m,) or (draft vocab,)
        self.passes += 1
        top = float(out.max())
        confidence = 1.0 / float(np.exp(out - top).sum())
        full = np.full(self.vocab_size, -np.inf, dtype=np.float32)
        if self.head_ids is not None:
            full[self.head_ids] = out
        else:
            n = min(len(out), self.vocab_size)  # vocab sizes may differ by padding
            full[:n] = out[:n]
        return full, confidence

    def propose(self, context, k, params, process, rng) -> Draft:
        if self.broken or k == 0:
            return Draft([], [])
        context = list(context)
        tokens, qs = [], []
        pending = context[self.fed:]
        try:
            for _ in range(k):
                start = time.perf_counter()
                logits, confidence = self._logits(pending)
                spent = time.perf_counter() - start
                if len(pending) > 2:  # catching up after plain steps: a one-off, not per token
                    self.catchup_seconds += spent
                else:
                    self.seconds += spent
                    self.steps += 1
                self.fed += len(pending)
                if confidence < self.min_confidence:
                    break
                logits = process(logits, context)
                if params.greedy:
                    token, q = int(np.argmax(logits)), None
                else:
                    q = probabilities(logits, params)
                    token = draw(q, rng)
                tokens.append(token)
                qs.append(q)
                context.append(token)
                pending = [token]
        except ContextOverflow:
            self.broken = True
        return Draft(tokens, qs)

    def accept(self, context_len: int) -> None:
        if self.fed > context_len:
            self.cache.trim(self.fed - context_len)
            self.fed = context_len

    def close(self, context_len: int) -> None:
        self.accept(context_len)


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n from ``max_n`` down to ``min_n``) and propose what followed it. No model, q one-hot."""

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.seconds = 0.0
        self.steps = 0

    def propose(self, context, k, params, process, rng) -> Draft:
        if k == 0:
            return Draft([], [])
        start = time.perf_counter()
        tokens = self.lookup(list(context), k)
        self.seconds += time.perf_counter() - start
        return Draft(tokens, [None] * len(tokens))

    def prefill(self, context: Sequence[int]) -> None:
        pass

    def lookup(self, context: list[int], k: int) -> list[int]:
        arr = np.asarray(context, dtype=np.int64)  # (T,)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            tail = arr[-n:]
            # windows (T-n, n) over all earlier positions; the last one is the tail itself
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return [int(t) for t in arr[start:start + k]]
        return []

    def accept(self, context_len: int) -> None:
        pass

    def close(self, context_len: int) -> None:
        pass


def make_drafter(target: Model, draft: Model | str | Drafter, prompt: Sequence[int],
                 max_tokens: int, head_vocab: int | None = DEFAULT_DRAFT_VOCAB,
                 min_confidence: float = 0.5) -> Drafter:
    """A drafter from a draft ``Model``, "ngram" (prompt lookup), or an existing ``Drafter``.

    A model draft gets its own cache of ``max_tokens`` and, when ``head_vocab`` is set, an
    output head cut to ``draft_vocabulary(..., head_vocab)`` (exactness does not depend on it)
    and stops a proposal at a token it gives less than ``min_confidence``.
    """
    if isinstance(draft, str):
        if draft != "ngram":
            raise ValueError(f"draft {draft!r}: pass a loaded Model (edgellm.load(...)) or 'ngram'")
        return NgramDrafter()
    if hasattr(draft, "propose"):
        return draft  # already a Drafter
    check_same_vocabulary(target, draft)
    vocab = target.args.vocab_size
    net, ids = draft.net, None
    if head_vocab:
        ids = draft_vocabulary(draft, prompt, head_vocab)
        ids = ids[ids < vocab]
        cut = restrict_head(draft, ids) if len(ids) < draft.args.vocab_size else None
        net, ids = (cut, ids) if cut is not None else (draft.net, None)
    return ModelDrafter(net, draft.make_cache(max_tokens), vocab, ids, min_confidence)


# ---------------------------------------------------------------------------- controller


class DraftLengthController:
    """Chooses the draft length k of each round.

    Pinned (``fixed``) or adaptive, from two measured rates (exponential averages):

    * u, how often a draft step stops the proposal (the draft model unsure of its next token,
      or no n-gram match): the step is paid for, its token is not proposed;
    * b, how often the target accepts a proposed token (observed up to the first rejection).

    A round asking for k drafts then runs sum(i < k) (1 - u)^i draft steps of cost c (the
    median of recent steps, so one step slowed by a busy machine does not switch drafting
    off), proposes sum(1 <= i <= k) (1 - u)^i tokens, verified in one target pass of cost T(n)
    (a least-squares line over recent passes), and yields (1 - a^(k+1)) / (1 - a) tokens with
    a = (1 - u) b. k = 0 is a plain step, 1 token for T(1). It picks the k with the best
    tokens per second. (Charging every round k steps, as if proposals were never cut short,
    made it draft too little: at 85% acceptance it kept k at 1 where k = 3 pays 5% more.)

    While k = 0 wins nothing is observed, so each plain step moves u and b 1/``probe_every``
    of the way back to their priors: a stretch where the draft was unsure (they come in
    runs) does not switch drafting off for the rest of the reply. Where even the priors say
    k = 0, it probes with a short draft after ``probe_every`` plain steps (doubling while
    probes fail, up to 4x) so a rising acceptance is noticed. Draft catch-up passes after
    plain steps are not draft steps.
    """

    def __init__(self, fixed: int | None = None, max_k: int = 7, initial_k: int = 3,
                 acceptance_prior: float = 0.7, draft_cost_prior: float = 0.35,
                 smoothing: float = 0.1, probe_every: int = 16):
        if fixed is not None and fixed < 0:
            raise ValueError(f"draft length must be >= 0, got {fixed}")
        self.fixed, self.max_k, self.initial_k = fixed, max_k, initial_k
        self.accept_prior = self.accept_rate = acceptance_prior  # b: proposed tokens kept
        self.stop_rate = 0.0  # u: draft steps that end the proposal without a token
        self.draft_cost_prior = draft_cost_prior  # c / T(1) before anything is measured
        self.step_costs: deque[float] = deque(maxlen=16)  # seconds of recent draft steps
        self.free_draft = False  # a drafter without model steps (n-gram): c ~ 0
        self.smoothing = smoothing
        self.probe_every = probe_every
        self.passes: deque[tuple[int, float]] = deque(maxlen=48)  # (tokens, seconds)
        self.plain_steps = 0
        self.probe_interval = probe_every  # doubles after each probe that changes nothing

    @property
    def acceptance(self) -> float:
        """a: the chance that a draft position yields a token the target keeps."""
        return (1.0 - self.stop_rate) * self.accept_rate

    @property
    def draft_cost(self) -> float | None:
        """Seconds per draft step as measured (None before the first step)."""
        if self.free_draft:
            return 0.0
        return float(np.median(self.step_costs)) if self.step_costs else None

    def next_length(self) -> int:
        """k for the next round (max_k 7 keeps a verification pass at <= 8 tokens, the batch
        the fast CPU backend reads each weight once for)."""
        if self.fixed is not None:
            return self.fixed
        if len(self.passes) < 2:
            return self.initial_k
        k = self.best_length()
        if k == 0:
            forget = 1.0 / self.probe_every  # what was measured grows stale
            self.stop_rate -= forget * self.stop_rate
            self.accept_rate += forget * (self.accept_prior - self.accept_rate)
            self.plain_steps += 1
            if self.plain_steps >= self.probe_interval:
                # a probe costs a catch-up pass of the draft: back off while probes fail
                self.plain_steps = 0
                self.probe_interval = min(2 * self.probe_interval, 4 * self.probe_every)
                return 2
        else:
            self.plain_steps = 0
            self.probe_interval = self.probe_every
        return k

    def target_cost(self, n: float) -> float:
        """Estimated seconds of a target pass over n tokens."""
        ns = np.array([p[0] for p in self.passes], dtype=np.float64)
        ts = np.array([p[1] for p in self.passes], dtype=np.float64)
        if len(set(ns.tolist())) < 2:  # one size seen: assume +8% per extra token
            base = float(ts.mean()) / (1 + 0.08 * (float(ns.mean()) - 1))
            return base * (1 + 0.08 * (n - 1))
        slope, intercept = np.polyfit(ns, ts, 1)
        if slope < 0:  # noise: a bigger pass is never cheaper; take them as equal
            return float(ts.mean())
        return max(float(intercept + slope * n), 1e-6)

    def best_length(self) -> int:
        t1 = self.target_cost(1)
        c = self.draft_cost
        c = self.draft_cost_prior * t1 if c is None else c
        a = min(self.acceptance, 0.999)
        go = 1.0 - self.stop_rate  # a step does not end the proposal
        best_k, best_rate = 0, 1.0 / t1
        steps = proposed = 0.0
        for k in range(1, self.max_k + 1):
            steps += go ** (k - 1)  # step k runs if the k - 1 before it proposed
            proposed += go ** k
            expected = (1 - a ** (k + 1)) / (1 - a)
            rate = expected / (steps * c + self.target_cost(1 + proposed))
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def record(self, requested: int, drafted: int, accepted: int, draft_seconds: float,
               draft_steps: int, target_tokens: int, target_seconds: float) -> None:
        """Measurements of one round: k requested, ``drafted`` proposed in ``draft_steps``
        model steps, ``accepted`` of them kept, and what each side cost."""
        self.passes.append((target_tokens, target_seconds))
        if draft_steps:
            self.step_costs.append(draft_seconds / draft_steps)
        elif drafted:
            self.free_draft = True
        s = self.smoothing
        stopped = requested > 0 and drafted < requested  # the proposal ended early
        for stop in [0.0] * drafted + [1.0] * stopped:
            self.stop_rate += s * (stop - self.stop_rate)
        for ok in [1.0] * accepted + [0.0] * (accepted < drafted):
            self.accept_rate += s * (ok - self.accept_rate)


# --------------------------------------------------------------------------- verification


def verify(draft: Draft, target_logits: np.ndarray, context: Sequence[int],
           params: SamplingParams, process: Processor, rng: np.random.Generator
           ) -> tuple[list[int], list[np.ndarray]]:
    """Accept a prefix of ``draft`` against the target and add one token of the target's own.

    ``target_logits`` (k+1, vocab) are the raw target logits after context, context + d1, ...,
    context + d1..dk. Returns the emitted tokens (j accepted drafts + 1 more, so 1..k+1) and
    their processed target logits.
    """
    context = list(context)
    out_tokens: list[int] = []
    out_logits: list[np.ndarray] = []
    for i in range(len(target_logits)):
        logits = process(target_logits[i], context)
        out_logits.append(logits)
        drafted = draft.tokens[i] if i < len(draft.tokens) else None
        if params.greedy:
            best = int(np.argmax(logits))
            out_tokens.append(best)
            if best != drafted:
                break
        else:
            p = probabilities(logits, params)
            if drafted is None:  # past the draft: the bonus token, straight from p
                out_tokens.append(draw(p, rng))
                break
            q = draft.q[i]
            q_d = 1.0 if q is None else q[drafted]
            if rng.random() < min(1.0, p[drafted] / q_d):  # q_d > 0: d was drawn from q
                out_tokens.append(drafted)
            else:
                out_tokens.append(resample(p, q, drafted, rng))
                break
        context.append(out_tokens[-1])
    return out_tokens, out_logits


def resample(p: np.ndarray, q: np.ndarray | None, drafted: int, rng: np.random.Generator) -> int:
    """A draw from max(0, p - q), renormalised (q None: one-hot at ``drafted``)."""
    if q is None:
        residual = p.copy()
        residual[drafted] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0:  # p == q: rejection had probability 0; fall back to p
        residual, total = p, p.sum()
    return draw(residual / total, rng)
