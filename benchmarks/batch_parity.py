"""Concurrent sequences' decode steps as one batch graph against the eager batch, on a GPU:
where do they part? For N prompts of MODEL, the eager greedy run's tokens are fed to
each way (teacher-forced): each sequence's own graph in turn ("own"), one graph of the
set ("batch"); each step's largest logit difference from eager's and how many argmaxes
agree. Then the set's stream (``Model.sampled_batch_tokens``: tokens drawn and chained
on the device) runs free from the same prompts: the step where its tokens first leave
eager's. Last, the split-attention kernel's ``apart`` mode against each row alone.

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


def attention_apart(kernels, torch, device: str) -> None:
    """The test's case that failed on a GPU (f32 caches, 8 rows) and its neighbours: each
    row's largest difference from that row's attention alone."""
    for hd, n, dtype in ((16, 8, torch.float32), (16, 3, torch.float32), (128, 8, torch.float32),
                         (16, 8, torch.float16), (128, 3, torch.float16)):
        heads, kvh, T = 4, 2, 70
        g = torch.Generator().manual_seed(T + n)
        q = torch.randn((n, heads, hd), generator=g).to(device)
        kn, vn = (torch.randn((n, kvh, hd), generator=g).to(device) for _ in range(2))
        caches = [[torch.randn((T + 1, kvh, hd), generator=g).to(device, dtype)
                   for _ in range(2)] for _ in range(n)]
        used = torch.randint(1, T, (n,), generator=g)
        slots = (used - 1).to(device)
        masks = (torch.arange(T)[None, :] < used[:, None]).to(device)
        used = used.to(device)
        alone = []
        for j, (keys, values) in enumerate([[c.clone() for c in pair] for pair in caches]):
            alone.append(kernels.attention(q[j:j + 1], keys[:T], values[:T], masks[j:j + 1],
                                           hd ** -0.5, write=(slots[j:j + 1], kn[j:j + 1],
                                                              vn[j:j + 1]),
                                           span=used[j:j + 1]))
        keys, values = ([pair[i] for pair in caches] for i in (0, 1))
        apart = (kernels.offsets(keys, keys[0]), kernels.offsets(values, values[0]))
        got = kernels.attention(q, keys[0][:T], values[0][:T], masks, hd ** -0.5,
                                write=(slots, kn, vn), span=used, apart=apart)
        rows = [float((got[j] - alone[j][0]).abs().max()) for j in range(n)]
        print(f"attention apart hd={hd} n={n} {str(dtype)[6:]}: |diff| by row "
              f"{' '.join(f'{r:.2g}' for r in rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--no-apart", action="store_true",
                    help="a batch graph attends a sequence at a time (no apart launch)")
    args = ap.parse_args()
    import torch

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
    if backend.kernels is not None:
        attention_apart(backend.kernels, torch, str(backend.device))
    model.close()


if __name__ == "__main__":
    main()
