"""`edgellm bench`: tokens/second per model and backend, like llama-bench.

    edgellm bench -m qwen2.5-coder-0.5b-instruct -m gemma-3-270m --backend cpu,numpy \
        -p 512 -n 128 -r 5 -t 2 -o md --compare-llamacpp
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

from edgellm.apps.common import CliError, add_draft_args


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="edgellm bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", action="append", default=None,
                   help="catalog name, .gguf path or Hugging Face folder (converted to q8_0 "
                        "at load); repeat for several (default: 0.5B coder)")
    p.add_argument("--backend", default="auto", help="comma-separated backends (default auto)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads (default: physical cores)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (0 = skip)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (0 = skip)")
    p.add_argument("-r", "--repetitions", type=int, default=5)
    p.add_argument("-o", "--output", choices=["md", "json", "csv"], default="md")
    p.add_argument("--compare-llamacpp", action="store_true",
                   help="also run llama.cpp's llama-bench ($LLAMA_BENCH, PATH, or "
                        "/work/llama/build/bin) on each file and show the ratio")
    add_draft_args(p)  # --draft: speculative speedup over plain decode (edgellm.speculative_bench)
    return p.parse_args(argv)


def _gib(n: float | None) -> str:
    return "" if n is None else f"{n / 2**30:.2f} GiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.0f} M"


def rows_of(results: list[tuple]) -> list[dict]:
    """Flat table rows from (record, llama.cpp record or None) pairs."""
    rows = []
    for rec, ref in results:
        row = {"model": rec.model, "size": _gib(rec.size), "params": _params(rec.params),
               "quant": rec.quant, "backend": rec.backend, "device": rec.device,
               "threads": rec.threads, "test": rec.test,
               "t/s": f"{rec.mean:.2f} ± {rec.std:.2f}",
               "weights GB/s": f"{rec.bandwidth / 1e9:.1f}",
               "TTFT ms": f"{rec.ttft_ms:.0f}" if rec.ttft_ms is not None else "",
               "peak RSS": _gib(rec.peak_rss)}
        if rec.peak_bandwidth and rec.test.startswith("tg"):  # decode: a memory-bound test
            row["memory GB/s"] = f"{rec.peak_bandwidth / 1e9:.1f}"
            row["% of memory BW"] = f"{100 * rec.bandwidth_share:.0f}%"
        if rec.peak_device_memory is not None:  # a GPU backend
            row["device peak"] = _gib(rec.peak_device_memory)
            row["weights+KV on device"] = _gib((rec.device_weight_bytes or 0)
                                               + (rec.kv_bytes or 0))
            row["capture ms"] = f"{1e3 * rec.capture_s:.0f}" if rec.capture_s else ""
            row["tuning s"] = f"{rec.tune_s:.1f}" if rec.tune_s else ""
        if ref is not None:
            row["llama.cpp t/s"] = f"{ref['mean_ts']:.2f} ± {ref['std_ts']:.2f}"
            row["ratio"] = f"{rec.mean / ref['mean_ts']:.2f}"
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str], command: str = "bench") -> int:
    from edgellm import bench
    from edgellm.store import resolve_model

    args = parse_args(argv)
    if args.draft:
        return draft_main(args)
    models = args.model or ["qwen2.5-coder-0.5b-instruct"]
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if args.compare_llamacpp and bench.find_llama_bench() is None:
        raise CliError("--compare-llamacpp: llama-bench not found; set $LLAMA_BENCH")
    folders = [m for m in models if Path(m).is_dir()]
    if args.compare_llamacpp and folders:
        raise CliError(f"--compare-llamacpp: llama-bench reads .gguf files, not the folder "
                       f"{folders[0]}; convert it first (edgellm convert)")
    results = []
    for model in models:
        reference = {}
        for backend in backends:
            records = bench.bench_model(model, backend, args.threads, args.n_prompt,
                                        args.n_gen, args.repetitions)
            if args.compare_llamacpp and not reference:
                threads = records[0].threads if records else (args.threads or 1)
                reference = {r["test"]: r for r in bench.llama_bench(
                    resolve_model(model), threads, args.n_prompt, args.n_gen,
                    args.repetitions)}
            results += [(r, reference.get(r.test)) for r in records]
            print(f"# {model} [{backend}] done", file=sys.stderr, flush=True)
    if args.output == "json":
        out = [dict(r.to_dict(), llamacpp=ref) for r, ref in results]
        print(json.dumps(out, indent=1))
    elif args.output == "csv":
        rows = rows_of(results)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
        print(buf.getvalue(), end="")
    else:
        print(markdown(rows_of(results)))
    return 0


def draft_main(args: argparse.Namespace) -> int:
    """--draft: plain vs. speculative greedy decoding of the (first) model on stdlib function
    completions, per prompt: speeds, speedup, acceptance; with --compare-llamacpp,
    llama-speculative on the same prompts."""
    from pathlib import Path

    from edgellm import bench
    from edgellm.speculative_bench import bench_draft, markdown_table

    llama_dir = None
    if args.compare_llamacpp:
        found = bench.find_llama_bench()
        if found is None:
            raise CliError("--compare-llamacpp: llama-bench not found; set $LLAMA_BENCH")
        llama_dir = Path(found).parent
    model = (args.model or ["qwen2.5-coder-1.5b-instruct"])[0]
    about, rows = bench_draft(model, args.draft, args.backend.split(",")[0], args.threads or 2,
                              args.n_gen, args.draft_n, llama_dir=llama_dir)
    if args.output == "json":
        print(json.dumps({"about": about, "rows": rows}, indent=1))
    else:
        print(f"# {about}")
        print(markdown_table(rows, llama=llama_dir is not None))
    return 0
