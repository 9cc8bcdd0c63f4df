"""Shared fixtures: real models from the store (installed by `edgellm pull`, see README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgellm import store

MODELS = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma-3-270m")
REFERENCE_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "reference"


def _reference_dir() -> Path:
    """llama.cpp reference outputs: tests/reference in the repo, else ../shared/reference."""
    local = Path(__file__).parent / "reference"
    return local if local.is_dir() else REFERENCE_DIR


@pytest.fixture(scope="session")
def model_path():
    """model_path(name) -> Path of an installed catalog model (pulled if missing)."""

    def get(name: str) -> Path:
        return store.pull(name)

    return get


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    return _reference_dir()
