"""The Numba path's thread pool for mat-vec: barrier-free, as the C kernels' (native/cpu_pool.c).

Numba's ``prange`` is fork-join: every region splits its rows evenly across the threads and
waits for all of them. On a busy machine (a laptop's browser, another process on one of two
cores) a helper that is not scheduled holds every matmul up for a time slice: decode fell to
1-5 tokens/s whenever one other process ran. Here the caller publishes a job and works through
its chunks of 16 rows itself; helpers claim chunks with a compare-and-swap on one 64-bit word
(generation | chunk count | next chunk), so a helper that wakes late finds the job done and
nobody waits for it, only for chunks already claimed. Helpers spin briefly between jobs (decode
issues them back to back), then sleep on an Event.

Jobs carry raw addresses (the weights' planes, the int8 activations, the output), read by the
vector kernels of ``numba_simd``; the arrays behind them stay referenced by the caller until
the job is done.
"""

from __future__ import annotations

import threading

import numba as nb
import numpy as np

from . import numba_simd as simd
from .numba_quant import _JIT

#: rows per unit of work (as the C kernels)
CHUNK_ROWS = 16
#: idle polls (~0.2 ms) before a helper goes to sleep
SPIN_POLLS = 5000
#: kernel kinds in a job
KINDS = {"Q8_0": 0, "Q5_0": 1, "Q4_K": 2, "Q6_K": 3}

# ctl (int64): its own cache line each for the counter, the done count and the sleepers; then
# the job: kind, rows, blocks, 5 plane addresses, 5 plane strides, 3 activation addresses,
# 3 activation strides, out address, out stride (bytes per token), tokens
_CTR, _DONE, _SLEEPING, _JOB = 0, 8, 16, 24
#: a weight's part of a job (kind, rows, blocks, 5 addresses, 5 strides)
WEIGHT_FIELDS = 13
_ACT = _JOB + WEIGHT_FIELDS
_OUT, _OUT_STRIDE, _TOKENS = _ACT + 6, _ACT + 7, _ACT + 8
_CTL_WORDS = _TOKENS + 1


def weight_job(kind: str, rows: int, blocks: int, planes: tuple) -> np.ndarray:
    """The weight's part of a job (int64[13]): kind, rows, blocks per row, the planes'
    addresses and row strides. The planes must outlive every job."""
    job = np.zeros(WEIGHT_FIELDS, dtype=np.int64)
    job[0], job[1], job[2] = KINDS[kind], rows, blocks
    for i, p in enumerate(planes):
        job[3 + i] = p.ctypes.data
        job[8 + i] = p.strides[0]
    return job


@nb.njit(inline="always", **_JIT)
def _run_chunk(ctl, c):
    """Rows 16c..16c+15 of the published job, for each of its tokens."""
    kind, rows, blocks = ctl[_JOB], ctl[_JOB + 1], ctl[_JOB + 2]
    p0, p1, p2, p3, p4 = ctl[_JOB + 3], ctl[_JOB + 4], ctl[_JOB + 5], ctl[_JOB + 6], ctl[_JOB + 7]
    s0, s1, s2, s3, s4 = ctl[_JOB + 8], ctl[_JOB + 9], ctl[_JOB + 10], ctl[_JOB + 11], \
        ctl[_JOB + 12]
    xq, xd, xs = ctl[_ACT], ctl[_ACT + 1], ctl[_ACT + 2]
    tq, td, ts = ctl[_ACT + 3], ctl[_ACT + 4], ctl[_ACT + 5]
    out, out_stride, n = ctl[_OUT], ctl[_OUT_STRIDE], ctl[_TOKENS]
    for r in range(c * CHUNK_ROWS, min(rows, c * CHUNK_ROWS + CHUNK_ROWS)):
        a0, a1, a2, a3, a4 = p0 + r * s0, p1 + r * s1, p2 + r * s2, p3 + r * s3, p4 + r * s4
        for t in range(n):
            q, d, s = xq + t * tq, xd + t * td, xs + t * ts
            if kind == 0:
                v = simd.dot_q8_0(a0, a1, q, d, blocks)
            elif kind == 1:
                v = simd.dot_q5_0(a0, a1, a2, q, d, s, blocks)
            elif kind == 2:
                v = simd.dot_q4_k(a0, a1, a2, a3, a4, q, d, s, blocks)
            else:
                v = simd.dot_q6_k(a0, a1, a2, a3, q, d, s, blocks)
            simd.store_f32(out + t * out_stride + 4 * r, v)


@nb.njit(inline="always", **_JIT)
def _work(ctl, gen):
    """Claim and run chunks of job generation gen until none are left."""
    at = np.int64(ctl.ctypes.data)
    v = simd.atomic_load(at + 8 * _CTR)
    while True:
        chunks, nxt = (v >> 20) & 0xFFFFF, v & 0xFFFFF
        if (v >> 40) != gen or nxt >= chunks:
            return
        if simd.atomic_cas(at + 8 * _CTR, v, v + 1):
            _run_chunk(ctl, nxt)
            simd.atomic_add(at + 8 * _DONE, 1)
        v = simd.atomic_load(at + 8 * _CTR)


