"""`edgellm bench`: it names the CPU kernels it ran, measures this machine's memory bandwidth
and reports decode's share of it; $EDGELLM_ISA forces a variant or fails in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from edgellm import bench
from edgellm.backends import available_backends
from edgellm.native import cpu_kernels

pytestmark = pytest.mark.skipif("cpu" not in available_backends(), reason="no cpu backend")


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgellm.apps.cli", *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_bench_names_the_kernels_and_the_memory_bandwidth(model_path):
    model_path("gemma-3-270m")
    records = bench.bench_model("gemma-3-270m", "cpu", 2, n_prompt=8, n_gen=4, repetitions=1)
    want = cpu_kernels.best_variant() or "numba"
    assert [r.backend for r in records] == [f"cpu/{want}"] * 2
    # two cores of any laptop or server stream well over 1 GB/s and under 1 TB/s
    assert all(1e9 < r.peak_bandwidth < 1e12 for r in records)
    tg = records[1]
    assert tg.test == "tg4" and 0 < tg.bandwidth_share == tg.bandwidth / tg.peak_bandwidth


def test_bench_table_has_the_bandwidth_columns(model_path):
    model_path("gemma-3-270m")
    result = run_cli("bench", "-m", "gemma-3-270m", "-p", "0", "-n", "4", "-r", "1")
    assert result.returncode == 0, result.stderr
    header, _, row = result.stdout.strip().splitlines()[-3:]
    cells = dict(zip((c.strip() for c in header.split("|")), (c.strip() for c in row.split("|")),
                     strict=True))
    assert cells["backend"].startswith("cpu/")
    assert float(cells["memory GB/s"]) > 1.0
    assert cells["% of memory BW"].endswith("%")


@pytest.mark.parametrize("isa", ["pentium", "avx512vnni", "neon"])
def test_isa_the_cpu_cannot_run_is_one_clear_error(model_path, isa):
    if isa in cpu_kernels.runnable_variants():
        pytest.skip(f"this CPU runs {isa}")
    model_path("gemma-3-270m")
    result = run_cli("bench", "-m", "gemma-3-270m", "-p", "0", "-n", "2", "-r", "1",
                     EDGELLM_ISA=isa)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"EDGELLM_ISA={isa}" in lines[0] and "choose one of" in lines[0]


def test_isa_forces_each_variant_this_cpu_runs(monkeypatch):
    from edgellm.backends.cpu.backend import CpuBackend

    for isa in [*cpu_kernels.runnable_variants(), "numba"]:
        monkeypatch.setenv(cpu_kernels.ISA_ENV, isa)
        assert CpuBackend(threads=1).variant == isa


def test_bandwidth_probe_leaves_no_thread_spinning():
    """numpy's BLAS threads spin for more work ~0.1 s after a call: a decode timed then shared
    its cores with them. The probe returns only once they sleep, so the process burns next to
    no CPU time while it idles right after."""
    bench.cpu_stream_bandwidth(2)
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(0.05)
    spun = time.process_time() - cpu
    assert spun < 0.2 * (time.perf_counter() - wall), f"{spun * 1e3:.0f} ms of CPU while idle"
