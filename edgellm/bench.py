"""Throughput measurement like llama-bench: prompt processing and generation timed apart.

``bench_model`` loads one model on one backend and returns one ``BenchRecord`` per test
(``pp512``: one forward pass over a 512-token prompt; ``tg128``: 128 single-token forward
passes from an empty cache), each with its per-repetition samples; a warm-up run of each test
is excluded (and with it a device backend's kernel compilation and CUDA-graph capture, whose
time per capture is reported apart, as ``capture_s``, and its first-use timing of kernel
variants as ``tune_s``). ``llama_bench`` runs llama.cpp's
llama-bench on the same file for comparison. This module returns records; apps/bench.py
prints them.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class BenchRecord:
    """One test of one model on one backend; ``samples`` are tokens/second per repetition."""

    model: str
    size: int  # bytes of the model file
    params: int
    quant: str
    backend: str
    device: str
    threads: int
    test: str  # "pp512", "tg128"
    samples: list[float] = field(default_factory=list)
    weight_bytes_per_token: int = 0  # bytes of weights one forward pass reads
    ttft_ms: float | None = None  # time to first token: the prompt's forward pass (pp tests)
    load_s: float | None = None
    peak_rss: int | None = None  # bytes, high-water mark while this model was benchmarked
    # device backends (torch on CUDA): bytes/s the device's memory moves at most, peak device
    # memory while benchmarked, weights and KV cache as held there, graph capture time
    peak_bandwidth: float | None = None
    peak_device_memory: int | None = None
    device_weight_bytes: int | None = None
    kv_bytes: int | None = None
    capture_s: float | None = None
    tune_s: float | None = None  # kernel variants timed at first use (0 when remembered)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else 0.0

    @property
    def std(self) -> float:
        return statistics.stdev(self.samples) if len(self.samples) > 1 else 0.0

    @property
    def bandwidth(self) -> float:
        """Effective weight bandwidth in bytes/second: weight bytes per token x tokens/s."""
        return self.weight_bytes_per_token * self.mean

    @property
    def bandwidth_share(self) -> float | None:
        """Weight bandwidth as a share of the device's peak, where the peak is known."""
        return self.bandwidth / self.peak_bandwidth if self.peak_bandwidth else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_ts=self.mean, std_ts=self.std, bandwidth=self.bandwidth)
        return d


