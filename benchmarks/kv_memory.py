"""Memory stays flat under a rotating KV budget: decode N tokens through a fixed budget and
report the process's RSS (current and peak) every 512 tokens.

    python benchmarks/kv_memory.py -m gemma-3-270m --ctx 512 --policy rotate -n 4096
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import edgellm
from edgellm.cache import CacheConfig
from edgellm.generate import generate_step
from edgellm.sampling import SamplingParams


def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    current = int(fields["VmRSS"].split()[0]) / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return current, peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("-m", "--model", default="gemma-3-270m")
    p.add_argument("--backend", default="auto")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--policy", default="rotate")
    p.add_argument("--keep", type=int, default=4)
    p.add_argument("-n", "--tokens", type=int, default=4096)
    p.add_argument("--every", type=int, default=512)
    args = p.parse_args()
    config = CacheConfig(max_tokens=args.ctx, policy=args.policy, keep=args.keep)
    model = edgellm.load(args.model, backend=args.backend, cache=config)
    cache = model.make_cache()
    print(f"{model.name} on {model.backend.name}: {model.cache_plan().describe()}",
          file=sys.stderr)
    steps = generate_step(model.encode("The GNU General Public License"), model.net, cache,
                          SamplingParams(temperature=0))
    rows, start = [], time.perf_counter()
    for i in range(1, args.tokens + 1):
        next(steps)
        if i % args.every == 0:
            current, peak = rss_mib()
            rows.append({"tokens": i, "offset": cache.offset, "kv_bytes": cache.nbytes,
                         "rss_mib": round(current, 1), "peak_rss_mib": round(peak, 1),
                         "tok_s": round(i / (time.perf_counter() - start), 2)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    growth = rows[-1]["peak_rss_mib"] - rows[0]["peak_rss_mib"]
    print(json.dumps({"model": model.name, "ctx": args.ctx, "policy": args.policy,
                      "kv_bytes": cache.nbytes, "peak_growth_after_first_mib": round(growth, 2),
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
