"""Concurrent sequences' decode steps as one batch graph against the eager batch, on a GPU:
where do they part? For N prompts of MODEL, the eager greedy run's tokens are fed to
each way (teacher-forced): each sequence's own graph in turn ("own"), one graph of the
set ("batch"); each step's largest logit difference from eager's and how many argmaxes
agree. Then the set's stream (``Model.sampled_batch_tokens``: tokens drawn and chained
on the device) runs free from the same prompts: the step where its tokens first leave
eager's. (The split kernel's ``apart`` mode row by row is a test:
``test_attention_apart_is_each_row_alone_over_its_own_cache``, on CUDA too.)

    python benchmarks/batch_parity.py MODEL.gguf [--streams 2] [--steps 40]

(``--backend torch`` on CPU torch: the graphs' static-buffer steps run eagerly there.)
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np

import edgellm
from edgellm.sampling import SamplingParams


def prefilled(net, prompts: list[np.ndarray]) -> list:
    caches = [net.make_cache(max_tokens=512) for _ in prompts]
    first = [net.forward(p, c) for p, c in zip(prompts, caches, strict=True)]
    return caches, [int(x.argmax()) for x in first]


def teacher_forced(net, prompts, tokens: list[list[int]]) -> list[np.ndarray]:
    """Each step's logits (N, vocab), fed tokens[j][step] to sequence j."""
    caches, _ = prefilled(net, prompts)
    steps = []
    for t in range(len(tokens[0])):
        got = net.forward_batch([(np.array([tokens[j][t]]), c) for j, c in enumerate(caches)])
        steps.append(np.stack(got))
    return steps


def report(name: str, steps: list[np.ndarray], reference: list[np.ndarray]) -> None:
    diffs = [float(np.abs(a - b).max()) for a, b in zip(steps, reference, strict=True)]
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).all()) for a, b in zip(steps, reference,
                                                                          strict=True))
    first = next((i for i, d in enumerate(diffs) if d > 0), None)
    print(f"{name}: max |dlogit| {max(diffs):.3g} (first nonzero at step {first}; per step "
          f"{' '.join(f'{d:.2g}' for d in diffs[:12])} ...), argmaxes agree {agree}/{len(steps)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-apart", action="store_true",
                    help="a batch graph attends a sequence at a time (no apart launch)")
    args = ap.parse_args()
    from edgellm.backends.torch import graphs as graphs_module

    model = edgellm.load(args.model, backend=args.backend)
    net, backend = model.net, model.backend
    if backend.graphs is None:  # (CPU torch: the graphs' steps uncaptured, for a dry run)
        backend.graphs = graphs_module.StepGraphs(backend)
    graphs = backend.graphs
    if args.no_apart:
        backend.attends_apart = lambda q: False
    prompts = [model.encode(f"[check {i}] Write a Python function that parses a CSV file.")
               for i in range(args.streams)]

    backend.graphs = None  # eager, free-running greedy: the reference tokens and logits
    caches, tokens = prefilled(net, prompts)
    fed, eager = [[t] for t in tokens], []
    for _ in range(args.steps):
        got = np.stack(net.forward_batch([(np.array([f[-1]]), c)
                                          for f, c in zip(fed, caches, strict=True)]))
        eager.append(got)
        for f, row in zip(fed, got, strict=True):
            f.append(int(row.argmax()))
    margins = [float(np.diff(np.sort(s, -1)[:, -2:], axis=-1).min()) for s in eager]
    print(f"eager: smallest top-2 margin a step {min(margins):.3g} (median "
          f"{float(np.median(margins)):.3g})")
    inputs = [f[:-1] for f in fed]
    backend.graphs = graphs
    for name, on in (("own", False), ("batch", True)):
        graphs_module.BATCH_GRAPHS = on
        report(name, teacher_forced(net, prompts, inputs), eager)
    graphs_module.BATCH_GRAPHS = True
    caches, first = prefilled(net, prompts)
    stream = net.sampled_batch_tokens(list(zip(first, caches, strict=True)),
                                      [SamplingParams(temperature=0)] * len(caches),
                                      [np.random.default_rng(0) for _ in caches])
    if stream is None:
        print("set stream: none (the backend declined)")
    else:
        drawn = [[t] for t in first]
        for rows in itertools.islice(stream, args.steps):
            for d, (token, _) in zip(drawn, rows, strict=True):
                d.append(token)
        stream.close()
        for j, (d, f) in enumerate(zip(drawn, fed, strict=True)):
            part = next((i for i, (a, b) in enumerate(zip(d, f, strict=True)) if a != b), None)
            print(f"set stream, sequence {j}: first token unlike eager's at {part} "
                  f"(of {len(d)})")
    model.close()


if __name__ == "__main__":
    main()
