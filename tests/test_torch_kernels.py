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
from edgellm.backends.torch import kernels, tuning  # noqa: E402
from edgellm.backends.torch.backend import round_activations_torch  # noqa: E402
from edgellm.backends.torch.packing import K_QUANTS, KINDS, dequantize_planes, pack  # noqa: E402
from edgellm.quants import Q, dequantize  # noqa: E402
from tests.test_backend_conformance import random_tensor  # noqa: E402
from tests.test_torch_tuning import PickingTuner  # noqa: E402

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET could be set", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: fused kernels give the same bits as the separate launches (the interpreter's numpy)
EXACT = not torch.cuda.is_available()
REF = NumpyBackend()
TYPES = list(KINDS)


@pytest.fixture(autouse=True)
def _tuners_forgotten(monkeypatch):
    """Each test's tuner choices stay its own (kernels remembers a tuner per device)."""
    monkeypatch.setattr(tuning, "_by_device", {})


def _install(monkeypatch, device: str, tuner) -> None:
    """Make ``tuner`` the one kernels asks on ``device`` (none remembered from before)."""
    monkeypatch.setitem(tuning._tuners, tuning.device_key(device), tuner)
    monkeypatch.setattr(tuning, "_by_device", {})


def _launches(monkeypatch) -> list:
    """Every kernel launch from here on, as (kernel name, grid, constexprs and options),
    each still run."""
    launched: list = []
    launch = kernels._launch

    def recorded(kernel, grid, *args, **meta):
        launched.append((kernel.__name__, grid, meta))
        launch(kernel, grid, *args, **meta)
    monkeypatch.setattr(kernels, "_launch", recorded)
    return launched


def uploaded(tensor, rows, cols):
    return pack(tensor.data, tensor.qtype, rows, cols).upload(DEVICE)


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_repacking_is_exact(qtype):
    cols = 96 if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 512
    tensor = random_tensor(qtype, 9, cols, seed=3)
    want = dequantize(tensor.data, qtype).reshape(9, cols)
    assert np.array_equal(dequantize_planes(pack(tensor.data, qtype, 9, cols)), want)


def assert_is_product(got, x_rounded: np.ndarray, w: np.ndarray, bias=0.0, msg="") -> None:
    """``got`` is ``x_rounded @ w.T + bias`` to 1e-4 of each value, plus a float32 epsilon of
    the sum of the terms' magnitudes: a GPU sums the same terms in another order, so where
    they cancel (a value of 0.5 from terms of 15,000 in all) its result may differ from
    numpy's by more than 1e-4 (1.7e-4 on an H100), not by more than float32 can resolve.
    A wrong weight, scale or activation is off by about a term's size (tens to thousands)."""
    got = got.cpu().numpy() if hasattr(got, "cpu") else np.asarray(got)
    want = x_rounded.astype(np.float64) @ w.T.astype(np.float64) + bias
    terms = np.abs(x_rounded).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    bound = 1e-4 * np.abs(want) + float(np.finfo(np.float32).eps) * terms
    worst = np.argmax(np.abs(got - want) - bound)
    assert np.all(np.abs(got - want) <= bound), (
        f"{msg} at {np.unravel_index(worst, want.shape)}: {got.flat[worst]} against "
        f"{want.flat[worst]} (bound {bound.flat[worst]:.3g})")


def _check_qmatvec(qtype, rows: int, cols: int, x: np.ndarray, seed: int) -> None:
    """quantize_activations + qmatvec (+ a bias) against the rounded activations times the
    dequantized weights."""
    tensor = random_tensor(qtype, rows, cols, seed=seed)
    w = dequantize(tensor.data, qtype).reshape(rows, cols)
    bias = np.linspace(-1, 1, rows, dtype=np.float32)
    p = uploaded(tensor, rows, cols)
    xq, xd = kernels.quantize_activations(t(x), 256 if qtype in K_QUANTS else 32, p.padded)
    got = kernels.qmatvec(xq, xd, p, t(bias))
    assert_is_product(got, round_activations_like_ggml(x, qtype), w, bias)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_qmatvec(qtype, n):
    """The int8 mat-vec (dp4a on the GPU, byte arithmetic in the interpreter), padding (224
    columns: 3.5 chunks) and a partial tile of rows (37) included."""
    cols = 512 if qtype in K_QUANTS else 224
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    x[0, 5] = 40.0  # an outsized activation: its block's other values round coarsely
    _check_qmatvec(qtype, 37, cols, x, seed=n)


@pytest.mark.parametrize("tile", [(2, 8, 4), (4, 8, 4)])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda q: q.name)
def test_qmatvec_small_tiles(qtype, tile, monkeypatch):
    """The GPU's tiles for matrices of few rows (the interpreter otherwise runs the largest)."""
    monkeypatch.setitem(kernels.MATVEC_TILES, KINDS[qtype], tile)
    cols = 512 if qtype in K_QUANTS else 224
    x = np.random.default_rng(4).standard_normal((1, cols)).astype(np.float32)
    _check_qmatvec(qtype, 13, cols, x, seed=4)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
