"""Every triton kernel of the torch backend against the numpy reference, at small shapes.

Without CUDA they run in triton's interpreter (``TRITON_INTERPRET=1``, set before triton is
first imported) on CPU tensors; with CUDA on the GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from edgellm.backends.numpy_backend import NumpyBackend, round_activations_like_ggml  # noqa: E402
from edgellm.backends.torch import kernels  # noqa: E402
from edgellm.backends.torch.backend import round_activations_torch  # noqa: E402
from edgellm.backends.torch.packing import KINDS, dequantize_planes, pack  # noqa: E402
from edgellm.quants import Q, dequantize  # noqa: E402
from tests.test_backend_conformance import random_tensor  # noqa: E402

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET could be set", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REF = NumpyBackend()
TYPES = list(KINDS)


def uploaded(tensor, rows, cols):
    p = pack(tensor.data, tensor.qtype, rows, cols)
    for key, a in p.arrays().items():
        setattr(p, key, torch.from_numpy(a).to(DEVICE))
    return p


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_repacking_is_exact(qtype):
    cols = 96 if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 512
    tensor = random_tensor(qtype, 9, cols, seed=3)
    want = dequantize(tensor.data, qtype).reshape(9, cols)
    assert np.array_equal(dequantize_planes(pack(tensor.data, qtype, 9, cols)), want)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_qmatvec(qtype, n):
    rows, cols = 37, (512 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 224)
    tensor = random_tensor(qtype, rows, cols, seed=n)
    w = dequantize(tensor.data, qtype).reshape(rows, cols)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    bias = np.linspace(-1, 1, rows, dtype=np.float32)
    got = kernels.qmatvec(t(x), uploaded(tensor, rows, cols), t(bias)).cpu().numpy()
    np.testing.assert_allclose(got, x @ w.T + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_and_gather(qtype):
    rows, cols = 21, (256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 96)
    tensor = random_tensor(qtype, rows, cols, seed=5)
    w = dequantize(tensor.data, qtype).reshape(rows, cols)
    p = uploaded(tensor, rows, cols)
    assert np.array_equal(kernels.dequantize(p, torch.float32).cpu().numpy(), w)
    f16 = kernels.dequantize(p, torch.float16).cpu().numpy()
    assert np.array_equal(f16, w.astype(np.float16))
    ids = np.array([20, 0, 7, 7])
    got = kernels.dequantize(p, torch.float32, t(ids)).cpu().numpy()
    assert np.array_equal(got, w[ids])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_round_activations(qtype):
    x = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    x[1, 40] = -900.0  # an outsized activation sets its block's scale
    x[1, 300] = 700.0
    x[2, :256] = 0.0  # empty blocks
    block = 256 if qtype == Q.Q4_K else 32
    got = kernels.round_activations(t(x), block).cpu().numpy()
    assert np.array_equal(got, round_activations_like_ggml(x, qtype))
    assert np.array_equal(got, round_activations_torch(torch.from_numpy(x), block).numpy())


def test_rms_norm_rope_glu():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    got = kernels.rms_norm(t(x), t(w), 1e-6).cpu().numpy()
    np.testing.assert_allclose(got, REF.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    pos = np.arange(5, 8)
    for neox in (True, False):
        from edgellm.backends.numpy_backend import rope_angles

        cos, sin = rope_angles(pos, 64, 1e4, None, 1.0)
        got = kernels.rope(t(x), t(cos), t(sin), neox).cpu().numpy()
        np.testing.assert_allclose(got, REF.rope(x, pos, 1e4, neox), rtol=1e-5, atol=1e-5)
    g, u = (rng.standard_normal((3, 1500)).astype(np.float32) * 4 for _ in range(2))
    g[0, :4] = [-120.0, -88.0, 88.5, 120.0]
    np.testing.assert_allclose(kernels.glu(t(g), t(u), False).cpu().numpy(),
                               REF.silu_mul(g, u), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kernels.glu(t(g), t(u), True).cpu().numpy(),
                               REF.gelu_tanh_mul(g, u), rtol=1e-5, atol=1e-5)
