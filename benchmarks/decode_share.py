"""Decode's share of the memory bandwidth, each sample against the memory phase it ran in.

``edgellm bench`` probes the machine's bandwidth once, after a model's runs. On a VM whose
memory speed changes within a minute that probe can belong to another phase than the runs.
Here every tg128 sample (128 greedy tokens from an empty cache, as the bench runs them) is
bracketed by the same probe just before and just after, and its share is taken against the
mean of the two:

    EDGELLM_ISA=avx2vnni python benchmarks/decode_share.py MODEL [SECONDS]

Each line: the variant, the two probes (GB/s), t/s, weight GB/s and the share.
"""

from __future__ import annotations

import sys
import time

import edgellm
from edgellm.bench import cpu_stream_bandwidth, time_generation, weights_read_per_token
from edgellm.modelinfo import read_header


def main() -> None:
    name = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
    model = edgellm.load(name, backend="cpu")
    weights = weights_read_per_token(read_header(name).tensors)
    threads = model.backend.threads
    def make_cache():  # as the bench makes it for tg128
        return model.make_cache(128 + 16)

    time_generation(model.net, make_cache, 16, 100)  # warm-up
    end = time.time() + seconds
    while time.time() < end:
        before = cpu_stream_bandwidth(threads) / 1e9
        dt = time_generation(model.net, make_cache, 128, 100)
        after = cpu_stream_bandwidth(threads) / 1e9
        rate = weights * 128 / dt / 1e9
        print(f"{model.backend.variant} probe {before:.1f}/{after:.1f} GB/s, tg128 "
              f"{128 / dt:.1f} t/s, {rate:.1f} GB/s of weights, share "
              f"{100 * rate / ((before + after) / 2):.0f}%", flush=True)


if __name__ == "__main__":
    main()