def test_qmatvec_split_k(qtype):
    """K split among programs (few rows, long rows: the last program of a row block adds
    the partial sums in split order), the bias added once, the counters reset."""
    cols = 4608
    assert cols // 64 >= kernels.SPLIT_MIN_CHUNKS  # rows long enough to be split
    x = np.random.default_rng(9).standard_normal((2, cols)).astype(np.float32)
    _check_qmatvec(qtype, 21, cols, x, seed=9)
    assert all(not c.any() for c in kernels._split_counters.values())


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3])
def test_pipelined_matvecs_equal_the_plain_loop(qtype, n, monkeypatch):
    """Rows of several steps (20 chunks: 8, 8 and 4 of them; 19.5 for 32-blocks) with each
    step's loads issued a step ahead (``_qmv_rows``' mode 1: a lone token's, with its
    activations; 3 tokens run the plain loop), against the
    product and, bit for bit, against the same kernels loading a step and then summing it
    (EDGELLM_MATVEC_PIPELINE=0): the mat-vec, with K split and not, and the gate+up GLU. A
    pipeline that summed a step with another step's weights or activations, or dropped
    one, fails."""
    from edgellm.backends.torch.packing import stack_rows

    cols = 1280 if qtype in K_QUANTS else 1248
    tensor = random_tensor(qtype, 26, cols, seed=n)
    w = dequantize(tensor.data, qtype).reshape(26, cols)
    p = uploaded(tensor, 26, cols)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    xq, xd = kernels.quantize_activations(t(x), 256 if qtype in K_QUANTS else 32, p.padded)
    halves = [uploaded(random_tensor(qtype, 13, cols, seed=n + i), 13, cols)
              for i in range(2)]
    stacked, _ = stack_rows(halves, torch.cat)

    def run() -> list:
        whole = kernels._qmatvec(xq, xd, p, None, (16, 8, 4, 0))
        split = kernels._qmatvec(xq, xd, p, None, (8, 4, 4, 2))  # 2 splits: 3, 2 steps
        glu, blocks = kernels.qmatvec_glu(xq, xd, stacked, False)
        return [whole, split, glu, *[b for size in sorted(blocks) for b in blocks[size]]]

    assert kernels.matvec_pipeline(1) == 1 and kernels.matvec_pipeline(n) == (1 if n == 1 else 0)
    results = {}
    monkeypatch.setattr(kernels, "_env_flags", {})  # (the mode read is kept there)
    for mode in ("1", "0"):
        monkeypatch.setenv("EDGELLM_MATVEC_PIPELINE", mode)
        kernels._env_flags.clear()
        assert kernels.matvec_pipeline(1) == int(mode)  # (read again: the mode runs)
        results[mode] = run()
    for got in results["1"][:2]:
        assert_is_product(got, round_activations_like_ggml(x, qtype), w)
    assert all(torch.equal(a, b) for a, b in zip(results["1"], results["0"], strict=True))
    assert all(not c.any() for c in kernels._split_counters.values())


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3])
def test_looping_matvecs_equal_a_program_a_block(qtype, n, monkeypatch):
    """Tiles that aim at fewer programs than there are row blocks (``matvec_grid``): each
    program loops over blocks i, i + programs, ... (asking L2 for the next one's weights)
    and gives, bit for bit, what a program a block gives: the mat-vec with its bias, the
    Q8_0 stack rotating Q and K, and the gate+up GLU with its 8-bit blocks (whose last
    program of each 256 outputs now may be any looping program). 1 token (the loads a step
    ahead) and 3."""
    from edgellm.backends.torch.packing import stack_rows

    monkeypatch.setattr(kernels, "_multiprocessors", lambda device: 1)
    # 5 blocks of 16 rows on 2 programs; the GLU's 17 (two of 256 outputs) on 2
    cols, rows, F = 512, 80, 272
    assert kernels.matvec_grid(rows, cols // 64, (16, 8, 4, 2), torch.device(DEVICE)) == (
        2, 1, 8)
    p = uploaded(random_tensor(qtype, rows, cols, seed=n), rows, cols)
    halves = [uploaded(random_tensor(qtype, F, cols, seed=n + i), F, cols) for i in (1, 2)]
    stacked, _ = stack_rows(halves, torch.cat)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    xq, xd = kernels.quantize_activations(t(x), 256 if qtype in K_QUANTS else 32, p.padded)
    bias = t(rng.standard_normal(rows).astype(np.float32))
    angles = (np.arange(n) + 3.0)[:, None] * 10000.0 ** (-np.arange(0, 16, 2) / 16)
    rope = (t(np.cos(angles).astype(np.float32)), t(np.sin(angles).astype(np.float32)), 64,
            True)

    def run(per_sm: int) -> list:
        tile = (16, 8, 4, per_sm)
        monkeypatch.setitem(kernels.MATVEC_TILES, KINDS[qtype], tile)
        glu, blocks = kernels.qmatvec_glu(xq, xd, stacked, False)
        return [kernels._qmatvec(xq, xd, p, bias, tile),
                kernels._qmatvec(xq, xd, p, bias, tile, rope if qtype == Q.Q8_0 else None),
                glu, *[b for size in sorted(blocks) for b in blocks[size]]]

    launched = _launches(monkeypatch)
    looped, apart = run(2), run(0)
    assert [(name, grid, meta.get("LOOP")) for name, grid, meta in launched
            if name != "_quantize_kernel"] == [
        ("_qmv_glu_kernel", (2,), True), ("_qmv_kernel", (2, 1), True),
        ("_qmv_kernel", (2, 1), True), ("_qmv_glu_kernel", (17,), False),
        ("_qmv_kernel", (5, 1), False), ("_qmv_kernel", (5, 1), False)]
    if EXACT:
        assert all(torch.equal(a, b) for a, b in zip(looped, apart, strict=True))
    else:
        for a, b in zip(looped, apart, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * b.abs().max().item())
    assert all(not c.any() for c in kernels._split_counters.values())


