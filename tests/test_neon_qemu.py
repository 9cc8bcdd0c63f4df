"""The aarch64 kernels (native/cpu_neon.c) cross-compiled and run under qemu-user.

Nothing ARM runs here, so each NEON variant of native/cpu_kernels.py's VARIANTS is built with
``aarch64-linux-gnu-gcc -static`` (with the flags the cffi build uses) together with a small
driver (tests/native/neon_driver.c) and run under ``qemu-aarch64`` (plain NEON on a Cortex-A72
model, without dotprod; the dotprod build on a Cortex-A76, the Raspberry Pi 5's core) on random
weight blocks of every type the C kernels take and random activations. Its results are checked

- against the x86 AVX2 build's kernels on the file's blocks (ek_matmul_f32; the packed AVX2
  tiles add in their own order) on the same inputs, bit for bit: the ARM code
  does the same integer sums (sdot or vmull_s8 lanes = vpmaddubsw + vpmaddwd lanes) and the
  same float operations in the same order (8 lanes, fused multiply-adds, two accumulators,
  the same horizontal sum), so nothing is left to a tolerance there;
- against numpy: the activation rounding exactly (the int8 values, the f16-rounded Q8_0
  scales, the Q8_K scales, the sums of 16), each matmul against the dequantized weights times
  the rounded activations in f64 (only f32 rounding between them), and against x @ w.T within
  the int8 rounding bound of the conformance test; the elementwise ops, RoPE, RMS norm and
  attention against the numpy backend at the conformance test's tolerances;
- against itself: a token's result alone and in a batch, and on 1 and 2 threads, bit for bit.

Skips (with the reason) where the cross compiler or qemu is missing.
"""

from __future__ import annotations

import platform
import re
import shutil
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from edgellm.backends import get_backend
from edgellm.backends.cpu.backend import rope_tables
from edgellm.native import cpu_kernels
from edgellm.quants import GGML_QUANT_SIZES, Q, dequantize

CROSS_CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64")
NATIVE = Path(cpu_kernels.__file__).resolve().parent  # the kernel sources
DRIVER = Path(__file__).resolve().parent / "native" / "neon_driver.c"
NEON_VARIANTS = [v for v in cpu_kernels.VARIANTS if cpu_kernels.variant_arch(v) == "aarch64"]
#: the oldest qemu core model each variant must run on: plain NEON on a Cortex-A72 (Raspberry
#: Pi 4: no dotprod, so a stray sdot would be an illegal instruction), dotprod on a Cortex-A76
#: (Raspberry Pi 5), anything newer on "max"
QEMU_CPU = {"neon": "cortex-a72", "neon_dotprod": "cortex-a76"}
#: variants whose float order differs from x86's (smmla lanes hold whole-block sums)
SUMMED_BY_BLOCK = {"neon_i8mm"}
REF = get_backend("numpy")

#: every type the C kernels take; the three models use Q4_K, Q5_0, Q6_K and Q8_0
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# byte offsets of the f16 scale fields in each block (ggml-common.h)
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
              Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
