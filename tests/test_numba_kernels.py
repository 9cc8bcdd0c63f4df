"""The Numba path's repacked weights (backends/cpu/numba_packed.py): the activations rounded
exactly as llama.cpp rounds them, the integer kernels against that rounding, a token's result
the same alone or in a batch and on any number of threads, tied embedding lookups from the
repacked table, and the generic (non-AVX2) vector code in a process compiled for a plain
x86-64. Every op is also run by tests/test_backend_conformance.py (``-k numba``)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("numba")

from edgellm.backends import get_backend  # noqa: E402
from edgellm.backends.cpu import numba_packed as npk  # noqa: E402
from edgellm.backends.cpu.numba_pool import MatvecPool  # noqa: E402
from edgellm.backends.numpy_backend import round_activations_like_ggml  # noqa: E402
from edgellm.quants import Q, dequantize  # noqa: E402
from tests.test_backend_conformance import random_tensor  # noqa: E402

TYPES = sorted(npk.PACKED_TYPES, key=int)


def awkward_activations(n: int, cols: int, seed: int = 0) -> np.ndarray:
    """(n, cols) f32 with the cases rounding trips on: an all-zero block, a block of tiny
    values (an f16-subnormal scale), exact .5 steps (ties), one outsized token."""
    x = np.random.default_rng(seed).standard_normal((n, cols)).astype(np.float32)
    x[0, :32] = 0.0
    x[0, 32:64] *= 1e-6
    x[-1, 64:96] = np.arange(32, dtype=np.float32) - 15.5  # amax 16.5: many x * 127/amax ties
    x[n // 2] *= 40.0
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_activations_rounded_as_the_reference(qtype):
    """xq * xd equals the numpy reference's llama.cpp rounding (Q8_0 per 32 with f16 scales,
    Q8_K per 256) bit for bit, and the block sums are the sums of xq."""
    x = awkward_activations(5, 512)
    xq, xd, xs16, xs32 = npk.quantize_activations(x, qtype)
    block = npk.packed_block(qtype)
    got = (xq.reshape(5, -1, block).astype(np.float32) * xd[..., None]).reshape(5, 512)
    assert np.array_equal(got, round_activations_like_ggml(x, qtype))
    assert np.array_equal(xs32, xq.reshape(5, -1, 32).sum(-1, dtype=np.int32))
    if xs16 is not None:
        assert np.array_equal(xs16, xq.reshape(5, -1, 16).sum(-1, dtype=np.int32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_packed_matvec_against_the_reference(qtype):
    """The integer kernels equal the f32 product of the rounded activations with the
    dequantized weights up to f32 summation order; rows back from the planes are exact."""
    rows, cols = 77, 768 if qtype in (Q.Q4_K, Q.Q6_K) else 800
    tensor = random_tensor(qtype, rows, cols, seed=5)
    w = dequantize(tensor.data, qtype).reshape(rows, cols)
    packed = npk.allocate(qtype, rows, cols)
    npk.pack_rows(packed, tensor.data[:40], 0)  # in two slices, as the backend packs
    npk.pack_rows(packed, tensor.data[40:], 40)
    back = np.empty((rows, cols), dtype=np.float32)
    npk.dequantize_rows(packed, np.arange(rows, dtype=np.int64), back)
    assert np.array_equal(back, w)
    x = awkward_activations(3, cols, seed=1)
    want = round_activations_like_ggml(x, qtype).astype(np.float64) @ w.T.astype(np.float64)
    got = npk.matvec(packed, x, MatvecPool(2))
    scale = np.abs(round_activations_like_ggml(x, qtype)) @ np.abs(w).T
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_packed_matvec_same_alone_batched_and_on_any_threads(qtype):
    """A token's result is bit-identical alone, in a batch of 2..8 (speculative checks rely on
    it) and on 1, 2 or 3 threads (more than this machine's cores: helpers that wake late)."""
    tensor = random_tensor(qtype, 131, 512, seed=11)
    packed = npk.allocate(qtype, 131, 512)
    npk.pack_rows(packed, tensor.data, 0)
    x = awkward_activations(8, 512, seed=2)
    pools = [MatvecPool(t) for t in (1, 2, 3)]
    alone = np.concatenate([npk.matvec(packed, x[i:i + 1], pools[0]) for i in range(8)])
    for pool in pools:
        for k in range(1, 9):
            got = npk.matvec(packed, x[:k], pool)
            assert np.array_equal(got.view(np.uint32), alone[:k].view(np.uint32)), (pool, k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_backend_decodes_from_planes_and_looks_up_tied_rows(qtype):
    """Through the backend: a tied table is repacked once (the planes serve the output matmul
    and the lookups, which give the file's rows exactly); decode and a prompt-sized batch agree
    with the reference's rounding."""
    b = get_backend("cpu", kernels="numba")
    tensor = random_tensor(qtype, 45, 512, seed=7)
    table = b.prepare_embedding(tensor)
    output = b.prepare(tensor)
    assert output is table and output.planes is not None
    ids = np.array([0, 44, 17, 16, 15, 17])
    want = dequantize(tensor.data[ids], qtype).reshape(len(ids), 512)
    assert np.array_equal(b.embed(table, ids), want)
    with pytest.raises(IndexError):
        b.embed(table, np.array([45]))
    w = dequantize(tensor.data, qtype).reshape(45, 512)
    x = awkward_activations(12, 512, seed=3)
    ref = round_activations_like_ggml(x, qtype) @ w.T
    scale = np.abs(round_activations_like_ggml(x, qtype)) @ np.abs(w).T
    for n in (1, 8, 12):  # mat-vec (n <= 8) and the tiles + BLAS of a prompt
        assert np.all(np.abs(b.matmul(x[:n], output) - ref[:n]) <= 1e-5 * scale[:n] + 1e-6), n


GENERIC_CHECK = """
import numpy as np
from edgellm.backends.cpu import numba_packed as npk, numba_simd
from edgellm.backends.cpu.numba_pool import MatvecPool
from edgellm.backends.numpy_backend import round_activations_like_ggml
from edgellm.quants import dequantize
from tests.test_backend_conformance import random_tensor
from numba.core.registry import cpu_target
assert not numba_simd._has_avx2(cpu_target.target_context), "not the generic code"
for qtype in sorted(npk.PACKED_TYPES, key=int):
    tensor = random_tensor(qtype, 37, 512, seed=3)
    packed = npk.allocate(qtype, 37, 512)
    npk.pack_rows(packed, tensor.data, 0)
    w = dequantize(tensor.data, qtype).reshape(37, 512)
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    xr = round_activations_like_ggml(x, qtype)
    got = npk.matvec(packed, x, MatvecPool(2))
    assert np.all(np.abs(got - xr @ w.T) <= 1e-5 * (np.abs(xr) @ np.abs(w).T) + 1e-6), qtype
print("generic ok")
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 only")
def test_generic_vector_code_without_avx2(tmp_path):
    """The kernels' generic LLVM vector IR (what ARM and pre-AVX2 CPUs run), compiled for a
    plain x86-64 in a fresh process and cache, against the reference."""
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES="-avx2",
               NUMBA_CACHE_DIR=str(tmp_path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", GENERIC_CHECK], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "generic ok" in done.stdout, done.stderr[-3000:]