@pytest.mark.parametrize("loops", ["1", "0"], ids=["loops", "no-loops"])
def test_looping_tiles_are_timed_for_matrices_of_many_rows(loops, monkeypatch):
    """Matrices of LOOP_MIN_ROWS rows or more (here lowered to 64) are timed in looping
    tiles too (after the others), and the one kept runs and computes the product;
    EDGELLM_MATVEC_LOOPS=0 times none of them, under a key of its own (an A/B)."""
    monkeypatch.setattr(kernels, "LOOP_MIN_ROWS", 64)
    monkeypatch.setattr(kernels, "_env_flags", {})
    monkeypatch.setattr(kernels, "_multiprocessors", lambda device: 1)
    monkeypatch.setenv("EDGELLM_MATVEC_LOOPS", loops)
    rows, cols = 80, 512  # 5 blocks of 16 rows: a looping tile's 4 programs loop
    tensor = random_tensor(Q.Q4_K, rows, cols, seed=3)
    w = dequantize(tensor.data, Q.Q4_K).reshape(rows, cols)
    p = uploaded(tensor, rows, cols)
    x = np.random.default_rng(3).standard_normal((1, cols)).astype(np.float32)
    xq, xd = kernels.quantize_activations(t(x), 256, p.padded)
    candidates = kernels.matvec_candidates(cols // 64, loops == "1")
    plain = kernels.matvec_candidates(cols // 64)
    assert candidates[:len(plain)] == plain and all(c[3] == 0 for c in plain)
    assert [c[3] > 0 for c in candidates[len(plain):]] == [True] * 4 * (loops == "1")
    scripted = PickingTuner(len(candidates) - 1, launch_all=False)
    _install(monkeypatch, str(xq.device), scripted)
    launched = _launches(monkeypatch)
    assert_is_product(kernels.qmatvec(xq, xd, p), round_activations_like_ggml(x, Q.Q4_K), w)
    key = f"matvec:{KINDS[Q.Q4_K]}:{rows}:{cols // 64}" + ("" if loops == "1" else ":unlooped")
    assert scripted._choices == {key: candidates[-1]}
    _, grid, meta = launched[-1]
    assert (grid, meta["LOOP"]) == (((4, 1), True) if loops == "1" else ((3, 1), False))


@pytest.mark.parametrize("qtype,rows,cols", [(Q.Q4_K, 5, 1536), (Q.Q5_0, 9, 640),
                                             (Q.Q6_K, 3, 4096)], ids=["q4k", "q50", "q6k-split"])
def test_every_matvec_candidate_computes_the_product(qtype, rows, cols, monkeypatch):
    """Each tile a GPU may time and keep (one pass over K or steps of it, split K or not),
    and qmatvec runs the one the tuner keeps for the shape."""
    n_chunks = cols // 64
    candidates = kernels.matvec_candidates(n_chunks)
    assert len(set(candidates)) == len(candidates)
    if n_chunks < kernels.SPLIT_MIN_CHUNKS:  # the one-pass tile is among them
        assert any(ch >= n_chunks for _, ch, _, _ in candidates)
    tensor = random_tensor(qtype, rows, cols, seed=rows)
    w = dequantize(tensor.data, qtype).reshape(rows, cols)
    p = uploaded(tensor, rows, cols)
    x = np.random.default_rng(rows).standard_normal((2, cols)).astype(np.float32)
    xq, xd = kernels.quantize_activations(t(x), 256 if qtype in K_QUANTS else 32, p.padded)
    x_rounded = round_activations_like_ggml(x, qtype)
    for tile in candidates:
        assert_is_product(kernels._qmatvec(xq, xd, p, None, tile), x_rounded, w, msg=str(tile))
    scripted = PickingTuner(len(candidates) - 1)
    _install(monkeypatch, str(xq.device), scripted)
    assert_is_product(kernels.qmatvec(xq, xd, p), x_rounded, w)
    assert scripted.timed == list(range(len(candidates)))
    key = f"matvec:{KINDS[qtype]}:{rows}:{n_chunks}"
    assert scripted._choices == {key: candidates[-1]}
    assert all(not c.any() for c in kernels._split_counters.values())


def test_prompt_matmul_runs_the_tuners_choice(monkeypatch):
    """Every prompt GEMM a GPU may time (dequantize + torch's GEMM, the fused kernel in each
    of its tiles) gives the product, and with a tuner prompt_matmul keeps the fastest."""
    rows, cols, M = 70, 512, 12
    tensor = random_tensor(Q.Q4_K, rows, cols, seed=8)
    w = dequantize(tensor.data, Q.Q4_K).reshape(rows, cols).astype(np.float16)
    p = uploaded(tensor, rows, cols)
    x = np.random.default_rng(8).standard_normal((M, cols)).astype(np.float16)
    bias = np.linspace(-1, 1, rows, dtype=np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T + bias
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32  # the backend's GEMM dtype
    xg = t(x).to(dtype)
    for i, choice in enumerate(kernels.GEMM_CANDIDATES):
        scripted = PickingTuner(i)
        _install(monkeypatch, str(xg.device), scripted)
        got = kernels.prompt_matmul(xg, p, t(bias))
        assert got.dtype == torch.float32
        assert np.abs(got.cpu().numpy() - want).max() <= 1e-3 * np.abs(want).max(), choice
        assert scripted._choices == {f"gemm:5:{rows}:{cols}:16": choice}
    monkeypatch.delitem(tuning._tuners, str(xg.device))
    monkeypatch.setattr(tuning, "_by_device", {})
    if DEVICE == "cpu":  # nothing is timed without a GPU: the GEMM runs
        assert tuning.tuner_for(xg.device) is None


def test_one_tuner_per_card_saved_under_edgellm_home(tmp_path, monkeypatch):
    """tuner_for on a GPU (the CUDA queries stubbed): "cuda" and "cuda:0" share a tuner
    whose file is named after the card and whose version names card, triton, torch and the
    kernels; EDGELLM_TUNE=0 and the CPU get none."""
    monkeypatch.setattr(tuning, "_tuners", {})
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (9, 0))
    monkeypatch.setenv("EDGELLM_TUNE", "0")
    assert tuning.tuner_for(torch.device("cuda")) is None
    monkeypatch.delenv("EDGELLM_TUNE")
    tuner = tuning.tuner_for(torch.device("cuda"))
    assert tuning.tuner_for("cuda:0") is tuner
    assert tuner.path == tmp_path / "tuning" / "nvidia-h100-80gb-hbm3.json"
    assert tuner.version.startswith("NVIDIA H100 80GB HBM3 sm90 triton ")
    assert f"torch {torch.__version__}" in tuner.version
    assert tuning.tuner_for(torch.device("cpu")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times launches on a GPU: CUDA")
def test_tuning_times_on_the_gpu(tmp_path, monkeypatch):
    """The real timer (L2 flushed, median of launches) on the 1.5B's Q+K shape: a candidate
    is kept and saved, and qmatvec gives the default tile's product with it."""
    from edgellm.backends.torch.tuning import Tuner

    rows, cols = 1792, 1536
    tensor = random_tensor(Q.Q4_K, rows, cols, seed=1)
    p = uploaded(tensor, rows, cols)
    x = np.random.default_rng(1).standard_normal((1, cols)).astype(np.float32)
    xq, xd = kernels.quantize_activations(t(x), 256, p.padded)
    want = kernels._qmatvec(xq, xd, p, None, (*kernels.matvec_tile(rows, cols // 64), 0))
    tuner = Tuner(tmp_path / "gpu.json", "test")
    _install(monkeypatch, str(xq.device), tuner)
    got = kernels.qmatvec(xq, xd, p)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    (key, tile), = tuner._choices.items()
    assert tile in kernels.matvec_candidates(cols // 64) and tuner.seconds > 0
    assert (tmp_path / "gpu.json").is_file()


@pytest.mark.parametrize("qtype,F,cols,n", [(Q.Q4_K, 512, 512, 1), (Q.Q5_0, 320, 224, 3),
                                             (Q.Q8_0, 256, 96, 8)], ids=["q4k", "q50", "q80"])
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_qmatvec_glu_is_matvec_then_quantized_glu(qtype, F, cols, n, gelu):
    """The gate+up mat-vec with the GLU and the down projection's 8-bit blocks in one
    launch, against qmatvec of the stack then then_quantize of its halves (F not a multiple
    of 256: the last block's counter counts fewer programs), counters reset. The same bits
    in the interpreter. On a GPU the two kernels order and contract their sums their own
    way (on an H200 up to 3e-5 of an element's own size, 496 ulps), so there the outputs
    agree within 1e-4 of the largest (a missing chunk or row is far more), and the blocks
    are exactly those of the fused kernel's own output (what the down projection reads)."""
    from edgellm.backends.torch.packing import stack_rows

    parts = [uploaded(random_tensor(qtype, F, cols, seed=F + i), F, cols) for i in range(2)]
    stacked, _ = stack_rows(parts, torch.cat)
    x = np.random.default_rng(F).standard_normal((n, cols)).astype(np.float32)
    xq, xd = kernels.quantize_activations(t(x), 256 if qtype in K_QUANTS else 32,
                                          stacked.padded)
    got, got_blocks = kernels.qmatvec_glu(xq, xd, stacked, gelu)
    both = kernels.qmatvec(xq, xd, stacked)
    want, want_blocks = kernels.then_quantize("gelu" if gelu else "silu",
                                              both[:, :F].contiguous(), both[:, F:].contiguous())
    assert got_blocks.keys() == want_blocks.keys() == ({32, 256} if F % 256 == 0 else {32})
    if EXACT:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
        want_blocks = {size: kernels.quantize_activations(got, size, blocks[0].shape[1] * 4)
                       for size, blocks in got_blocks.items()}
    for block in want_blocks:
        assert all(torch.equal(a, b) for a, b in zip(got_blocks[block], want_blocks[block],
                                                     strict=True))
    assert all(not c.any() for c in kernels._split_counters.values())


@pytest.mark.parametrize("qa,qb,n", [(Q.Q4_K, Q.Q6_K, 1), (Q.Q5_0, Q.Q8_0, 3),
                                     (Q.Q6_K, Q.Q4_K, 8)], ids=["q4k+q6k", "q50+q80", "q6k+q4k"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_qmatvec_joined_is_each_matrixs_matvec(qa, qb, n, with_bias, monkeypatch):
    """Two matrices of different block types in one launch (A's row blocks, then B's; 48
    and 40 rows in tiles of 16: each part's last block partial) give each matrix's own
    qmatvec in the same tile, B's rows after A's, each with its own bias. The same bits in
    the interpreter; on a GPU the two kernels may contract their sums their own way (as
    the GLU's test says), so within 1e-4 of the largest."""
    cols = 512
    for q in (qa, qb):
        monkeypatch.setitem(kernels.MATVEC_TILES, KINDS[q], (16, 8, 4))
    a, b = (uploaded(random_tensor(q, rows, cols, seed=rows), rows, cols)
            for q, rows in ((qa, 48), (qb, 40)))
    assert kernels.joinable(a, b)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    xq, xd = kernels.quantize_activations(t(x), 256 if qa in K_QUANTS else 32, a.padded)
    bias = t(np.linspace(-2, 2, 88, dtype=np.float32)) if with_bias else None
    got = kernels.qmatvec_joined(xq, xd, a, b, bias)
    want = torch.cat([kernels._qmatvec(xq, xd, p, None if bias is None else bias[part],
                                       (16, 8, 4, 0))
                      for p, part in ((a, slice(0, 48)), (b, slice(48, 88)))], dim=1)
    assert got.shape == (n, 88)
    if EXACT:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "pairs"])
@pytest.mark.parametrize("n,bn", [(1, 64), (3, 4)], ids=["one-64", "three-4"])
def test_qmatvec_rotates_q_and_k(neox, n, bn, monkeypatch):
    """RoPE in the Q+K+V mat-vec's launch (``rope``) against the mat-vec, then
    ``rope_qk``: Q's 4 heads and K's 2 (of 16) rotated at each token's angles after their
    bias, V's 2 heads as they are; one stack of Q8_0 (``qmatvec``), and Q+K in Q4_K joined
    to V in Q6_K (``qmatvec_joined``). Tiles of 64 rows (a program across the rotated
    rows' end) and of 4 (NEOX: a program's two pairs each of rows 8 apart). The same bits
    in the interpreter; on a GPU within 1e-4 of the largest."""
    n_heads, n_kv_heads, hd = 4, 2, 16
    n_rot, rows, cols = (n_heads + n_kv_heads) * hd, (n_heads + 2 * n_kv_heads) * hd, 256
    for q in (Q.Q8_0, Q.Q4_K, Q.Q6_K):
        monkeypatch.setitem(kernels.MATVEC_TILES, KINDS[q], (bn, 8, 4))
    rng = np.random.default_rng(n)
    angles = (np.arange(n) + 5.0)[:, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    cos, sin = t(np.cos(angles).astype(np.float32)), t(np.sin(angles).astype(np.float32))
    bias = t(rng.standard_normal(rows).astype(np.float32))
    x = t(rng.standard_normal((n, cols)).astype(np.float32))

    def rotated(out):  # the mat-vec's output, then rope_qk's launch
        q, k = kernels.rope_qk(out[:, :n_heads * hd].reshape(n, n_heads, hd).contiguous(),
                               out[:, n_heads * hd:n_rot].reshape(n, n_kv_heads, hd)
                               .contiguous(), cos, sin, neox)
        return torch.cat([q.reshape(n, -1), k.reshape(n, -1), out[:, n_rot:]], dim=1)

    whole = uploaded(random_tensor(Q.Q8_0, rows, cols, seed=1), rows, cols)
    xq, xd = kernels.quantize_activations(x, 32, whole.padded)
    pairs = [(kernels.qmatvec(xq, xd, whole, bias, rope=(cos, sin, n_rot, neox)),
              rotated(kernels.qmatvec(xq, xd, whole, bias)))]
    a = uploaded(random_tensor(Q.Q4_K, n_rot, cols, seed=2), n_rot, cols)
    b = uploaded(random_tensor(Q.Q6_K, rows - n_rot, cols, seed=3), rows - n_rot, cols)
    xq, xd = kernels.quantize_activations(x, 256, a.padded)
    pairs.append((kernels.qmatvec_joined(xq, xd, a, b, bias, rope=(cos, sin, n_rot, neox)),
                  rotated(kernels.qmatvec_joined(xq, xd, a, b, bias))))
    for got, want in pairs:
        assert got.shape == (n, rows)
        assert not torch.equal(got[:, :n_rot], want[:, :n_rot] * 0)  # (something rotated)
        if EXACT:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())


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


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("M", [3, 70])  # one program's rows; more than a tile's 64
def test_dequantized_matmul(qtype, M):
    """The fused dequantize-GEMM (a prompt's matmul without a dequantized copy of W): x (f16)
    @ W.T + bias in f32 sums, against the f64 product of the same f16 values; 70 rows (a
    partial tile) and, for 32-blocks, K = 96 (half a 64-weight chunk past the last)."""
    rows, cols = 70, (512 if qtype in K_QUANTS else 96)
    tensor = random_tensor(qtype, rows, cols, seed=7)
    w = dequantize(tensor.data, qtype).reshape(rows, cols).astype(np.float16)
    x = np.random.default_rng(M).standard_normal((M, cols)).astype(np.float16)
    bias = np.linspace(-1, 1, rows, dtype=np.float32)
    got = kernels.dequantized_matmul(t(x), uploaded(tensor, rows, cols), t(bias))
    want = x.astype(np.float64) @ w.astype(np.float64).T + bias
    assert got.dtype == torch.float32 and got.shape == (M, rows)
    assert np.abs(got.cpu().numpy() - want).max() <= 1e-5 * np.abs(want).max()


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
    half = kernels.round_activations(t(x), block, torch.float16)  # a GEMM's input, cast once
    assert half.dtype == torch.float16
    assert np.array_equal(half.cpu().numpy(), got.astype(np.float16))
    xq, xd = kernels.quantize_activations(t(x), block, 576)  # padded: zeros past 512
    q = xq.view(torch.int8).cpu().numpy().astype(np.float32)
    d = np.repeat(xd.cpu().numpy(), 32, axis=1)
    assert np.array_equal((q * d)[:, :512], got)
    assert not q[:, 512:].any() and not d[:, 512:].any()


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


@pytest.mark.parametrize("heads,kv_heads,hd", [(7, 1, 64), (12, 2, 128), (4, 1, 256),
                                               (3, 3, 32), (40, 2, 64)])
@pytest.mark.parametrize("n,T,window,ring,softcap", [(1, 1, 0, False, 0.0),
                                                     (3, 50, 0, False, 30.0),
                                                     (1, 300, 40, False, 0.0),
                                                     (4, 100, 0, True, 30.0),
                                                     (1, 1300, 700, False, 0.0)])
def test_attention_split_kernels(heads, kv_heads, hd, n, T, window, ring, softcap):
    """Flash-decoding against the numpy reference over an f16 cache: one split and several
    (300 slots: 10; the last to finish combines them, and resets its counter; 1300: 41, of
    which the window hides the first 18, combined 16 at a time), GQA groups of 1..20,
    soft-capping, sliding windows (whole tiles masked) and ring slots out of position
    order."""
    q, k, v, mask = _attention_case(heads, kv_heads, hd, n, T, window, ring)
    got = kernels.attention(t(q), t(k), t(v), t(mask), hd ** -0.5, softcap).cpu().numpy()
    want = REF.attention(q, k, v, mask, hd ** -0.5, softcap)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert all(not c.any() for c in kernels._split_counters.values())


@pytest.mark.parametrize("heads,kv_heads,hd,n,T,dtype", [
    (7, 1, 64, 1, 300, "float16"), (12, 2, 128, 3, 50, "float16"),
    (4, 1, 256, 8, 100, "float16"), (3, 3, 32, 2, 40, "float32")])
def test_attention_writes_the_steps_keys_and_values(heads, kv_heads, hd, n, T, dtype):
    """attention(write=...): the step's keys and values stored at their slots (ring slots
    out of order, one past T: a graph's spare row) in the attention's launch; cache and
    output bit-identical to store_kv then attention."""
    rng = np.random.default_rng(T)
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    kn, vn = (rng.standard_normal((n, kv_heads, hd)).astype(np.float32) for _ in range(2))
    cache = [rng.standard_normal((T + 1, kv_heads, hd)).astype(dtype) for _ in range(2)]
    slots = np.array([7, 3, T - 1, 0, 12, 30, 1, T][-n:] if n > 1 else [T // 2])
    kpos = np.roll(np.arange(T), 5)
    mask = kpos[None, :] <= T - n + np.arange(n)[:, None]
    outs = []
    for fused in (False, True):
        keys, values = (t(c.copy()) for c in cache)  # (t shares a CPU array's memory)
        if fused:
            got = kernels.attention(t(q), keys[:T], values[:T], t(mask), hd ** -0.5,
                                    write=(t(slots), t(kn), t(vn)))
        else:
            kernels.store_kv(keys, values, t(slots), t(kn), t(vn))
            got = kernels.attention(t(q), keys[:T], values[:T], t(mask), hd ** -0.5)
        outs.append([x.cpu().numpy() for x in (got, keys, values)])
    for want, got in zip(*outs, strict=True):
        assert np.array_equal(got, want)
    assert not np.array_equal(outs[1][1], cache[0])  # (the slots were written)
    assert all(not c.any() for c in kernels._split_counters.values())


@pytest.mark.parametrize("heads,kv_heads,hd,n,T,dtype", [
    (12, 2, 128, 3, 45, "float16"),  # the 1.5B's heads
    (4, 1, 256, 2, 30, "float16"),  # Gemma's
    (4, 2, 16, 8, 70, "float32")])  # a batch graph's most sequences
@pytest.mark.parametrize("quantize", [False, True], ids=["plain", "blocks"])
def test_attention_apart_is_each_row_alone_over_its_own_cache(heads, kv_heads, hd, n, T,
                                                              dtype, quantize):
    """attention(apart=...): each token another sequence's, over its own cache (separate
    tensors, at offsets either side of the first's), with its own count of slots used and
    its own new row written: the output, the blocks and every cache bit-identical to each
    row's attention alone (a batch graph's step: one launch for every sequence)."""
    _attention_apart_case(heads, kv_heads, hd, n, T, dtype, quantize)


@pytest.fixture
def splits_first(monkeypatch):
    """The interpreter runs a launch's programs every row's first split, then every row's
    second, and so on: an order a GPU may take (its programs run at once), which the
    interpreter's own (a row's splits, then the next row's) never does. In that one a row
    combines its splits before any other row's program runs, so a row writing partial
    results into another's goes unseen (an H200 saw it: rows 0.5-3.2 off their own)."""
    if DEVICE == "cuda":
        pytest.skip("a GPU's programs run at once: the tests above")
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    real = builder.set_grid_idx

    def set_grid_idx(x, y, z):  # the k-th program of the interpreter's order, split first
        nx, ny, nz = builder.grid_dim
        k = (x * ny + y) * nz + z
        real(k % (nx * ny) // ny, k % ny, k // (nx * ny))

    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)


def test_attention_apart_rows_of_other_split_counts_keep_their_own(splits_first):
    """attention(apart=...) with rows whose counts of slots used take 1 or 2 splits,
    run splits first (``splits_first``): each row's partial results lie in its own place
    (the grid's split count apart), and every row is bit-identical to its attention alone."""
    used = _attention_apart_case(4, 2, 16, 8, 70, "float32", True)
    assert len({-(-int(u) // kernels.split_slots(70)) for u in used}) > 1


def _attention_apart_case(heads, kv_heads, hd, n, T, dtype, quantize) -> np.ndarray:
    """attention(apart=...) over n caches against each row alone (asserted bit-identical);
    returns each row's count of slots used."""
    rng = np.random.default_rng(T + n)
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    kn, vn = (rng.standard_normal((n, kv_heads, hd)).astype(np.float32) for _ in range(2))
    caches = [[rng.standard_normal((T + 1, kv_heads, hd)).astype(dtype) for _ in range(2)]
              for _ in range(n)]
    used = rng.integers(1, T, size=n)
    slots = used - 1  # (each token's own new slot, the last it sees)
    masks = np.arange(T)[None, :] < used[:, None]
    masks[0, 0] = False  # (a hole: the mask, not the count, decides)
    alone, stores = [], [[t(c.copy()) for c in pair] for pair in caches]
    for j, (keys, values) in enumerate(stores):
        alone.append(kernels.attention(
            t(q[j:j + 1]), keys[:T], values[:T], t(masks[j:j + 1]), hd ** -0.5,
            quantize=quantize, write=(t(slots[j:j + 1]), t(kn[j:j + 1]), t(vn[j:j + 1])),
            span=t(used[j:j + 1])))
    together = [[t(c).clone() for c in pair] for pair in caches]  # (torch's allocations:
    # 64-byte aligned, as ``kernels.offsets`` requires; numpy's may not be)
    keys, values = ([pair[i] for pair in together] for i in (0, 1))
    apart = (kernels.offsets(keys, keys[0]), kernels.offsets(values, values[0]))
    assert apart[0].tolist()[0] == 0 and len(set(apart[0].tolist())) == n
    got = kernels.attention(t(q), keys[0][:T], values[0][:T], t(masks), hd ** -0.5,
                            quantize=quantize, write=(t(slots), t(kn), t(vn)),
                            span=t(used), apart=apart)
    rows = [_tensors(a) for a in alone]
    for got_part, *parts in zip(_tensors(got), *rows, strict=True):
        assert torch.equal(got_part, torch.cat(parts))
    for mine, theirs in zip(together, stores, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert all(not c.any() for c in kernels._split_counters.values())
    return used


def test_attention_apart_offsets_are_whole_alignments():
    """``kernels.offsets``: element distances the kernel may take as multiples of
    OFFSET_ALIGN (64 bytes); a cache off that alignment, or of another dtype, is refused
    (a batch graph's layer then attends a sequence at a time)."""
    base = torch.zeros(64)
    assert kernels.offsets([base, base[16:], base[48:]], base).tolist() == [0, 16, 48]
    for other in (base[1:], base[8:], torch.zeros(64, dtype=torch.float16)):
        with pytest.raises(ValueError):
            kernels.offsets([base, other], base)


@pytest.mark.parametrize("heads,kv_heads,hd,n,T,spare", [
    (12, 2, 128, 1, 45, 39),  # the 1.5B's heads: 2 splits over the slots used, 3 over storage
    (4, 1, 256, 1, 9, 200),  # Gemma's: 1 split and 7
    (4, 2, 16, 3, 70, 300),  # 3 tokens, 3 splits and 12
    (12, 2, 128, 1, 600, 1000)])  # 19 splits and 50: combined 16 at a time
@pytest.mark.parametrize("quantize", [False, True], ids=["plain", "blocks"])
def test_attention_ignores_storage_past_the_mask(heads, kv_heads, hd, n, T, spare, quantize):
    """The same bits over the T slots used as over a longer storage whose extra slots the
    mask hides (more splits, a wider combine): a CUDA graph attends over its cache's whole
    storage, an eager step over the slots used so far, and the two must agree (8-bit
    activations turn an ulp into a visible logit difference)."""
    q, k, v, mask = _attention_case(heads, kv_heads, hd, n, T + spare, 0, False)
    mask[:, T:] = False
    long = kernels.attention(t(q), t(k), t(v), t(mask), hd ** -0.5, quantize=quantize)
    short = kernels.attention(t(q), t(k[:T]), t(v[:T]), t(mask[:, :T].copy()), hd ** -0.5,
                              quantize=quantize)
    for got, want in zip(_tensors(long), _tensors(short), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("heads,kv_heads,hd,n,T,spare", [
    (12, 2, 128, 1, 45, 4051),  # a chat's first reply in a 4,096-slot cache: 2 splits
    (4, 2, 16, 3, 70, 300),  # 3 tokens
    (2, 1, 16, 1, 8000, 8400)])  # splits of 32 over the slots used, of 64 over storage
@pytest.mark.parametrize("quantize", [False, True], ids=["plain", "blocks"])
def test_attention_over_a_span_splits_the_slots_used(heads, kv_heads, hd, n, T, spare,
                                                     quantize):
    """With ``span`` (a graph step's count of leading slots the mask may show), attention
    over the whole storage splits the T slots used as attention over those alone does, so
    the bits are the same even where the storage alone would split otherwise; the
    programs past them return at once, leaving the counters at zero."""
    q, k, v, mask = _attention_case(heads, kv_heads, hd, n, T + spare, 0, False)
    mask[:, T:] = False
    span = t(np.array([T]))
    long = kernels.attention(t(q), t(k), t(v), t(mask), hd ** -0.5, quantize=quantize,
                             span=span)
    short = kernels.attention(t(q), t(k[:T]), t(v[:T]), t(mask[:, :T].copy()), hd ** -0.5,
                              quantize=quantize)
    for got, want in zip(_tensors(long), _tensors(short), strict=True):
        assert torch.equal(got, want)
    assert all(not c.any() for c in kernels._split_counters.values())


def test_attention_split_slots_match_the_kernel():
    """The host's split size (which sizes the grid) and the kernel's, at the thresholds."""
    for used, split in ((1, 32), (8192, 32), (8193, 64), (16384, 64), (16385, 128),
                        (65536, 256)):
        assert kernels.split_slots(used) == split
        assert -(-used // split) <= kernels.MAX_ATTENTION_SPLITS


def _tensors(result) -> list:
    """attention's output, then (quantize=True) its blocks' tensors, per block size."""
    if isinstance(result, torch.Tensor):
        return [result]
    out, blocks = result
    return [out, *(x for size in sorted(blocks) for x in blocks[size])]


def _attention_case(heads, kv_heads, hd, n, T, window, ring, seed=0, q_scale=1.0, roll=77):
    """Queries (n, heads, hd) f32, an f16 cache (T, kv_heads, hd) and the mask (n, T) of the
    last n positions: causal, within ``window``, over ring slots rolled out of order."""
    rng = np.random.default_rng(seed + T + heads)
    q = rng.standard_normal((n, heads, hd)).astype(np.float32) * q_scale
    k = rng.standard_normal((T, kv_heads, hd)).astype(np.float16)
    v = rng.standard_normal((T, kv_heads, hd)).astype(np.float16)
    qpos = np.arange(T - n, T)[:, None]
    kpos = np.arange(T)[None, :]
    if ring:
        kpos = np.roll(kpos, roll, axis=1)
    mask = (kpos <= qpos) & ((qpos - kpos < window) if window else True)
    return q, k, v, mask


def _prompt_case(heads, kv_heads, hd, n, T, window, ring, seed=0):
    """A prompt's case: larger queries (peaked softmaxes too)."""
    return _attention_case(heads, kv_heads, hd, n, T, window, ring, seed, q_scale=3.0, roll=37)


@pytest.mark.parametrize("heads,kv_heads,hd,n,T,window,ring", [
    (4, 1, 256, 40, 40, 0, False),  # Gemma 3's heads, a first prompt (causal, in place)
    (4, 1, 256, 21, 60, 16, True),  # a window over ring slots out of position order
    (12, 2, 128, 37, 50, 0, False),  # the 1.5B's: groups of 6, rows past the last tile
    (14, 2, 64, 9, 9, 0, False), (3, 3, 16, 70, 75, 0, False)])
@pytest.mark.parametrize("tile", [kernels.FLASH_TILES[0], (16, 16, 4)], ids=["default", "small"])
def test_flash_prompt_attention(heads, kv_heads, hd, n, T, window, ring, tile):
    """The prompt's flash attention (f16 parts of the f32 queries and probabilities on
    tensor cores against the f16 cache, f32 softmax) against the numpy reference: GQA,
    causal and windowed masks (tiles hidden from every row skipped), partial tiles."""
    q, k, v, mask = _prompt_case(heads, kv_heads, hd, n, T, window, ring)
    got = kernels.flash_prompt_attention(t(q), t(k), t(v), t(mask), hd ** -0.5, tile)
    want = REF.attention(q, k, v, mask, hd ** -0.5)
    np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-5, atol=1e-5)


def test_prompt_attention_runs_the_tuners_choice(monkeypatch):
    """A prompt's attention on the GPU path: the default (SDPA on a GPU, the explicit ops
    here) or the flash kernel in each of its tiles, as the tuner keeps; the same result."""
    from edgellm.backends.torch.backend import TorchBackend

    be = TorchBackend(device=DEVICE, triton=DEVICE == "cpu", graphs=False)
    q, k, v, mask = _prompt_case(4, 1, 256, 24, 30, 0, False, seed=3)
    want = REF.attention(q, k, v, mask, 0.0625)
    choices = ("default", *kernels.flash_tiles(256))  # (and the wide-head tiles)
    for i, choice in enumerate(choices):
        scripted = PickingTuner(i)
        _install(monkeypatch, str(be.device), scripted)
        got = be.attention(be.asarray(q), t(k), t(v), mask, 0.0625)
        np.testing.assert_allclose(be.to_numpy(got), want, rtol=1e-5, atol=1e-5)
        assert scripted._choices == {"attention:1:4:256:32:32": choice}
        assert len(scripted.timed) == len(choices)


@pytest.mark.parametrize("heads,kv_heads,hd,n,T", [(7, 1, 64, 1, 300), (12, 2, 128, 3, 50),
                                                   (4, 1, 256, 8, 100), (3, 3, 32, 2, 40)])
def test_attention_writes_the_output_projections_blocks(heads, kv_heads, hd, n, T):
    """``quantize=True``: the same output (``_same``), and its rows (n, H * hd) as the 8-bit
    blocks that quantize_activations makes of it, bit for bit (per 32; per 256 where H * hd allows:
    896, 1536, 1024 and 96 columns), written by the last head of each token to be combined
    (its counter reset too)."""
    rng = np.random.default_rng(hd + n)
    q = t(rng.standard_normal((n, heads, hd)).astype(np.float32))
    k = t(rng.standard_normal((T, kv_heads, hd)).astype(np.float16))
    v = t(rng.standard_normal((T, kv_heads, hd)).astype(np.float16))
    mask = t(np.arange(T)[None, :] <= np.arange(T - n, T)[:, None])
    plain = kernels.attention(q, k, v, mask, hd ** -0.5)
    out, blocks = kernels.attention(q, k, v, mask, hd ** -0.5, quantize=True)
    _same(out, plain, EXACT)
    K = heads * hd
    padded = -(-K // 64) * 64
    assert sorted(blocks) == ([32, 256] if K % 256 == 0 else [32])
    for block, (xq, xd) in blocks.items():
        wq, wd = kernels.quantize_activations(out.reshape(n, K), block, padded)
        assert torch.equal(xq, wq) and torch.equal(xd, wd)
    assert all(not c.any() for c in kernels._split_counters.values())


def test_store_kv():
    keys = torch.zeros((6, 2, 8), dtype=torch.float16, device=DEVICE)
    values = torch.zeros_like(keys)
    k = torch.randn((2, 2, 8), device=DEVICE)
    v = torch.randn((2, 2, 8), device=DEVICE)
    kernels.store_kv(keys, values, t(np.array([4, 1])), k, v)
    assert torch.equal(keys[4], k[0].half()) and torch.equal(keys[1], k[1].half())
    assert torch.equal(values[4], v[0].half()) and torch.equal(values[1], v[1].half())
    assert not keys[[0, 2, 3, 5]].any() and not values[[0, 2, 3, 5]].any()


@pytest.mark.parametrize("n,fused", [(1, False), (12, False), (12, True)])  # the mat-vec;
def test_matmuls_stack_neighbours_of_one_type(n, fused, monkeypatch):  # GEMM; fused GEMM
    """Q (Q4_K), K (Q4_K), V (Q6_K) with biases: Q and K become one stacked matrix whose
    rows Q's and K's planes then view (no second copy), V stays alone; the mat-vec runs the
    stack in one launch, a prompt's GEMMs (or fused dequantize-GEMMs, over the members'
    views) member by member; the results are those of separate matmuls."""
    from edgellm.backends.torch.backend import TorchBackend

    monkeypatch.setenv("EDGELLM_FUSED_GEMM", "1" if fused else "0")

    tensors = [random_tensor(q, rows, 512, seed=rows) for q, rows in
               ((Q.Q4_K, 48), (Q.Q4_K, 16), (Q.Q6_K, 16))]
    rng = np.random.default_rng(n)
    biases = [rng.standard_normal(t_.shape[0]).astype(np.float32) for t_ in tensors]
    x = rng.standard_normal((n, 512)).astype(np.float32)
    outs = []
    for stacked in (False, True):
        be = TorchBackend(device=DEVICE, triton=not torch.cuda.is_available())
        assert be.fused_gemm == fused
        ws = [be.prepare(t_) for t_ in tensors]
        bs = [be.asarray(b) for b in biases]
        if stacked:
            got = be.matmuls(be.asarray(x), ws, bs)
            (qk, _, members), (v, _, single) = next(iter(be._stacks.values()))[1]
            assert [m for m, _ in members] == ws[:2] and v is ws[2] and single is None
            base, end = qk.planes.q.data_ptr(), qk.planes.q.data_ptr() + qk.planes.q.nbytes
            assert all(base <= w.planes.q.data_ptr() < end for w in ws[:2])
        else:
            got = [be.matmul(be.asarray(x), w, b) for w, b in zip(ws, bs, strict=True)]
        outs.append([be.to_numpy(o) for o in got])
    for want, got in zip(*outs, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("unfused", ["", "join"], ids=["joined", "unfused"])
def test_matmuls_join_two_block_types_in_one_launch(unfused, monkeypatch):
    """Qwen's Q+K (Q4_K, stacked) and V (Q6_K) of one token with biases: one mat-vec
    launch for all three (``qmatvec_joined``), their activations quantized once, the
    results those of separate matmuls (the same bits in the interpreter);
    EDGELLM_UNFUSE=join: the stack's launch and V's. Two tokens too: the 2-8 token
    mat-vec joins alike."""
    from edgellm.backends.torch.backend import TorchBackend

    monkeypatch.setenv("EDGELLM_UNFUSE", unfused)
    tensors = [random_tensor(q, rows, 512, seed=rows) for q, rows in
               ((Q.Q4_K, 48), (Q.Q4_K, 16), (Q.Q6_K, 16))]
    rng = np.random.default_rng(5)
    biases = [rng.standard_normal(t_.shape[0]).astype(np.float32) for t_ in tensors]
    be = TorchBackend(device=DEVICE, triton=not torch.cuda.is_available())
    ws = [be.prepare(t_) for t_ in tensors]
    bs = [be.asarray(b) for b in biases]
    launches = _launches(monkeypatch)
    for n in (1, 2):
        x = be.asarray(rng.standard_normal((n, 512)).astype(np.float32))
        launches.clear()
        got = be.matmuls(x, ws, bs)
        launched = [name for name, _, _ in launches]
        mat_vecs = [name for name in launched if name.startswith("_qmv")]
        assert mat_vecs == (["_qmv_kernel", "_qmv_kernel"] if unfused
                            else ["_qmv_joined_kernel"])
        assert launched.count("_quantize_kernel") == 1
        want = [be.matmul(x, w, b) for w, b in zip(ws, bs, strict=True)]
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            if EXACT:
                assert torch.equal(g, w)
            else:
                torch.testing.assert_close(g, w, rtol=0, atol=1e-4 * w.abs().max().item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's workspace: CUDA")
def test_a_new_backend_allocates_nothing():
    """Making a CUDA backend allocates no device memory: its probe of cuBLAS's f32-output
    GEMM waits for the first prompt GEMM (a probe at load gave the default stream a cuBLAS
    workspace, 16 MiB on an H100, that the model's steps never used)."""
    from edgellm.backends.torch.backend import TorchBackend

    torch.cuda.synchronize()  # (run alone, no GEMM has made the default stream one yet)
    before = torch.cuda.memory_allocated()
    TorchBackend(device="cuda")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 2**20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's f32-output GEMM: CUDA")
def test_prefill_gemm_writes_f32_sums():
    """A prompt's GEMM (f16 tiles) writes its f32 sums (``torch.mm(.., out_dtype)``): f32
    out, no f16 rounding of them, so at least as close to the f64 product of the same f16
    inputs as the f16 GEMM then a cast, and the same within f16's half-ulp."""
    from edgellm.backends.torch.backend import TorchBackend

    be = TorchBackend(device="cuda", graphs=False)
    assert be.gemm_writes_f32(), "this torch's CUDA mm takes no out_dtype (torch >= 2.8)"
    tensor = random_tensor(Q.Q4_K, 96, 512, seed=5)
    w = be.prepare(tensor)
    x = np.random.default_rng(5).standard_normal((24, 512)).astype(np.float32)
    xa = kernels.round_activations(t(x), 256, torch.float16)
    got = be._multiply(xa, w, None)
    be._gemm_writes_f32 = False
    cast = be._multiply(xa, w, None)
    exact = xa.double() @ kernels.dequantize(w.planes, torch.float16).double().T
    assert got.dtype == torch.float32
    err, cast_err = ((o.double() - exact).abs().max().item() for o in (got, cast))
    assert err <= cast_err and err <= 1e-4 * exact.abs().max().item()
    torch.testing.assert_close(got, cast, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("op", ["norm", "silu", "gelu"])
@pytest.mark.parametrize("n,K", [(1, 512), (3, 896), (2, 640)])
def test_then_quantize_equals_the_two_launches(op, n, K):
    """A norm or GLU and its 8-bit blocks in one launch: bit-identical to rms_norm / glu and
    then quantize_activations (per 32 always, per 256 when K allows), padding included."""
    rng = np.random.default_rng(K + n)
    a = t(rng.standard_normal((n, K)).astype(np.float32) * 3)
    b = t(rng.standard_normal(K if op == "norm" else (n, K)).astype(np.float32))
    out, blocks = kernels.then_quantize(op, a, b, 1e-6)
    want = (kernels.rms_norm(a, b, 1e-6) if op == "norm" else kernels.glu(a, b, op == "gelu"))
    assert torch.equal(out, want)
    padded = -(-K // 64) * 64
    assert sorted(blocks) == ([32, 256] if K % 256 == 0 else [32])
    for block, (xq, xd) in blocks.items():
        wq, wd = kernels.quantize_activations(want, block, padded)
        assert torch.equal(xq, wq) and torch.equal(xd, wd)


def test_matmul_after_a_norm_uses_its_blocks(monkeypatch):
    """A mat-vec of a norm's output takes the blocks the norm wrote (no quantize launch):
    results equal the two-launch path's exactly; a later, different input quantizes again."""
    from edgellm.backends.torch.backend import TorchBackend

    tensor = random_tensor(Q.Q4_K, 24, 512, seed=2)
    rng = np.random.default_rng(2)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in ((1, 512), 512))
    outs = []
    for fused in (False, True):
        be = TorchBackend(device=DEVICE, triton=not torch.cuda.is_available())
        be.fuse_quantize = fused
        weight = be.prepare(tensor)
        normed = be.rms_norm(be.asarray(x), be.asarray(w), 1e-6)
        if fused:
            calls = []
            real = kernels.quantize_activations
            monkeypatch.setattr(kernels, "quantize_activations",
                                lambda *a, calls=calls, real=real: calls.append(1) or real(*a))
        outs.append(be.to_numpy(be.matmul(normed, weight)))
        if fused:
            assert not calls
            be.matmul(be.asarray(x), weight)  # not the norm's output
            assert calls
    np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_0], ids=lambda q: q.name)
def test_output_projection_takes_the_attentions_blocks(monkeypatch, qtype):
    """The output projection's mat-vec of attention's output, reshaped (n, H * hd) as the
    model does, takes the blocks attention wrote in its launch (per 256 against Q4_K, per
    32 against Q5_0): no quantize launch, the same result as with the launch fusions off;
    the prior output's blocks are not taken for another tensor of its shape."""
    from edgellm.backends.torch.backend import TorchBackend

    n, heads, kv_heads, hd, T = 2, 4, 2, 128, 40
    tensor = random_tensor(qtype, 24, heads * hd, seed=4)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    k, v = (rng.standard_normal((T, kv_heads, hd)).astype(np.float16) for _ in range(2))
    mask = np.arange(T)[None, :] <= np.arange(T - n, T)[:, None]
    outs = []
    for fused in (False, True):
        be = TorchBackend(device=DEVICE, triton=not torch.cuda.is_available())
        be.fuse_launches = fused
        weight = be.prepare(tensor)
        attn = be.attention(be.asarray(q), be.asarray(k), be.asarray(v), mask, hd ** -0.5)
        calls = []
        real = kernels.quantize_activations
        monkeypatch.setattr(kernels, "quantize_activations",
                            lambda *a, calls=calls, real=real: calls.append(1) or real(*a))
        outs.append(be.to_numpy(be.matmul(attn.reshape(n, heads * hd), weight)))
        assert len(calls) == (0 if fused else 1)
        be.matmul(attn.reshape(n, heads * hd).clone(), weight)  # same values, other memory
        assert len(calls) == (1 if fused else 2)
        monkeypatch.setattr(kernels, "quantize_activations", real)
    if EXACT:
        np.testing.assert_array_equal(outs[1], outs[0])
    else:  # attention's own output may move by ulps (its two compilations), and a value
        # may then round to the next 8-bit step: 1/127 of its block's peak at most
        np.testing.assert_allclose(outs[1], outs[0], atol=2e-2 * np.abs(outs[0]).max())


def _same(got, want, exact: bool) -> None:
    """Bit for bit in the interpreter (the same numpy arithmetic either way); on a GPU the
    compiler contracts a fused kernel's multiply-adds and orders its sums its own way, so
    within a few f32 ulps there."""
    if exact:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=4e-6)


@pytest.mark.parametrize("neox,norm", [(True, True), (False, False), (True, False)])
def test_rope_qk_equals_norms_then_ropes(neox, norm):
    """Queries and keys (their heads RMS-normalised first: Gemma 3's Q/K norms) rotated in
    one launch: the results of rms_norm and rope launched per tensor (bit for bit in the
    interpreter), and within f32 rounding of the numpy reference."""
    rng = np.random.default_rng(int(neox) + 2 * int(norm))
    n, H, kvh, hd = 3, 4, 2, 16
    q, k = (rng.standard_normal((n, heads, hd)).astype(np.float32) * 2 for heads in (H, kvh))
    qw, kw = (rng.standard_normal(hd).astype(np.float32) for _ in range(2))
    pos = np.array([0, 7, 300])
    angles = pos[:, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)[None, :]
    cos, sin = (t(f(angles).astype(np.float32)) for f in (np.cos, np.sin))
    norms = (t(qw), t(kw), 1e-6) if norm else None
    qo, ko = kernels.rope_qk(t(q), t(k), cos, sin, neox, norms)
    for x, w, got in ((q, qw, qo), (k, kw, ko)):
        x_t = kernels.rms_norm(t(x), t(w), 1e-6) if norm else t(x)
        _same(got, kernels.rope(x_t, cos, sin, neox), EXACT)
        ref = REF.rms_norm(x, w, 1e-6) if norm else x
        ref = REF.rope(ref, pos, 10000.0, neox)
        np.testing.assert_allclose(got.cpu().numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("post,norm,quantize,K", [
    (True, True, True, 512), (False, True, True, 96), (True, False, False, 512),
    (False, True, False, 1536), (True, True, False, 1100)])
def test_residual_equals_the_separate_launches(post, norm, quantize, K):
    """A sublayer's end in one launch (h's post-norm, the residual add, the next norm, its
    8-bit blocks): the results of the launches it replaces (bit for bit in the interpreter),
    close to numpy's, and the blocks exactly those of its own normed output."""
    rng = np.random.default_rng(K)
    n = 2
    x, h = (t(rng.standard_normal((n, K)).astype(np.float32) * 3) for _ in range(2))
    hw, w = (t(rng.standard_normal(K).astype(np.float32)) for _ in range(2))
    total, normed, blocks = kernels.residual(x, h, 1e-6, hw if post else None,
                                             w if norm else None, quantize)
    want = x + (kernels.rms_norm(h, hw, 1e-6) if post else h)
    _same(total, want, EXACT)
    ref_h = REF.rms_norm(h.cpu().numpy(), hw.cpu().numpy(), 1e-6) if post else h.cpu().numpy()
    ref = x.cpu().numpy() + ref_h
    np.testing.assert_allclose(total.cpu().numpy(), ref, rtol=1e-5, atol=1e-5)
    if not norm:
        assert normed is None and blocks is None
        return
    _same(normed, kernels.rms_norm(want, w, 1e-6), EXACT)
    np.testing.assert_allclose(normed.cpu().numpy(), REF.rms_norm(ref, w.cpu().numpy(), 1e-6),
                               rtol=1e-4, atol=1e-4)
    if not quantize:
        assert blocks is None
        return
    own = kernels.then_quantize("norm", total, w, 1e-6)[1]  # the blocks of these values
    assert sorted(blocks) == sorted(own)
    padded = -(-K // 64) * 64
    for block, (xq, xd) in blocks.items():
        wq, wd = kernels.quantize_activations(normed, block, padded)
        assert torch.equal(xq, wq) and torch.equal(xd, wd)
