"""Kernel variants timed on the GPU at their first use, the fastest remembered per card.

A mat-vec's tile (rows per program, chunks per step, warps, K split) and a prompt GEMM's path
(dequantize + cuBLAS, or the fused triton kernel in one of its tiles) are worth different
amounts on different cards and matrix shapes: a table swept on one H100 is a guess on any
other GPU. So the first time a shape runs, outside a CUDA graph capture, every candidate is
timed on the real inputs with the L2 flushed before each launch (``triton.testing.do_bench``:
decode reads weights that the L2 does not hold), and the fastest is kept for the process and
written to ``$EDGELLM_HOME/tuning/<gpu>.json``, so a later process on the same card, triton
and kernel version times nothing. A candidate that fails to compile or launch is skipped;
when every one fails, or while a graph is being captured (nothing may synchronize there),
the caller's default runs. ``EDGELLM_TUNE=0`` turns timing off (defaults only).

Kernels ask through ``choose(device, key, ...)``: one ``Tuner`` per CUDA device
(``tuner_for``), none on the CPU (the caller's default runs).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from edgellm.atomic import atomic_write_text

log = logging.getLogger(__name__)

#: bump when a kernel's code changes what a remembered choice is worth
KERNELS_VERSION = 4


#: per CUDA device index: the peak of allocated memory before timing reset it
_peaks_before: dict[int, int] = {}


def cold_microseconds(run: Callable[[], Any]) -> float:
    """Median GPU time of ``run()`` in microseconds, L2 flushed before each launch. The
    flush's 256 MiB buffer is the timing's, not the model's: the device's peak memory is
    reset after it (``peak_memory`` keeps the peak from before) and the buffer released."""
    import torch
    from triton.testing import do_bench

    device = torch.cuda.current_device()
    before = torch.cuda.max_memory_allocated(device)
    us = 1e3 * do_bench(run, warmup=5, rep=20, return_mode="median")
    _peaks_before[device] = max(_peaks_before.get(device, 0), before)
    torch.cuda.reset_peak_memory_stats(device)
    torch.cuda.empty_cache()
    return us


def peak_memory(device) -> int:
    """Bytes allocated at most on a CUDA device, except what timing kernels allocated."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return max(int(torch.cuda.max_memory_allocated(index)), _peaks_before.get(index, 0))


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Tuner:
    """The fastest of a set of candidates per key, timed once (then read from ``path``).

    ``timer(run) -> microseconds`` times one candidate's launch; ``busy()`` says when no
    timing may happen (a CUDA graph capture). ``version`` names the card, the triton and
    the kernels a file's choices were timed with: a file with another is not read.
    """

    def __init__(self, path: Path | None, version: str,
                 timer: Callable[[Callable[[], Any]], float] = cold_microseconds,
                 busy: Callable[[], bool] = _capturing):
        self.path, self.version, self.timer, self.busy = path, version, timer, busy
        self.seconds = 0.0  # spent timing candidates (compiles included), this process
        self._lock = threading.RLock()
        self._choices: dict[str, Any] = self._read()  # by the key's name, as saved
        self._known: dict[tuple, Any] = {}  # by the key itself: each launch's lookup

    def choose(self, key: tuple[Hashable, ...], candidates: Sequence[Any],
               run: Callable[[Any], Any], default: Any) -> Any:
        """The remembered choice for ``key``, else the fastest candidate (``run(c)``
        launches candidate c once), else ``default``. Candidates are tuples or strings."""
        known = self._known.get(key)  # (every launch asks: a dict lookup, no lock)
        if known is not None:
            return known
        name = ":".join(map(str, key))
        with self._lock:
            if name not in self._choices:
                if self.busy():
                    return default
                start = time.perf_counter()
                best = self._fastest(name, candidates, run)
                self.seconds += time.perf_counter() - start
                if best is None:
                    return default
                self._choices[name] = best
                self._write()
            self._known[key] = self._choices[name]
            return self._known[key]

    def _fastest(self, name: str, candidates: Sequence[Any], run) -> Any:
        timed = []
        for c in candidates:
            try:
                run(c)  # compile and allocate outside the timing
                timed.append((self.timer(lambda c=c: run(c)), c))
            except Exception as exc:  # too large for the registers or shared memory, ...
                log.debug("tuning %s: %s failed: %s", name, c, exc)
        if not timed:
            log.warning("tuning %s: every candidate failed; the default runs", name)
            return None
        us, best = min(timed, key=lambda t: t[0])
        log.info("tuned %s: %s (%.1f us; %d candidates)", name, best, us, len(timed))
        return best

    def _read(self) -> dict[str, Any]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            if saved.get("version") != self.version:
                return {}
            return {k: _from_json(v) for k, v in saved["choices"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("ignoring the tuning file %s (%s); timing again", self.path, exc)
            return {}

    def _write(self) -> None:
        """Merge with what another process may have written since, then replace the file."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**self._read(), **self._choices}
            text = json.dumps({"version": self.version, "choices": merged}, indent=1,
                              sort_keys=True)
            atomic_write_text(self.path, text)
        except OSError as exc:  # a read-only home: choices last for this process only
            log.warning("could not save tuning choices to %s: %s", self.path, exc)


def _from_json(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def device_file(home: Path, device_name: str) -> Path:
    """``home/tuning/<card's name as a file name>.json``."""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower() or "gpu"
    return home / "tuning" / f"{slug}.json"


#: Tuners by device name (tests install their own), and by the device objects that asked
_tuners: dict[str, Tuner] = {}
_by_device: dict = {}


def tuner_for(device) -> Tuner | None:
    """The device's ``Tuner``: one per CUDA device, its choices saved per card under
    ``$EDGELLM_HOME/tuning``; None elsewhere and with ``EDGELLM_TUNE=0``."""
    if device in _by_device:  # (every launch asks: a dict lookup, nothing more)
        return _by_device[device]
    import torch

    key = device_key(device)
    if key not in _tuners:
        if not key.startswith("cuda") or os.environ.get("EDGELLM_TUNE", "1") == "0":
            return None
        _tuners[key] = _new_tuner(torch.device(key))
    _by_device[device] = _tuners[key]
    return _tuners[key]


def device_key(device) -> str:
    """The name a device's tuner is kept under: "cuda" and "cuda:0" are one GPU."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def choose(device, key: tuple[Hashable, ...], candidates: Sequence[Any],
           run: Callable[[Any], Any], default: Any) -> Any:
    """``Tuner.choose`` with the device's tuner; ``default`` where there is none."""
    tuner = tuner_for(device)
    return default if tuner is None else tuner.choose(key, candidates, run, default)


def _new_tuner(device) -> Tuner:
    import torch
    import triton

    from edgellm.store import edgellm_home

    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    version = (f"{name} sm{major}{minor} triton {triton.__version__} torch "
               f"{torch.__version__} kernels {KERNELS_VERSION}")
    return Tuner(device_file(edgellm_home(), name), version)
