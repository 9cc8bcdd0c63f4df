"""The C kernels' prefetch distance: measured once per CPU model and build, cached, never a
change to any result."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from edgellm.backends import available_backends, get_backend
from edgellm.backends.cpu import calibrate
from edgellm.quants import Q
from tests.test_backend_conformance import random_tensor


@pytest.fixture
def native():
    if "cpu" not in available_backends():
        pytest.skip("no CPU backend")
    backend = get_backend("cpu", kernels="auto")
    if backend.native is None:
        pytest.skip("no C kernels here")
    return backend.native


def test_the_measurement_is_cached_and_leaves_the_build_only_for_a_clear_win(
        native, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("EDGELLM_PREFETCH_AHEAD", raising=False)
    monkeypatch.setattr(calibrate, "_this_process", {})
    build = native.lib.ek_prefetch_ahead()
    calls = []
    timings = {**{d: 1.3 for d in calibrate.CANDIDATES}, build: 1.0, 2048: 0.9}
    monkeypatch.setattr(calibrate, "time_prefetch_distances",
                        lambda lib, threads: calls.append(threads) or dict(timings))
    assert calibrate.prefetch_distance(native, "x", 2) == 2048  # 10% faster than the build's
    assert calibrate.prefetch_distance(native, "x", 2) == 2048
    assert calls == [2]  # the second answer came from the cache
    saved = json.loads((tmp_path / "edgellm" / "native" / calibrate.CACHE_FILE).read_text())
    assert list(saved.values()) == [2048] and "x | 2 threads" in next(iter(saved))
    timings[2048] = 0.97  # within the margin: noise on a shared machine, not a reason to move
    assert calibrate.prefetch_distance(native, "x", 1) == build
    calibrate._this_process.clear()  # a new process reads the file
    assert calibrate.prefetch_distance(native, "x", 1) == build
    assert calls == [2, 1]
    monkeypatch.setenv("EDGELLM_PREFETCH_AHEAD", "3000")
    assert calibrate.prefetch_distance(native, "x", 2) == 3000
    monkeypatch.setenv("EDGELLM_PREFETCH_AHEAD", "far")
    with pytest.raises(ValueError, match="EDGELLM_PREFETCH_AHEAD"):
        calibrate.prefetch_distance(native, "x", 2)


def test_the_measurement_times_every_candidate_and_restores_the_distance(native):
    native.lib.ek_set_prefetch_ahead(2048)
    times = calibrate.time_prefetch_distances(native, 2)
    assert sorted(times) == sorted({*calibrate.CANDIDATES, 2048})
    assert all(0 < t < 5 and math.isfinite(t) for t in times.values())
    assert native.lib.ek_prefetch_ahead() == 2048


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0], ids=lambda q: q.name)
def test_results_do_not_depend_on_the_distance(native, qtype):
    backend = get_backend("cpu", kernels="c", threads=2)
    w = backend.prepare(random_tensor(qtype, 16 * 40, 512, seed=3))
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    before = native.lib.ek_prefetch_ahead()
    try:
        outs = []
        for distance in (0, 1024, 65536):
            native.lib.ek_set_prefetch_ahead(distance)
            outs.append(np.concatenate([backend.matmul(x, w), backend.matmul(x[:1], w)]))
    finally:
        native.lib.ek_set_prefetch_ahead(before)
    for out in outs[1:]:
        assert np.array_equal(out.view(np.uint32), outs[0].view(np.uint32))