ROWS, COLS = 67, 512  # a last chunk of 3 rows; two K-quant superblocks a row
TOKENS = (1, 2, 4, 8, 13, 37)  # one group, full groups, groups and a short last group
MAX_N = max(TOKENS)


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, row_bytes) uint8 random blocks of qtype with sane f16 scales."""
    rng = np.random.default_rng(seed)
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // bs, ts), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.uniform(0.001, 0.02, (rows, cols // bs)).astype(np.float16)
        raw[:, :, off:off + 2] = scales.view(np.uint8).reshape(rows, cols // bs, 2)
    return raw.reshape(rows, -1)


def activations(n: int, cols: int, seed: int) -> np.ndarray:
    """(n, cols) f32 with the rounding's corner cases: an outsized token, an all-zero block,
    a block whose peak is exactly -127 or 127 (so that x * 127/amax and -127/peak * x are
    exact and .5 ties meet round-half-even)."""
    x = np.random.default_rng(seed).standard_normal((n, cols)).astype(np.float32)
    x[n // 2] *= 40.0
    x[0, 32:64] = 0.0
    if n > 1:
        ties = np.array([2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5], dtype=np.float32)
        x[1, :256] = np.float32(0.25)
        x[1, 0] = -127.0
        x[1, 1:1 + len(ties)] = ties
        x[1, 256] = 127.0
        x[1, 257:257 + len(ties)] = ties
    return x


def round_like_x86(x: np.ndarray, kq: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (n, cols) as the x86 kernels round it: q (n, cols) int8, d (n, cols/32) f32, sums of
    16 (n, cols/16) int32. Q8_K (kq) per 256: iscale = -127/peak, q = min(127, rint(iscale x)),
    d = 1/iscale; Q8_0 per 32: q = rint(x * (127/amax)), d = f16(amax / 127)."""
    n, cols = x.shape
    block = 256 if kq else 32
    xb = x.reshape(n, cols // block, block)
    peak = np.take_along_axis(xb, np.abs(xb).argmax(-1)[..., None], -1)  # first of the largest
    empty = peak == 0
    with np.errstate(divide="ignore"):
        if kq:
            iscale = np.where(empty, np.float32(0), np.float32(-127.0) / peak)
            q = np.minimum(np.float32(127), np.rint(iscale * xb))
            d = np.where(empty, np.float32(0), np.float32(1.0) / iscale)
            d = np.repeat(d[..., 0], 8, axis=-1)
        else:
            amax = np.abs(peak)
            inv = np.where(empty, np.float32(0), np.float32(127.0) / amax)
            q = np.rint(xb * inv)
            d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float32)[..., 0]
    q = q.astype(np.int8).reshape(n, cols)
    sums = q.reshape(n, cols // 16, 16).astype(np.int32).sum(-1)
    return q, d.reshape(n, cols // 32).astype(np.float32), sums


class Jobs:
    """The driver's input stream (see neon_driver.c) and how to read its answers."""

    def __init__(self):
        self.parts: list[bytes] = []
        self.readers: list[tuple[str, object]] = []

    def _add(self, key, data: bytes, reader) -> None:
        self.parts.append(data)
        self.readers.append((key, reader))

    @staticmethod
    def _floats(count: int):
        return lambda buf, at: (np.frombuffer(buf, np.float32, count, at).copy(), at + 4 * count)

    @staticmethod
    def _status_floats(count: int):
        def read(buf, at):
            status = struct.unpack_from("<i", buf, at)[0]
            got = np.frombuffer(buf, np.float32, count, at + 4).copy()
            return (status, got), at + 4 + 4 * count
        return read

    def matmul(self, key, qtype: Q, w: np.ndarray, x: np.ndarray, threads: int) -> None:
        rows, row_bytes = w.shape
        n, cols = x.shape
        head = struct.pack("<iiiiiiq", 1, threads, int(qtype), rows, cols, n, row_bytes)
        self._add(key, head + w.tobytes() + x.tobytes(), self._status_floats(n * rows))

    def multi(self, key, mats: list[tuple[Q, np.ndarray]], x: np.ndarray, threads: int) -> None:
        n, cols = x.shape
        data = [struct.pack("<iiiii", 2, threads, len(mats), cols, n)]
        for qtype, w in mats:
            data += [struct.pack("<iiq", int(qtype), w.shape[0], w.shape[1]), w.tobytes()]
        total = sum(w.shape[0] for _, w in mats)
        self._add(key, b"".join(data) + x.tobytes(), self._status_floats(n * total))

    def acts(self, key, x: np.ndarray, kq: bool) -> None:
        n, cols = x.shape

        def read(buf, at):
            q = np.frombuffer(buf, np.int8, n * cols, at).reshape(n, cols)
            at += n * cols
            d = np.frombuffer(buf, np.float32, n * cols // 32, at).reshape(n, cols // 32)
            at += 4 * n * cols // 32
            s = np.frombuffer(buf, np.int32, n * cols // 16, at).reshape(n, cols // 16)
            return (q, d, s), at + 4 * n * cols // 16
        self._add(key, struct.pack("<iiiii", 3, 1, int(kq), n, cols) + x.tobytes(), read)

    def rms(self, key, x: np.ndarray, w: np.ndarray, eps: float) -> None:
        head = struct.pack("<iiiif", 4, 1, x.shape[0], x.shape[1], eps)
        self._add(key, head + x.tobytes() + w.tobytes(), self._floats(x.size))

    def rope(self, key, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> None:
        head = struct.pack("<iiiiii", 5, 1, *x.shape, int(neox))
        self._add(key, head + x.tobytes() + cos.tobytes() + sin.tobytes(), self._floats(x.size))

    def gated(self, key, gelu: bool, gate: np.ndarray, up: np.ndarray, threads: int) -> None:
        head = struct.pack("<iii", 7 if gelu else 6, threads, gate.size)
        self._add(key, head + gate.tobytes() + up.tobytes(), self._floats(gate.size))

    def attention(self, key, q, k, v, mask, scale: float, softcap: float, threads: int) -> None:
        n, heads, hd = q.shape
        head = struct.pack("<iiiiiiiff", 8, threads, n, heads, k.shape[1], hd, k.shape[0],
                           scale, softcap)
        body = q.tobytes() + k.view(np.uint16).tobytes() + v.view(np.uint16).tobytes()
        self._add(key, head + body + mask.astype(np.uint8).tobytes(), self._status_floats(q.size))

    def append(self, key, q, k_new, v_new, slots, firsts, kc, vc, scale: float) -> None:
        count, heads, hd = q.shape
        head = struct.pack("<iiiiiiif", 10, 2, count, heads, k_new.shape[1], hd, kc.shape[1],
                           scale)
        body = (q.tobytes() + k_new.tobytes() + v_new.tobytes()
                + np.asarray(slots, np.int32).tobytes() + np.asarray(firsts, np.int32).tobytes()
                + kc.view(np.uint16).tobytes() + vc.view(np.uint16).tobytes())

        def read(buf, at):
            (status,), at = struct.unpack_from("<i", buf, at), at + 4
            out = np.frombuffer(buf, np.float32, q.size, at).reshape(q.shape)
            at += 4 * q.size
            k = np.frombuffer(buf, np.uint16, kc.size, at).reshape(kc.shape)
            at += 2 * kc.size
            v = np.frombuffer(buf, np.uint16, vc.size, at).reshape(vc.shape)
            return (status, out, k, v), at + 2 * vc.size
        self._add(key, head + body, read)

    def packed(self, key) -> None:
        def read(buf, at):
            return struct.unpack_from("<q4i", buf, at), at + 24
        self._add(key, struct.pack("<ii", 9, 1), read)

    def stream(self) -> bytes:
        return b"".join(self.parts) + struct.pack("<i", 0)

    def parse(self, out: bytes) -> dict:
        results, at = {}, 0
        for key, read in self.readers:
            results[key], at = read(out, at)
        assert at == len(out), "the driver's output does not match the jobs"
        return results


# ---- the inputs (fixed seeds) and the job stream every variant runs ---------------------------

WEIGHTS = {qtype: random_blocks(qtype, ROWS, COLS, seed=i) for i, qtype in enumerate(TYPES)}
X = activations(MAX_N, COLS, seed=7)
MULTI = [(qtype, random_blocks(qtype, rows, COLS, seed))
         for qtype, rows, seed in ((Q.Q4_K, 96, 21), (Q.Q8_0, 32, 22), (Q.Q6_K, 33, 23),
                                   (Q.Q5_0, 17, 24))]
MULTI_TOKENS = (1, 3, 8)


def _elementwise_inputs():
    rng = np.random.default_rng(0)
    g, u = (rng.standard_normal(37 * 2049).astype(np.float32) * 3 for _ in range(2))
    g[:6] = [-120.0, -88.0, 88.5, 120.0, 0.0, -30.0]  # past exp's range both ways
    rx = rng.standard_normal((5, 1000)).astype(np.float32)
    rw = rng.standard_normal(1000).astype(np.float32)
    qr = rng.standard_normal((3, 4, 72)).astype(np.float32)  # hd/2 = 36: a vector span, a tail
    return g, u, rx, rw, qr


GATE, UP, RMS_X, RMS_W, ROPE_X = _elementwise_inputs()
ROPE_POS = np.array([0, 5, 1000])


def _attention_inputs():
    rng = np.random.default_rng(3)
    n, T, heads, kv_heads, hd = 20, 45, 12, 2, 64
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    k = rng.standard_normal((T, kv_heads, hd)).astype(np.float16)
    v = rng.standard_normal((T, kv_heads, hd)).astype(np.float16)
    qpos = np.arange(T - n, T)[:, None]
    mask = (np.arange(T)[None, :] <= qpos) & (qpos - np.arange(T)[None, :] < 30)  # windowed
    return q, k, v, mask


ATT_Q, ATT_K, ATT_V, ATT_MASK = _attention_inputs()


def _append_inputs():
    """A decode step of three sequences (slots 0, 30 and 47 of 48, the middle one windowed
    from slot 10), new rows with f16 edge cases: max, a subnormal, a tie, -0."""
    rng = np.random.default_rng(4)
    count, heads, kv_heads, hd, slots = 3, 12, 2, 64, 48
    q = rng.standard_normal((count, heads, hd)).astype(np.float32)
    k, v = (rng.standard_normal((count, kv_heads, hd)).astype(np.float32) for _ in "kv")
    k[1, 0, :4] = [65519.0, 1e-6, 2049.0, -3e-8]
    kc, vc = (rng.standard_normal((count, slots, kv_heads, hd)).astype(np.float16)
              for _ in "kv")
    return q, k, v, [0, 30, 47], [0, 10, 0], kc, vc


APPEND = _append_inputs()
ATT_SPLITS = [(0, 1), (7, 11), (3, 20)]


def build_jobs() -> Jobs:
    jobs = Jobs()
    for qtype in TYPES:
        w = WEIGHTS[qtype]
        for n in TOKENS:
            for threads in (1, 2):
                jobs.matmul(("mm", qtype, n, threads), qtype, w, X[:n], threads)
        for i in range(MAX_N):  # each token alone
            jobs.matmul(("alone", qtype, i), qtype, w, X[i:i + 1], 1)
    jobs.matmul(("mm", Q.F16, 1, 1), Q.F16, WEIGHTS[Q.Q8_0], X[:1], 1)  # not a C type: -2
    jobs.packed("packed")
    for n in MULTI_TOKENS:
        jobs.multi(("multi", n), MULTI, X[:n], 2)
        for i, (qtype, w) in enumerate(MULTI):
            jobs.matmul(("single", i, n), qtype, w, X[:n], 2)
    for kq in (False, True):
        jobs.acts(("acts", kq), X, kq)
    jobs.rms("rms", RMS_X, RMS_W, 1e-6)
    cos, sin = rope_tables(ROPE_POS, ROPE_X.shape[-1], 10000.0)
    for neox in (False, True):
        jobs.rope(("rope", neox), ROPE_X, cos, sin, neox)
    for gelu in (False, True):
        jobs.gated(("gated", gelu, 1), gelu, GATE[:100], UP[:100], 1)
        jobs.gated(("gated", gelu, 2), gelu, GATE, UP, 2)  # pieces across threads
    scale = ATT_Q.shape[-1] ** -0.5
    for softcap in (0.0, 30.0):
        jobs.attention(("att", softcap), ATT_Q, ATT_K, ATT_V, ATT_MASK, scale, softcap, 2)
    for lo, hi in ATT_SPLITS:
        jobs.attention(("att-part", lo, hi), ATT_Q[lo:hi], ATT_K, ATT_V, ATT_MASK[lo:hi], scale,
                       0.0, 1)
    jobs.append("append", *APPEND, scale)
    return jobs


# ---- building and running under qemu ----------------------------------------------------------

def _compile(variant: str, out_dir: Path) -> Path:
    exe = out_dir / f"neon_driver_{variant}"
    flags = cpu_kernels.VARIANTS[variant][1]
    cmd = [CROSS_CC, "-O3", "-pthread", "-fno-math-errno", *flags, "-static", "-Wall", "-Werror",
           "-I", str(NATIVE), str(DRIVER), "-o", str(exe), "-lm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{variant}: cross build failed\n{done.stderr}"
    return exe


BUILT: dict[str, Path] = {}  # variant -> the static driver, once neon_results has built it


@pytest.fixture(scope="module")
def neon_results(tmp_path_factory) -> dict[str, dict]:
    """Every NEON variant's answers to the job stream, by variant."""
    if CROSS_CC is None or QEMU is None:
        pytest.skip("needs aarch64-linux-gnu-gcc and qemu-aarch64 (Debian: gcc-aarch64-linux-gnu "
                    "libc6-dev-arm64-cross qemu-user)")
    out_dir = tmp_path_factory.mktemp("neon")
    jobs = build_jobs()
    stream = jobs.stream()

    def run(variant: str) -> tuple[str, dict]:
        exe = BUILT[variant] = _compile(variant, out_dir)
        done = subprocess.run([QEMU, "-cpu", QEMU_CPU.get(variant, "max"), str(exe)], input=stream,
                              capture_output=True, timeout=300)
        assert done.returncode == 0, f"{variant}: driver failed\n{done.stderr.decode()}"
        return variant, jobs.parse(done.stdout)

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(run, NEON_VARIANTS))


@pytest.fixture(scope="module")
def x86_avx2():
    """The x86 AVX2 build of the same C API (the cffi module), or a skip where there is none."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the x86 reference build needs an x86-64 CPU")
    if not all(f in cpu_kernels.cpu_flags() for f in cpu_kernels.VARIANTS["avx2"][0]):
        pytest.skip("the x86 reference build needs AVX2, FMA and F16C")
    module = cpu_kernels.load("avx2")
    if module is None:
        pytest.skip("the x86 AVX2 kernels did not build here")
    return module


def x86_matmul(module, qtype: Q, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """out (n, rows) from the AVX2 mat-vec kernels (gemm_min past n: never a GEMM)."""
    ffi, lib = module.ffi, module.lib
    n, cols = x.shape
    out = np.empty((n, w.shape[0]), np.float32)
    status = lib.ek_matmul_f32(int(qtype), ffi.from_buffer("uint8_t[]", w), w.shape[1],
                               w.shape[0], cols, ffi.from_buffer("float[]", x), n,
                               ffi.from_buffer("float[]", out), 1, 1 << 30)
    assert status == 0
    return out


def reference(qtype: Q, w: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dequantized w times the x86-rounded x in f64, the f32 rounding room: |w| . |x_r|)."""
    q, d, _ = round_like_x86(x, qtype in K_QUANTS)
    xr = (q.reshape(len(x), -1, 32).astype(np.float64) * d[..., None]).reshape(x.shape)
    wf = dequantize(w, qtype).reshape(w.shape[0], -1).astype(np.float64)
    return xr @ wf.T, np.abs(xr) @ np.abs(wf).T


def int8_activation_bound(w: np.ndarray, x: np.ndarray, block: int) -> np.ndarray:
    """Largest error from rounding x (n, cols) to int8 per block (the conformance test's bound,
    per 256 for the Q8_K rounding against K-quants)."""
    n, cols = x.shape
    blockmax = np.abs(x).reshape(n, cols // block, block).max(-1, keepdims=True)
    step = np.broadcast_to(blockmax, (n, cols // block, block)).reshape(n, cols) / 254.0
    return step @ np.abs(w).T * 1.01 + 1e-4


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# ---- the tests ----------------------------------------------------------------------------------

def test_neon_variants_are_declared():
    """The loader knows the NEON builds, best first, plain NEON last (every aarch64 core)."""
    assert NEON_VARIANTS == ["neon_i8mm", "neon_dotprod", "neon"]
    assert all(cpu_kernels.variant_arch(v) == "x86_64" for v in ("avx2", "avx512vnni"))
    assert [p.name for p in cpu_kernels.SOURCES["aarch64"]] == [
        "cpu_pool.c", "cpu_neon.c", "cpu_attention_batch.c", "cpu_block.c"]


def test_activation_rounding_is_x86s(neon_results):
    """Q8_0 and Q8_K rounding of the activations: the int8 values, the scales (f16-rounded for
    Q8_0) and the sums of 16, exactly as the x86 build rounds them (numpy mirror)."""
    for variant, res in neon_results.items():
        for kq in (False, True):
            q, d, s = res[("acts", kq)]
            wq, wd, ws = round_like_x86(X, kq)
            assert np.array_equal(q, wq), (variant, kq)
            assert np.array_equal(bits(d), bits(wd)), (variant, kq)
            assert np.array_equal(s, ws), (variant, kq)
    q, d, _ = round_like_x86(X[1:2], False)  # the ties went to even
    assert list(q[0, 1:8]) == [2, -4, 0, 0, 2, 126, -126] and d[0, 0] == 1.0


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matmul_against_numpy(neon_results, qtype):
    """Every type, 1..37 tokens, 1 and 2 threads: the dequantized weights times the rounded
    activations up to f32 rounding, and x @ w.T within the int8 rounding bound."""
    w = WEIGHTS[qtype]
    wf = dequantize(w, qtype).reshape(ROWS, COLS)
    for variant, res in neon_results.items():
        for n in TOKENS:
            for threads in (1, 2):
                status, got = res[("mm", qtype, n, threads)]
                assert status == 0, (variant, n, threads)
                got = got.reshape(n, ROWS)
                want, room = reference(qtype, w, X[:n])
                assert np.all(np.abs(got - want) <= 4e-6 * room + 1e-6), (variant, n, threads)
                exact = X[:n] @ wf.T
                bound = int8_activation_bound(wf, X[:n], 256 if qtype in K_QUANTS else 32)
                assert np.all(np.abs(got - exact) <= bound
                              + 1e-4 * np.abs(exact)), (variant, n, threads)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matmul_batch_and_thread_invariant(neon_results, qtype):
    """A token's result is bit-identical alone, in any batch and on 1 or 2 threads."""
    for variant, res in neon_results.items():
        alone = np.concatenate([res[("alone", qtype, i)][1] for i in range(MAX_N)])
        alone = alone.reshape(MAX_N, ROWS)
        for n in TOKENS:
            for threads in (1, 2):
                got = res[("mm", qtype, n, threads)][1].reshape(n, ROWS)
                assert np.array_equal(bits(got), bits(alone[:n])), (variant, n, threads)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matmul_bit_identical_to_x86(neon_results, x86_avx2, qtype):
    """The same inputs through the x86 AVX2 build: the same bits, token for token (the sdot
    and plain NEON builds). The i8mm build sums whole blocks per lane (smmla), so its floats
    are added in another order: equal to x86 up to f32 rounding of the same integer sums."""
    w = WEIGHTS[qtype]
    want = x86_matmul(x86_avx2, qtype, w, X)
    _, room = reference(qtype, w, X)
    for variant, res in neon_results.items():
        for n in TOKENS:
            got = res[("mm", qtype, n, 2)][1].reshape(n, ROWS)
            if variant in SUMMED_BY_BLOCK:
                assert np.all(np.abs(got - want[:n]) <= 4e-6 * room[:n] + 1e-6), (variant, n)
                continue
            diff = np.flatnonzero(bits(got) != bits(want[:n]))
            assert diff.size == 0, (f"{variant} {qtype.name} n={n}: {diff.size} of {got.size} "
                                    f"outputs differ from x86, e.g. {got.flat[diff[0]]!r} vs "
                                    f"{want[:n].flat[diff[0]]!r}")


def test_qemu_core_models_reject_what_they_lack(neon_results):
    """The Cortex-A72 model really has no dotprod: the dotprod build dies there on its first
    sdot, so the plain NEON build passing on it shows that build needs none."""
    jobs = Jobs()
    jobs.matmul("q8", Q.Q8_0, WEIGHTS[Q.Q8_0], X[:1], 1)
    done = subprocess.run([QEMU, "-cpu", "cortex-a72", str(BUILT["neon_dotprod"])],
                          input=jobs.stream(), capture_output=True, timeout=60)
    assert done.returncode != 0


def test_c_api_matches_cdef(neon_results, tmp_path):
    """Every function Python declares (cpu_kernels.CDEF) is defined by the ARM build with that
    exact signature: CDEF's prototypes compiled after the sources (a conflicting type is an
    error) and every function's address taken (a missing one fails to link)."""
    names = re.findall(r"\b(ek_\w+)\s*\(", cpu_kernels.CDEF)
    assert len(names) >= 13
    src = tmp_path / "api.c"
    table = ", ".join(f"(void *){name}" for name in names)
    includes = "".join(f'#include "{p.name}"\n' for p in cpu_kernels.SOURCES["aarch64"])
    # CDEF's struct typedefs repeat the sources' (cffi checks their layout when it builds);
    # as C, a second typedef of an anonymous struct is another type, so only the functions
    prototypes = re.sub(r"typedef struct \{.*?\} \w+;", "", cpu_kernels.CDEF, flags=re.S)
    src.write_text(includes + prototypes
                   + f"\nint main(void) {{\n    void *fns[] = {{{table}}};\n"
                   + "    return fns[0] == 0;\n}\n")
    done = subprocess.run([CROSS_CC, "-O0", "-pthread", "-static", "-Werror", "-I", str(NATIVE),
                           str(src), "-o", str(tmp_path / "api"), "-lm"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert subprocess.run([QEMU, str(tmp_path / "api")], timeout=60).returncode == 0


def test_unsupported_type_is_refused(neon_results):
    for variant, res in neon_results.items():
        assert res[("mm", Q.F16, 1, 1)][0] == -2, variant


def test_no_packed_layout_on_arm(neon_results):
    """ek_packed_bytes is 0 (the backend then keeps the file's blocks) and the packed entry
    points answer -2, as the AVX2-only x86 build had them."""
    for variant, res in neon_results.items():
        assert res["packed"] == (0, -2, -2, -2, -2), variant


def test_matvec_multi_equals_separate_matmuls(neon_results):
    """Mixed-type groups (Q4_K, Q8_0, Q6_K, Q5_0: both activation roundings in one call):
    each matrix's part bit-identical to its own matmul, and close to numpy."""
    for variant, res in neon_results.items():
        for n in MULTI_TOKENS:
            status, got = res[("multi", n)]
            assert status == 0, (variant, n)
            at = 0
            for i, (qtype, w) in enumerate(MULTI):
                part = got[at:at + n * w.shape[0]].reshape(n, w.shape[0])
                at += part.size
                alone = res[("single", i, n)][1].reshape(part.shape)
                assert np.array_equal(bits(part), bits(alone)), (variant, qtype.name, n)
                want, room = reference(qtype, w, X[:n])
                assert np.all(np.abs(part - want) <= 4e-6 * room + 1e-6), (variant, qtype.name, n)
            assert at == got.size


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's silu at -120
def test_elementwise_against_numpy(neon_results):
    """silu/gelu (one piece and pieces across threads), RMS norm, RoPE (both pair layouts)."""
    for variant, res in neon_results.items():
        for gelu, op in ((False, "silu_mul"), (True, "gelu_tanh_mul")):
            small = res[("gated", gelu, 1)]
            np.testing.assert_allclose(small, getattr(REF, op)(GATE[:100], UP[:100]), rtol=1e-4,
                                       atol=1e-5, err_msg=variant)
            big = res[("gated", gelu, 2)]
            np.testing.assert_allclose(big, getattr(REF, op)(GATE, UP), rtol=1e-4, atol=1e-4,
                                       err_msg=variant)
        want = REF.rms_norm(RMS_X, RMS_W, 1e-6)
        np.testing.assert_allclose(res["rms"].reshape(RMS_X.shape), want, rtol=1e-5, atol=1e-6,
                                   err_msg=variant)
        for neox in (False, True):
            got = res[("rope", neox)].reshape(ROPE_X.shape)
            want = REF.rope(ROPE_X, ROPE_POS, 10000.0, neox)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=variant)


def test_attention_against_numpy_and_batch_invariant(neon_results):
    """GQA (6 query heads a KV head), a windowed causal mask, with and without a softcap;
    a token's rows bit-identical whether its batch is 1, 4, 17 or 20 tokens."""
    scale = ATT_Q.shape[-1] ** -0.5
    for variant, res in neon_results.items():
        for softcap in (0.0, 30.0):
            status, got = res[("att", softcap)]
            assert status == 0, variant
            want = REF.attention(ATT_Q, ATT_K, ATT_V, ATT_MASK, scale, softcap)
            np.testing.assert_allclose(got.reshape(ATT_Q.shape), want, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{variant} softcap={softcap}")
        whole = res[("att", 0.0)][1].reshape(ATT_Q.shape)
        for lo, hi in ATT_SPLITS:
            status, part = res[("att-part", lo, hi)]
            assert status == 0
            assert np.array_equal(bits(part.reshape(hi - lo, *ATT_Q.shape[1:])),
                                  bits(whole[lo:hi])), (variant, lo, hi)


def test_attention_append_stores_f16_and_attends(neon_results):
    """A decode step's rows stored as numpy's f16 conversion stores them (bit for bit, the
    other slots untouched) and each row's attention over its window as the numpy backend's."""
    q, k, v, slots, firsts, kc, vc = APPEND
    scale = q.shape[-1] ** -0.5
    for variant, res in neon_results.items():
        status, out, got_k, got_v = res["append"]
        assert status == 0, variant
        for j, (slot, first) in enumerate(zip(slots, firsts, strict=True)):
            want_k, want_v = kc[j].copy(), vc[j].copy()
            want_k[slot], want_v[slot] = k[j], v[j]
            assert np.array_equal(got_k[j], want_k.view(np.uint16)), (variant, j)
            assert np.array_equal(got_v[j], want_v.view(np.uint16)), (variant, j)
            mask = (np.arange(slot + 1) >= first)[None, :]
            want = REF.attention(q[j:j + 1], want_k[:slot + 1], want_v[:slot + 1], mask, scale,
                                 0.0)
            np.testing.assert_allclose(out[j:j + 1], want, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{variant} row {j}")
