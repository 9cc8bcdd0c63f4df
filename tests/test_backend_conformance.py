"""Every op of every available backend against the numpy reference, for every core quant type.

Weights are random blocks of each type (random bytes with sane f16 scales), so every bit of
every block layout is exercised; the reference dequantizes them with gguf-py's oracle.
Backends that quantize activations to int8 per 32 elements (as llama.cpp does) may differ by
at most the rounding of those activations: sum |w| * blockmax|x| / 254 per output.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgellm.backends import available_backends, get_backend
from edgellm.converters.gguf_reader import QTensor
from edgellm.quants import CORE_TYPES, GGML_QUANT_SIZES, Q, dequantize, quantize

# (name, options): every available backend, and the CPU backend's portable Numba kernels too
BACKENDS = [(name, {}) for name in available_backends()]
if "cpu" in available_backends():
    BACKENDS.append(("cpu", {"kernels": "numba"}))
REF = get_backend("numpy")
REF_GGML = get_backend("numpy-ggml")  # llama.cpp's CPU arithmetic (f16 rounding in attention)

# byte offsets of the f16 scale fields in each block (ggml-common.h)
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
              Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_tensor(qtype, rows: int, cols: int, seed: int = 0) -> QTensor:
    """A (rows, cols) tensor of random blocks of qtype (data: (rows, row_bytes) uint8)."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
        return QTensor("w", qtype, (rows, cols), raw.reshape(rows, -1))
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.uniform(0.001, 0.02, (rows, cols // bs)).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, cols // bs, 2)
    return QTensor("w", qtype, (rows, cols), raw.reshape(rows, -1))


def int8_activation_bound(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Largest error from rounding x (n, cols) to int8 per 32: (n, rows)."""
    n, cols = x.shape
    blockmax = np.abs(x).reshape(n, cols // 32, 32).max(-1, keepdims=True)
    step = np.broadcast_to(blockmax, (n, cols // 32, 32)).reshape(n, cols) / 254.0
    return step @ np.abs(w).T * 1.01 + 1e-4


def reference(backend):
    """The numpy reference in the backend's arithmetic: f32, or llama.cpp's CPU arithmetic
    for a backend that follows it (``ggml_numerics``: over an f16 cache, queries and
    probabilities rounded to f16 as ggml's f16 matmuls round them)."""
    return REF_GGML if backend.ggml_numerics else REF


@pytest.fixture(params=BACKENDS, ids=lambda p: "-".join([p[0], *p[1].values()]))
def backend(request):
    name, options = request.param
    return get_backend(name, **options)


@pytest.mark.parametrize("qtype", CORE_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols", [(77, 256), (300, 512)])
@pytest.mark.parametrize("n", [1, 3, 37, 130])
def test_matmul(backend, qtype, rows, cols, n):
    tensor = random_tensor(qtype, rows, cols, seed=rows + n)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    bias = np.random.default_rng(1).standard_normal(rows).astype(np.float32)
    w = dequantize(tensor.data, qtype).reshape(rows, cols)
    want = x @ w.T + bias
    got = backend.to_numpy(backend.matmul(backend.asarray(x), backend.prepare(tensor),
                                          backend.asarray(bias)))
    assert got.shape == (n, rows)
    assert np.all(np.abs(got - want) <= int8_activation_bound(w, x) + 1e-4 * np.abs(want))


@pytest.mark.parametrize("qtype", [q for q in CORE_TYPES if GGML_QUANT_SIZES[q][0] == 32],
                         ids=lambda q: q.name)
def test_matmul_ragged_prefill(backend, qtype):
    """Prefill shapes that fill no tile: 32 columns past a multiple of 64, 13 rows, 21 tokens."""
    tensor = random_tensor(qtype, 13, 96, seed=2)
    x = np.random.default_rng(3).standard_normal((21, 96)).astype(np.float32)
    w = dequantize(tensor.data, qtype).reshape(13, 96)
    got = backend.to_numpy(backend.matmul(backend.asarray(x), backend.prepare(tensor)))
    assert np.all(np.abs(got - x @ w.T) <= int8_activation_bound(w, x))


@pytest.mark.parametrize("qtype", CORE_TYPES, ids=lambda q: q.name)
def test_embed_and_tied_output(backend, qtype):
    tensor = random_tensor(qtype, 333, 256, seed=3)
    ids = np.array([0, 5, 332, 5, 100])
    table = backend.prepare_embedding(tensor)
    want = REF.embed(REF.prepare_embedding(tensor), ids)
    np.testing.assert_allclose(backend.to_numpy(backend.embed(table, ids)), want, rtol=1e-6,
                               atol=1e-6)


def test_rms_norm(backend):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    got = backend.to_numpy(backend.rms_norm(backend.asarray(x), backend.asarray(w), 1e-6))
    np.testing.assert_allclose(got, REF.rms_norm(x, w, 1e-6), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("n", [1, 7])
def test_rope(backend, neox, n):
    x = np.random.default_rng(n).standard_normal((n, 4, 64)).astype(np.float32)
    pos = np.arange(100, 100 + n)
    factors = np.linspace(1.0, 4.0, 32).astype(np.float32)
    for kwargs in ({}, {"freq_factors": factors, "freq_scale": 0.5}):
        got = backend.to_numpy(backend.rope(backend.asarray(x), pos, 1e6, neox, **kwargs))
        np.testing.assert_allclose(got, REF.rope(x, pos, 1e6, neox, **kwargs), rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("n,T,window,ring", [(1, 1, 0, False), (1, 50, 0, False),
                                             (9, 40, 0, False), (6, 70, 16, False),
                                             (300, 300, 0, False), (200, 450, 64, False),
                                             (150, 256, 100, True)])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_attention(backend, n, T, window, softcap, kv_dtype, ring):
    """Decode and prefill shapes, causal and windowed; ``ring``: key slots out of position
    order (a wrapped ring buffer), so masks are not one contiguous span."""
    rng = np.random.default_rng(T)
    q = rng.standard_normal((n, 8, 64)).astype(np.float32)
    k = rng.standard_normal((T, 2, 64)).astype(kv_dtype)  # the cache's storage type
    v = rng.standard_normal((T, 2, 64)).astype(kv_dtype)
    qpos = np.arange(T - n, T)[:, None]
    kpos = np.arange(T)[None, :]
    if ring:
        kpos = np.roll(kpos, 77, axis=1)  # slot j holds position kpos[j]
    mask = (kpos <= qpos) & ((qpos - kpos < window) if window else True)
    args = (backend.asarray(q), backend.asarray(k), backend.asarray(v), mask, 0.125, softcap)
    got = backend.to_numpy(backend.attention(*args))
    want = reference(backend).attention(q, k, v, mask, 0.125, softcap)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads,kv_heads,hd", [(7, 1, 64), (12, 2, 128), (4, 1, 256),
                                               (3, 3, 32), (40, 2, 64)])
@pytest.mark.parametrize("n", [3, 37])
def test_attention_head_layouts(backend, heads, kv_heads, hd, n):
    """Groups of query heads per KV head of every size the models use (and one past what a
    kernel groups), over an f16 cache, as in decode and in a whole prompt."""
    rng = np.random.default_rng(heads)
    T = 37
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    k = rng.standard_normal((T, kv_heads, hd)).astype(np.float16)
    v = rng.standard_normal((T, kv_heads, hd)).astype(np.float16)
    mask = np.arange(T)[None, :] <= np.arange(T - n, T)[:, None]
    got = backend.to_numpy(backend.attention(backend.asarray(q), backend.asarray(k),
                                             backend.asarray(v), mask, hd ** -0.5, 0.0))
    want = reference(backend).attention(q, k, v, mask, hd ** -0.5, 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(40, 90, 12, 2, 128), (40, 300, 4, 1, 256),
                                   (20, 200, 6, 1, 64)], ids=["qwen", "gemma", "one-kv-g6"])
def test_cpu_attention_is_the_same_alone_or_in_a_batch(shape):
    """A token's attention output does not depend on the batch it comes in (decode, a
    speculative check and a prompt must agree bit for bit for greedy drafting to be exact),
    in every C kernel variant (AVX-512 builds and AVX2 ones), and matches the reference. With
    one KV head a lone token's query heads are split across the threads (one unit would
    leave a core idle): the same bits as the unsplit batch."""
    variants = {id(b.native): (name, b) for name, b in _c_kernel_variants()}
    if not variants:
        pytest.skip("no C kernels here")
    rng = np.random.default_rng(3)
    n, T, heads, kv_heads, hd = shape
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    k = rng.standard_normal((T, kv_heads, hd)).astype(np.float16)
    v = rng.standard_normal((T, kv_heads, hd)).astype(np.float16)
    qpos = np.arange(T - n, T)[:, None]
    mask = (np.arange(T)[None, :] <= qpos) & (qpos - np.arange(T)[None, :] < 70)  # windowed
    want = REF.attention(q, k, v, mask, hd ** -0.5, 0.0)
    for name, cpu in variants.values():
        whole = cpu.attention(q, k, v, mask, hd ** -0.5)
        np.testing.assert_allclose(whole, want, rtol=1e-4, atol=1e-4, err_msg=name)
        for lo, hi in [(0, 1), (7, 11), (17, n), (n - 1, n)]:
            part = cpu.attention(q[lo:hi], k, v, mask[lo:hi], hd ** -0.5)
            np.testing.assert_array_equal(part, whole[lo:hi], err_msg=name)


def test_attention_batch_is_each_sequence_alone(backend):
    """Several sequences' attention in one call (a batched decode step, a prompt chunk beside
    decode tokens), each against its own keys and mask: every row as ``attention`` gives its
    sequence alone, bit for bit, and as the reference."""
    rng = np.random.default_rng(8)
    heads, kv_heads, hd = 8, 2, 64
    shapes = [(1, 37), (5, 90), (1, 3), (20, 20)]  # (rows, keys) per sequence
    q = rng.standard_normal((sum(n for n, _ in shapes), heads, hd)).astype(np.float32)
    parts, row = [], 0
    for n, T in shapes:
        k = rng.standard_normal((T, kv_heads, hd)).astype(np.float16)
        v = rng.standard_normal((T, kv_heads, hd)).astype(np.float16)
        qpos = np.arange(T - n, T)[:, None]
        parts.append((k, v, np.arange(T)[None, :] <= qpos))  # causal (n, T)
    dev = [(backend.asarray(k), backend.asarray(v), m) for k, v, m in parts]
    got = backend.to_numpy(backend.attention_batch(backend.asarray(q), dev, hd ** -0.5))
    for (n, _), (k, v, m), (dk, dv, _) in zip(shapes, parts, dev, strict=True):
        alone = backend.to_numpy(backend.attention(backend.asarray(q[row:row + n]), dk, dv, m,
                                                   hd ** -0.5))
        np.testing.assert_array_equal(got[row:row + n], alone)
        want = REF.attention(q[row:row + n], k, v, m, hd ** -0.5, 0.0)
        np.testing.assert_allclose(got[row:row + n], want, rtol=1e-3, atol=1e-3)
        row += n


def test_attention_append_is_write_then_attention_batch(backend):
    """A decode step's rows stored and attended in one call: the stored rows are the new
    keys and values as the storage's dtype rounds them (f16: ties to even, subnormals),
    untouched slots stay as they were, and the output is what ``attention_batch`` gives over
    the stored keys with each row's window of slots, bit for bit."""
    rng = np.random.default_rng(9)
    heads, kv_heads, hd, slots = 8, 2, 64, 48
    spans = [(0, 0), (36, 36), (5, 20), (0, 47)]  # (first visible slot, new slot) per sequence
    q = rng.standard_normal((len(spans), heads, hd)).astype(np.float32)
    k, v = (rng.standard_normal((len(spans), kv_heads, hd)).astype(np.float32) for _ in "kv")
    k[0, 0, :4] = [65519.0, 1e-6, 2049.0, -3e-8]  # f16: 65504, subnormal, a tie, -0
    stored = [tuple(rng.standard_normal((slots, kv_heads, hd)).astype(np.float16) for _ in "kv")
              for _ in spans]
    dev = [(backend.asarray(a.copy()), backend.asarray(b.copy())) for a, b in stored]
    got = backend.to_numpy(backend.attention_append(
        backend.asarray(q), backend.asarray(k), backend.asarray(v), dev,
        [s for _, s in spans], [f for f, _ in spans], hd ** -0.5))
    parts = []
    for j, ((first, slot), (keys, values)) in enumerate(zip(spans, stored, strict=True)):
        keys[slot], values[slot] = k[j], v[j]  # numpy's f32 -> f16 assignment
        for name, want, have in (("keys", keys, dev[j][0]), ("values", values, dev[j][1])):
            np.testing.assert_array_equal(backend.to_numpy(have), want, err_msg=name)
        mask = (np.arange(slot + 1) >= first)[None, :]  # (1, T)
        parts.append((backend.asarray(keys[:slot + 1]), backend.asarray(values[:slot + 1]),
                      mask))
    want = backend.to_numpy(backend.attention_batch(backend.asarray(q), parts, hd ** -0.5))
    np.testing.assert_array_equal(got, want)


def test_activations_and_softcap(backend):
    rng = np.random.default_rng(0)
    g, u = (rng.standard_normal((3, 100)).astype(np.float32) * 3 for _ in range(2))
    g[0, :6] = [-120.0, -88.0, 88.5, 120.0, 0.0, -30.0]  # past exp's range both ways
    for op in ("silu_mul", "gelu_tanh_mul"):
        got = backend.to_numpy(getattr(backend, op)(backend.asarray(g), backend.asarray(u)))
        # llama.cpp's GELU is an f16 table (input and output rounded to 11 bits: ~1e-3)
        rtol = 1e-3 if op == "gelu_tanh_mul" and backend.ggml_numerics else 1e-4
        np.testing.assert_allclose(got, getattr(REF, op)(g, u), rtol=rtol, atol=1e-4 if
                                   rtol > 1e-4 else 1e-5)
    got = backend.to_numpy(backend.softcap(backend.asarray(g * 20), 30.0))
    np.testing.assert_allclose(got, REF.softcap(g * 20, 30.0), rtol=1e-5, atol=1e-5)
    got = backend.to_numpy(backend.scale(backend.asarray(g), 2.5))
    np.testing.assert_allclose(got, g * 2.5, rtol=1e-6)


def test_activations_at_prefill_size(backend):
    """A prefill's (n, ffn) gate/up: large enough to be split across threads, odd length."""
    rng = np.random.default_rng(1)
    g, u = (rng.standard_normal((37, 2049)).astype(np.float32) * 3 for _ in range(2))
    for op in ("silu_mul", "gelu_tanh_mul"):
        got = backend.to_numpy(getattr(backend, op)(backend.asarray(g), backend.asarray(u)))
        table = op == "gelu_tanh_mul" and backend.ggml_numerics  # f16 in and out (~1e-3)
        np.testing.assert_allclose(got, getattr(REF, op)(g, u), rtol=1e-3 if table else 1e-4,
                                   atol=3e-3 if table else 1e-4)


def _c_kernel_variants():
    """(id, CpuBackend) for each C kernel variant this CPU can run (AVX-512 VNNI, AVX2 with and
    without AVX-VNNI; the NEON ones on ARM), with and without weights packed at load where the
    build packs them."""
    if "cpu" not in available_backends():
        return []
    from edgellm.native import cpu_kernels

    if cpu_kernels.best_variant() is None or cpu_kernels.load() is None:
        return []
    names = [v for v in cpu_kernels.runnable_variants() if cpu_kernels.load(v) is not None]
    out = []
    for name in names:
        b = get_backend("cpu", kernels="c")
        b.native = cpu_kernels.load(name)
        b.packing = b.native.lib.ek_packed_bytes(int(Q.Q8_0), 16, 32) > 0
        out.append((name + ("-packed" if b.packing else ""), b))
        if b.packing:  # the same build on the file's blocks (the types it does not pack)
            plain = get_backend("cpu", kernels="c")
            plain.native = b.native
            plain.packing = False
            out.append((name, plain))
    return out


@pytest.mark.parametrize("qtype", CORE_TYPES, ids=lambda q: q.name)
def test_matvec_batch_invariant(qtype):
    """A token's mat-vec result is bit-identical alone and in a batch of 2..8 (speculative
    verification's greedy exactness relies on it), in every C kernel variant."""
    variants = _c_kernel_variants()
    if not variants:
        pytest.skip("no C kernels here")
    if not variants[0][1].native.lib.ek_supports(int(qtype)):
        pytest.skip(f"{qtype.name} is not a C mat-vec type")
    tensor = random_tensor(qtype, 67, 512, seed=11)
    x = np.random.default_rng(5).standard_normal((8, 512)).astype(np.float32)
    x[3] *= 40.0  # one outsized token: its per-block scales differ from the rest
    for name, b in variants:
        w = b.prepare(tensor)
        alone = np.concatenate([b.matmul(x[i:i + 1], w) for i in range(8)])
        for k in range(2, 9):
            got = b.matmul(x[:k], w)
            assert np.array_equal(got.view(np.uint32), alone[:k].view(np.uint32)), (name, k)


@pytest.mark.parametrize("qtype", CORE_TYPES, ids=lambda q: q.name)
def test_prefill_gemm_ragged_tiles(qtype):
    """The AVX-512 GEMM (16 rows in the lanes of a register, 8 tokens a tile, the rest in tiles
    of 4, 2, 1; up to 4 chunks of 16 rows a unit of work) at sizes that fill no tile: 17, 77
    and 525 rows (a last chunk of 1 or 13 rows, a last unit of one chunk), 9..130 tokens, one
    outsized token (its own scales), each against x @ w.T."""
    variants = _c_kernel_variants()
    if not variants:
        pytest.skip("no C kernels here")
    b = variants[0][1]
    cols = 512
    for rows in (17, 77, 525):
        tensor = random_tensor(qtype, rows, cols, seed=rows)
        w = dequantize(tensor.data, qtype).reshape(rows, cols)
        prepared = b.prepare(tensor)
        for n in (9, 15, 37, 130):
            x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
            x[n // 2] *= 40.0
            got = b.matmul(x, prepared)
            want = x @ w.T
            assert np.all(np.abs(got - want) <= int8_activation_bound(w, x)
                          + 1e-4 * np.abs(want)), (rows, n)


@pytest.mark.parametrize("qtype", CORE_TYPES, ids=lambda q: q.name)
def test_tied_embedding_lookups(qtype):
    """A table prepared as the embedding and then as the (tied) output matrix: lookups give
    the numpy dequantizer's rows exactly, packed or not, and the output multiplies as its own."""
    for name, b in _c_kernel_variants():
        tensor = random_tensor(qtype, 45, 512, seed=7)
        table = b.prepare_embedding(tensor)
        output = b.prepare(tensor)
        ids = np.array([0, 44, 17, 16, 15, 17])
        want = dequantize(tensor.data[ids], qtype).reshape(len(ids), 512)
        assert np.array_equal(b.embed(table, ids), want), name
        assert np.array_equal(b.embed(output, ids), want), name


@pytest.mark.parametrize("n", [1, 3, 8, 12])
def test_matmuls_equal_separate_matmuls(n):
    """Q/K/V-style groups (mixed types, a bias) through the fused op: bit-identical to one
    matmul each, in every C variant, packed or not."""
    variants = _c_kernel_variants()
    if not variants:
        pytest.skip("no C kernels here")
    tensors = [random_tensor(Q.Q4_K, 96, 512, seed=1), random_tensor(Q.Q4_K, 32, 512, seed=2),
               random_tensor(Q.Q6_K, 32, 512, seed=3)]
    x = np.random.default_rng(n).standard_normal((n, 512)).astype(np.float32)
    bias = np.linspace(-1, 1, 32, dtype=np.float32)
    for name, b in variants:
        ws = [b.prepare(t) for t in tensors]
        fused = b.matmuls(x, ws, (None, bias, None))
        for got, w, bi in zip(fused, ws, (None, bias, None), strict=True):
            assert np.array_equal(got, b.matmul(x, w, bi)), name


@pytest.mark.parametrize("qtype", CORE_TYPES, ids=lambda q: q.name)
def test_packed_prefill_equals_decode(qtype):
    """Packed weights: a token's output is bit-identical from a prefill-sized batch (each chunk
    expanded once for the GEMM tiles) and from a single-token step (read straight from the
    records), so a prompt and the tokens decoded after it see the same arithmetic."""
    variants = [(name, b) for name, b in _c_kernel_variants() if name.endswith("-packed")]
    if not variants:
        pytest.skip("no build that packs weights here")
    name, b = variants[0]
    w = b.prepare(random_tensor(qtype, 77, 512, seed=4))
    if getattr(w, "packed", None) is None:
        pytest.skip(f"{qtype.name} is not packed")
    x = np.random.default_rng(9).standard_normal((37, 512)).astype(np.float32)
    x[5] *= 40.0
    batch = b.matmul(x, w)
    alone = np.concatenate([b.matmul(x[i:i + 1], w) for i in range(37)])
    assert np.array_equal(batch.view(np.uint32), alone.view(np.uint32)), name


@pytest.mark.parametrize("qtype", CORE_TYPES, ids=lambda q: q.name)
def test_packed_variants_agree_bit_for_bit(qtype):
    """Every build that packs (AVX-512 VNNI, AVX2 with and without AVX-VNNI) sums the same
    exact integers and does the same float steps, so a model gives the same tokens whichever
    variant a machine picks: one token and a prefill-sized batch, bit for bit."""
    variants = [(name, b) for name, b in _c_kernel_variants() if name.endswith("-packed")]
    if len(variants) < 2:
        pytest.skip("fewer than two packing builds run here")
    tensor = random_tensor(qtype, 77, 512, seed=4)
    x = np.random.default_rng(9).standard_normal((11, 512)).astype(np.float32)
    x[5] *= 40.0
    outs = {}
    for name, b in variants:
        w = b.prepare(tensor)
        if getattr(w, "packed", None) is None:
            pytest.skip(f"{qtype.name} is not packed")
        outs[name] = np.concatenate([b.matmul(x, w), b.matmul(x[:1], w)]).view(np.uint32)
    first, *rest = outs
    for name in rest:
        assert np.array_equal(outs[name], outs[first]), f"{name} differs from {first}"


@pytest.mark.parametrize("kernels", ["c", "numba"])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_two_threads_share_many_chunks_exactly(kernels, qtype):
    """A matrix of many row chunks on two threads: the pool's claims take several chunks at a
    time (a share of those left), and every row is computed once, as on one thread, bit for
    bit (decode and a speculative check's batch)."""
    if "cpu" not in available_backends():
        pytest.skip("no CPU backend")
    one = get_backend("cpu", kernels=kernels, threads=1)
    two = get_backend("cpu", kernels=kernels, threads=2)
    if kernels == "c" and one.native is None:
        pytest.skip("no C kernels here")
    tensor = random_tensor(qtype, 16 * 300 + 5, 256, seed=2)  # 301 chunks, the last ragged
    x = np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32)
    w1, w2 = one.prepare(tensor), two.prepare(tensor)
    for n in (1, 3):
        got, want = two.matmul(x[:n], w2), one.matmul(x[:n], w1)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), n
    w = dequantize(tensor.data, qtype).reshape(tensor.shape)
    ref = x @ w.T
    assert np.all(np.abs(got - ref) <= int8_activation_bound(w, x) + 1e-4 * np.abs(ref))


@pytest.mark.parametrize("qtype", CORE_TYPES, ids=lambda q: q.name)
def test_prefill_matmul_in_every_c_kernel_variant(qtype):
    """A prefill-sized batch in each C build: the AVX-512 one takes the GEMM (every type), the
    AVX2 one (no GEMM) falls back to the mat-vec kernels."""
    variants = _c_kernel_variants()
    if not variants:
        pytest.skip("no C kernels here")
    tensor = random_tensor(qtype, 77, 512, seed=1)
    x = np.random.default_rng(0).standard_normal((37, 512)).astype(np.float32)
    w = dequantize(tensor.data, qtype).reshape(77, 512)
    want = x @ w.T
    for name, b in variants:
        got = b.matmul(x, b.prepare(tensor))
        assert np.all(np.abs(got - want) <= int8_activation_bound(w, x) + 1e-4 * np.abs(want)), name
