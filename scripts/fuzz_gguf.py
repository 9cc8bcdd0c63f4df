"""Fuzz the GGUF path: structure-aware mutations of seed models through the reader, the load
and a forward pass, each input in a worker process with a time and a memory budget.

    .venv/bin/python scripts/fuzz_gguf.py --inputs 10000 --json fuzz.json --save-crashes

Per input: 5 s (a hang kills and replaces the worker), and an allocation budget: the peak of
numpy and Python allocations (tracemalloc) above the worker's baseline must stay under
``16 x file size + 64 MiB`` (the numpy reference dequantizes 4-bit blocks to f32, ~7x).
A crash is any exception but a one-line ``ValueError``, or the worker dying (a segfault in a
C kernel). Crashing, hanging and over-allocating inputs are written to --crash-dir for the
corpus. Reports inputs run, minutes, outcomes, the most frequent rejections, the largest
allocation ratio, and line coverage of the reader and the checks (``coverage``, if present).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import gguf_fuzz  # noqa: E402

TIMEOUT_S = 5.0
ALLOC_FACTOR, ALLOC_SLACK = 16, 64 << 20
COVERED = ["converters/gguf_reader.py", "edgellm/model_checks.py", "edgellm/config.py",
           "edgellm/tokenizer.py"]


def alloc_budget(file_size: int) -> int:
    """The most a file of this size may make the loader allocate."""
    return ALLOC_FACTOR * file_size + ALLOC_SLACK


def _worker(conn, folder: str, measure_coverage: bool) -> None:
    """Run inputs sent over ``conn``: (index, bytes, backend) -> a result dict."""
    import tracemalloc
    import warnings

    warnings.filterwarnings("ignore")  # overflow/NaN warnings of garbage weights: expected

    cov = None
    if measure_coverage:
        try:
            import coverage

            cov = coverage.Coverage(data_file=None, include=[str(ROOT / p) for p in COVERED])
            cov.start()
        except ImportError:
            cov = None
    # warm imports (and the C kernels) before measuring anything
    import edgellm.api  # noqa: F401
    from edgellm.backends import get_backend

    get_backend("cpu")
    tracemalloc.start()
    conn.send("ready")
    path = Path(folder) / "input.gguf"
    while True:
        try:
            item = conn.recv()
        except EOFError:
            break
        if item is None:
            break
        index, raw, backend = item
        path.write_bytes(raw)
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        start = time.perf_counter()
        try:
            message = gguf_fuzz.run_target(path, backend=backend)
            outcome = "ok" if message == "ok" else "rejected"
        except gguf_fuzz.Crash as exc:
            outcome, message = "crash", str(exc)
        peak = tracemalloc.get_traced_memory()[1] - base
        conn.send({"index": index, "outcome": outcome, "message": message[:300],
                   "seconds": time.perf_counter() - start, "peak": peak})
    if cov is not None:
        cov.stop()
        total = {}
        for name in COVERED:
            try:
                _, statements, _, missing, _ = cov.analysis2(str(ROOT / name))
                total[name] = (len(statements), len(statements) - len(missing))
            except Exception:  # noqa: BLE001 - a file never imported
                total[name] = (0, 0)
        conn.send({"coverage": total})


class Worker:
    """A worker process with its pipe; replaced after a hang or a death."""

    def __init__(self, folder: str, coverage: bool):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, folder, coverage), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(300) or self.conn.recv() != "ready":  # imports, C kernels
            raise RuntimeError("the fuzz worker did not start")

    def run(self, index: int, raw: bytes, backend: str, timeout: float) -> dict:
        self.conn.send((index, raw, backend))
        if not self.conn.poll(timeout):
            return {"index": index, "outcome": "hang", "message": f"no answer in {timeout} s"}
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            return {"index": index, "outcome": "crash",
                    "message": f"worker died (exit {self.proc.exitcode})"}

    def stop(self) -> dict | None:
        try:
            self.conn.send(None)
            if self.conn.poll(60):
                return self.conn.recv()
        except (OSError, EOFError):
            pass
        finally:
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
        return None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)


def real_models() -> dict[str, Path]:
    from edgellm import store

    return {name: store.model_file(name) for name in ("qwen2.5-coder-0.5b-instruct",
                                                      "gemma-3-270m") if store.is_installed(name)}


def fuzz(n_inputs: int, seed: int, seed_dir: Path, crash_dir: Path | None, minutes: float,
         coverage: bool, log) -> dict:
    seeds = gguf_fuzz.write_seeds(seed_dir, real_models())
    docs = [(p.name, gguf_fuzz.parse_doc(p.read_bytes())) for p in seeds]
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    reasons: collections.Counter = collections.Counter()
    findings: list[dict] = []
    worst_ratio, worst_peak, slowest, max_ratio = 0.0, 0, 0.0, 0.0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzz-gguf-") as tmp:
        worker = Worker(tmp, coverage)
        cover = None
        i = 0
        for i in range(n_inputs):
            if minutes and time.monotonic() - started > minutes * 60:
                break
            name, doc = docs[i % len(docs)]
            if i < len(docs):  # each seed once, unmutated: it must load and run
                raw, steps = gguf_fuzz.serialize(doc), ["seed"]
            else:
                raw, steps = gguf_fuzz.mutate(doc, rng)
            backend = "numpy" if i % 2 == 0 else "cpu"
            result = worker.run(i, raw, backend, TIMEOUT_S)
            if result["outcome"] == "hang":  # again on a fresh worker: the VM is shared
                worker.kill()
                worker = Worker(tmp, coverage)
                result = worker.run(i, raw, backend, TIMEOUT_S)
            outcome = result["outcome"]
            counts[outcome] += 1
            slowest = max(slowest, result.get("seconds", TIMEOUT_S))
            if outcome == "rejected":
                reasons[_reason(result["message"])] += 1
            peak = result.get("peak", 0)
            ratio = peak / max(len(raw), 1)
            max_ratio = max(max_ratio, ratio)
            if peak > worst_peak:
                worst_peak, worst_ratio = peak, ratio
            over = peak > alloc_budget(len(raw))
            if over:
                counts["over-allocation"] += 1
            if outcome in ("crash", "hang") or over:
                finding = {"index": i, "seed": name, "steps": steps, "backend": backend,
                           "outcome": "over-allocation" if over and outcome == "ok" else outcome,
                           "message": result["message"], "peak": peak, "size": len(raw)}
                findings.append(finding)
                log(f"[{i}] {finding['outcome']}: {result['message'][:160]} ({steps})")
                if crash_dir is not None:
                    crash_dir.mkdir(parents=True, exist_ok=True)
                    digest = hashlib.sha256(raw).hexdigest()[:12]
                    (crash_dir / f"crash-{digest}.gguf").write_bytes(raw)
                if outcome in ("crash", "hang"):
                    worker.kill()
                    worker = Worker(tmp, coverage)
            if i < len(docs) and outcome != "ok":
                raise SystemExit(f"seed {name} does not run: {result['message']}")
            if (i + 1) % 500 == 0:
                log(f"{i + 1} inputs, {(time.monotonic() - started) / 60:.1f} min, {dict(counts)}")
        final = worker.stop()
        if final and "coverage" in final:
            cover = final["coverage"]
    elapsed = time.monotonic() - started
    return {
        "inputs": sum(counts[k] for k in ("ok", "rejected", "crash", "hang")),
        "minutes": round(elapsed / 60, 2), "outcomes": dict(counts),
        "findings": findings, "slowest_s": round(slowest, 3),
        "max_peak_bytes": worst_peak, "file_ratio_at_max_peak": round(worst_ratio, 2),
        "max_ratio_to_file": round(max_ratio, 2),
        "alloc_budget": f"{ALLOC_FACTOR} x file + {ALLOC_SLACK >> 20} MiB",
        "top_rejections": reasons.most_common(25),
        "seeds": [name for name, _ in docs],
        "coverage": ({k: {"statements": s, "covered": c,
                          "percent": round(100 * c / s, 1) if s else 0.0}
                      for k, (s, c) in cover.items()} if cover else None),
        "note": "coverage counts lines run by the fuzz worker only (mutated inputs, not tests)"
        if cover else "coverage not measured (pip install coverage)",
    }


def _reason(message: str) -> str:
    """A rejection message without its numbers and paths, to group them."""
    import re

    text = re.sub(r"/\S+\.gguf", "FILE", message)
    text = re.sub(r"'[^']*'", "'…'", text)
    return re.sub(r"\d+", "N", text)[:120]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inputs", type=int, default=10_000)
    p.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: no)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--save-crashes", action="store_true",
                   help="write findings to tests/fuzz_corpus/ (or --crash-dir)")
    p.add_argument("--crash-dir", type=Path, default=ROOT / "tests" / "fuzz_corpus")
    p.add_argument("--no-coverage", action="store_true")
    args = p.parse_args(argv)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="fuzz-seeds-") as seeds:
        report = fuzz(args.inputs, args.seed, Path(seeds),
                      args.crash_dir if args.save_crashes else None, args.minutes,
                      not args.no_coverage, log)
    summary = {k: v for k, v in report.items() if k not in ("findings", "top_rejections")}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    bad = report["outcomes"].get("crash", 0) + report["outcomes"].get("hang", 0) + \
        report["outcomes"].get("over-allocation", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