@nb.njit(nogil=True, **_JIT)
def _publish(ctl, job, xq, xd, xs, out):
    """Write the job into ctl and open it (a new generation); returns the generation and
    whether a helper sleeps (then the caller wakes it)."""
    at = np.int64(ctl.ctypes.data)
    for i in range(WEIGHT_FIELDS):
        ctl[_JOB + i] = job[i]
    ctl[_ACT], ctl[_ACT + 1], ctl[_ACT + 2] = xq.ctypes.data, xd.ctypes.data, xs.ctypes.data
    ctl[_ACT + 3], ctl[_ACT + 4], ctl[_ACT + 5] = xq.strides[0], xd.strides[0], xs.strides[0]
    ctl[_OUT], ctl[_OUT_STRIDE], ctl[_TOKENS] = out.ctypes.data, out.strides[0], xq.shape[0]
    chunks = (job[1] + CHUNK_ROWS - 1) // CHUNK_ROWS
    simd.atomic_store(at + 8 * _DONE, 0)
    gen = ((simd.atomic_load(at + 8 * _CTR) >> 40) + 1) & 0xFFFFFF
    simd.atomic_store(at + 8 * _CTR, (gen << 40) | (chunks << 20))
    return gen, simd.atomic_load(at + 8 * _SLEEPING) > 0


@nb.njit(nogil=True, **_JIT)
def _work_and_wait(ctl, gen, chunks):
    """The caller's share of job gen, then wait for chunks the helpers claimed."""
    _work(ctl, gen)
    at = np.int64(ctl.ctypes.data)
    while simd.atomic_load(at + 8 * _DONE) < chunks:
        simd.spin_pause()


@nb.njit(nogil=True, **_JIT)
def _helper_poll(ctl, seen, polls):
    """Run jobs as they are published; return the last generation seen once ``polls``
    consecutive polls found nothing new."""
    at = np.int64(ctl.ctypes.data)
    idle = 0
    while idle < polls:
        gen = simd.atomic_load(at + 8 * _CTR) >> 40
        if gen != seen:
            seen = gen
            _work(ctl, gen)
            idle = 0
        else:
            idle += 1
            simd.spin_pause()
    return seen


@nb.njit(nogil=True, **_JIT)
def _run_alone(ctl, job, xq, xd, xs, out):
    """The whole job on the calling thread (one thread, or too few rows to share)."""
    for i in range(WEIGHT_FIELDS):
        ctl[_JOB + i] = job[i]
    ctl[_ACT], ctl[_ACT + 1], ctl[_ACT + 2] = xq.ctypes.data, xd.ctypes.data, xs.ctypes.data
    ctl[_ACT + 3], ctl[_ACT + 4], ctl[_ACT + 5] = xq.strides[0], xd.strides[0], xs.strides[0]
    ctl[_OUT], ctl[_OUT_STRIDE], ctl[_TOKENS] = out.ctypes.data, out.strides[0], xq.shape[0]
    for c in range((job[1] + CHUNK_ROWS - 1) // CHUNK_ROWS):
        _run_chunk(ctl, c)


@nb.njit(**_JIT)
def _add(ctl, i, value):
    simd.atomic_add(np.int64(ctl.ctypes.data) + 8 * i, value)


@nb.njit(**_JIT)
def _get(ctl, i):
    return simd.atomic_load(np.int64(ctl.ctypes.data) + 8 * i)


class MatvecPool:
    """Runs mat-vec jobs on the caller and ``threads - 1`` helper threads (daemon threads,
    started on first use); one job at a time."""

    def __init__(self, threads: int):
        self.threads = max(1, int(threads))
        self._ctl = np.zeros(_CTL_WORDS + 8, dtype=np.int64)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._helpers: list[threading.Thread] = []

    def run(self, job: np.ndarray, xq, xd, xs, out) -> None:
        """out (n, rows) f32 = the job's weight . the int8 activations xq (n, cols) with their
        scales xd and sums xs (one row per token each)."""
        chunks = (int(job[1]) + CHUNK_ROWS - 1) // CHUNK_ROWS
        with self._lock:
            if self.threads == 1 or chunks < 2:
                _run_alone(self._ctl, job, xq, xd, xs, out)
                return
            if not self._helpers:
                self._start_helpers()
            gen, sleeping = _publish(self._ctl, job, xq, xd, xs, out)
            if sleeping:
                self._wake.set()
            _work_and_wait(self._ctl, gen, chunks)

    def _start_helpers(self) -> None:
        for i in range(self.threads - 1):
            t = threading.Thread(target=self._helper, name=f"edgellm-numba-{i}", daemon=True)
            t.start()
            self._helpers.append(t)

    def _helper(self) -> None:
        seen = _get(self._ctl, _CTR) >> 40
        while True:
            seen = _helper_poll(self._ctl, seen, SPIN_POLLS)
            self._wake.clear()
            _add(self._ctl, _SLEEPING, 1)
            if _get(self._ctl, _CTR) >> 40 == seen:  # nothing published since: sleep
                self._wake.wait()
            _add(self._ctl, _SLEEPING, -1)