def device_name() -> str:
    """CPU model and core count, e.g. 'Intel(R) Xeon(R) Processor (2 cores)'."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import platform

    return f"{model or platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


#: How long the probe waits for OpenBLAS's worker threads to stop spinning for more work (its
#: THREAD_TIMEOUT; ~0.1 s here) and sleep. Until then they hold a core: a decode timed right
#: after the probe ran with the kernels' helper thread getting 0-25% of its chunks and its
#: mat-vecs at 0.5-0.8x, for the first ~100 ms (2 Zen 5 cores); after this pause, its full
#: half from the first call.
BLAS_PARK_SECONDS = 0.3


def cpu_stream_bandwidth(threads: int) -> float:
    """Bytes/second ``threads`` cores stream from memory: the best of 3 f32 mat-vecs over a
    1 GiB matrix (numpy's BLAS on that many threads). The ceiling a decode step's weight
    reads can reach on this machine. Measured anew for each model, right after its runs: on
    a shared VM the memory speed moves over minutes (this probe read 37 to 66 GB/s in one
    afternoon), and a share against a probe taken minutes before means little. Returns once
    BLAS's threads sleep again (``BLAS_PARK_SECONDS``)."""
    from edgellm.backends.cpu.blas_threads import blas_threads

    a = np.ones((16384, 16384), dtype=np.float32)  # 1 GiB: far past any last-level cache
    x = np.ones(16384, dtype=np.float32)
    best = float("inf")
    with blas_threads(threads):
        for _ in range(3):
            start = time.perf_counter()
            a @ x
            best = min(best, time.perf_counter() - start)
    time.sleep(BLAS_PARK_SECONDS)
    return a.nbytes / best


def quant_name(metadata: dict) -> str:
    """The file's quant mix (general.file_type), e.g. 'Q4_K_M'."""
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(metadata["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError):
        return "?"


def weights_read_per_token(tensors: dict) -> int:
    """Bytes of weights one token's forward pass reads: all but the embedding table, which
    is read only where it doubles as the (tied) output."""
    total = sum(t.nbytes for t in tensors.values())
    if "output.weight" in tensors and "token_embd.weight" in tensors:
        total -= tensors["token_embd.weight"].nbytes
    return total


def reset_peak_rss() -> None:
    """Restart the kernel's resident-memory high-water mark (Linux; a no-op elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int | None:
    """Peak resident memory of this process in bytes (VmHWM), where the OS reports it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _time_prompt(net, make_cache, tokens: np.ndarray) -> float:
    cache = make_cache()
    start = time.perf_counter()
    net.forward(tokens, cache)
    return time.perf_counter() - start


def time_generation(net, make_cache, n_gen: int, token: int) -> float:
    """Seconds for n_gen greedy tokens (``greedy_tokens``: on a device backend the argmax is
    taken there and the step queued ahead is waited for before the clock stops)."""
    cache = make_cache()
    start = time.perf_counter()
    steps = net.greedy_tokens(token, cache)
    for _ in range(n_gen):
        next(steps)
    steps.close()
    return time.perf_counter() - start


def backend_label(be) -> str:
    """The backend's name and, for the CPU, the kernels it runs ("cpu/avx2", "cpu/numba")."""
    variant = getattr(be, "variant", None)
    return f"{be.name}/{variant}" if variant else be.name


def bench_model(model: str, backend: str = "auto", threads: int | None = None,
                n_prompt: int = 512, n_gen: int = 128, repetitions: int = 5) -> list[BenchRecord]:
    """Measure ``pp{n_prompt}`` and ``tg{n_gen}`` (either skipped when 0) on one backend."""
    import edgellm
    from edgellm.modelinfo import read_header

    reset_peak_rss()
    start = time.perf_counter()
    loaded = edgellm.load(model, backend=backend, threads=threads)
    load_s = time.perf_counter() - start
    header = read_header(model)  # a folder: the tensor table as it was converted at load
    tensors = header.tensors
    net, be = loaded.net, loaded.backend
    on_device = getattr(be, "device_memory", lambda: None)()  # after load: the weights
    tuned_before = getattr(be, "tuning_seconds", lambda: 0.0)()  # (per process, not model)
    described = getattr(be, "device_name", None)
    common = dict(model=loaded.name, size=header.gguf_bytes,
                  params=sum(t.n_elements for t in tensors.values()),
                  quant=quant_name(loaded.metadata), backend=backend_label(be),
                  device=described() if described else device_name(),
                  threads=int(getattr(be, "threads", None) or threads or 1),
                  weight_bytes_per_token=weights_read_per_token(tensors), load_s=load_s)
    del tensors, header

    def make_cache():
        return loaded.make_cache(n_prompt + n_gen + 16)

    records = []
    rng = np.random.default_rng(0)
    if n_prompt:
        tokens = rng.integers(100, min(loaded.args.vocab_size, 30000), n_prompt)
        _time_prompt(net, make_cache, tokens)  # warm-up: JIT, page faults, caches
        times = [_time_prompt(net, make_cache, tokens) for _ in range(repetitions)]
        records.append(BenchRecord(**common, test=f"pp{n_prompt}",
                                   samples=[n_prompt / t for t in times],
                                   ttft_ms=1e3 * statistics.fmean(times)))
    if n_gen:
        time_generation(net, make_cache, min(n_gen, 16), 100)
        times = [time_generation(net, make_cache, n_gen, 100) for _ in range(repetitions)]
        records.append(BenchRecord(**common, test=f"tg{n_gen}",
                                   samples=[n_gen / t for t in times]))
    memory = getattr(be, "device_memory", lambda: None)()
    graphs = getattr(be, "graphs", None)
    rss = peak_rss()  # before the CPU's bandwidth probe allocates its 1 GiB
    peak = getattr(be, "peak_bandwidth", lambda: None)()
    if peak is None and be.name == "cpu":
        peak = cpu_stream_bandwidth(common["threads"])
    for r in records:
        r.peak_rss = rss
        r.peak_bandwidth = peak
        if memory is not None:
            r.peak_device_memory = memory["peak"]
            r.device_weight_bytes = on_device["active"] if on_device else None
            r.kv_bytes = make_cache().nbytes
        if graphs is not None and getattr(graphs, "captures", 0):
            r.capture_s = graphs.capture_seconds / graphs.captures
        if hasattr(be, "tuning_seconds"):
            r.tune_s = be.tuning_seconds() - tuned_before
    return records


def find_llama_bench() -> str | None:
    """llama.cpp's llama-bench: $LLAMA_BENCH, else on PATH, else /work/llama/build/bin."""
    candidates = [os.environ.get("LLAMA_BENCH"), shutil.which("llama-bench"),
                  "/work/llama/build/bin/llama-bench"]
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)),
                None)


def llama_bench(path: str | os.PathLike, threads: int, n_prompt: int = 512, n_gen: int = 128,
                repetitions: int = 5, binary: str | None = None) -> list[dict]:
    """llama-bench's JSON records for one model file: pp and tg, tokens/s mean and std."""
    binary = binary or find_llama_bench()
    if binary is None:
        raise FileNotFoundError("llama-bench not found: set $LLAMA_BENCH or put it on PATH")
    cmd = [binary, "-m", str(path), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-r", str(repetitions), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return [{"test": f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}",
             "mean_ts": float(r["avg_ts"]), "std_ts": float(r["stddev_ts"]),
             "samples": [float(s) for s in r.get("samples_ts", [])]}
            for r in json.loads(out)]
