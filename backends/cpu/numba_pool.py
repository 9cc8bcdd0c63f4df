"""The Numba path's thread pool for mat-vec: barrier-free, as the C kernels' (native/cpu_pool.c).

Numba's ``prange`` is fork-join: every region splits its rows evenly across the threads and
waits for all of them. On a busy machine (a laptop's browser, another process on one of two
cores) a helper that is not scheduled holds every matmul up for a time slice: decode fell to
1-5 tokens/s whenever one other process ran. Here the caller publishes a job and works through
its chunks of 16 rows itself; helpers claim chunks with a compare-and-swap on one 64-bit word
(generation | chunk count | next chunk), a share of those left per claim, so a helper that
wakes late finds the job done and nobody waits for it, only for chunks already claimed.
Helpers spin briefly between jobs (decode issues them back to back), then sleep on an Event.

Jobs carry raw addresses (the weights' planes, the int8 activations, the output), read by the
vector kernels of ``numba_simd``, where the compiled side of the pool lives too (Numba's cache
only notices changes to a function's own file); the arrays behind the addresses stay
referenced by the caller until the job is done.
"""

from __future__ import annotations

import threading

import numpy as np

from .numba_simd import (
    _CTL_WORDS,
    _CTR,
    _PARTS,
    _SLEEPING,
    CHUNK_ROWS,
    CLAIM_PARTS,
    KINDS,
    SPIN_POLLS,
    WEIGHT_FIELDS,
    _add,
    _get,
    _helper_poll,
    _publish,
    _run_alone,
    _work_and_wait,
)


def weight_job(kind: str, rows: int, blocks: int, planes: tuple) -> np.ndarray:
    """The weight's part of a job (int64[13]): kind, rows, blocks per row, the planes'
    addresses and row strides. The planes must outlive every job."""
    job = np.zeros(WEIGHT_FIELDS, dtype=np.int64)
    job[0], job[1], job[2] = KINDS[kind], rows, blocks
    for i, p in enumerate(planes):
        job[3 + i] = p.ctypes.data
        job[8 + i] = p.strides[0]
    return job



class MatvecPool:
    """Runs mat-vec jobs on the caller and ``threads - 1`` helper threads (daemon threads,
    started on first use); one job at a time."""

    def __init__(self, threads: int):
        self.threads = max(1, int(threads))
        self._ctl = np.zeros(_CTL_WORDS + 8, dtype=np.int64)
        self._ctl[_PARTS] = CLAIM_PARTS * self.threads
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
