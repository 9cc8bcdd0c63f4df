"""The soak test, short: `edgellm chat` with stdin piped, a 128-token KV budget and short
replies, under each overflow policy, for ~20 s and at least 6 turns. No error, the budget
overflows and is handled, arithmetic probes still answered, resident memory flat after the
warm-up turns. The long run (an hour per policy) is ``scripts/soak_chat.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from edgellm import store

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not store.is_installed(store.DEFAULT_MODEL),
                                 reason="needs the default model (edgellm pull)")]

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak_chat.py"
RSS_GROWTH_MIB = 24  # after warm-up; a leak of a few KB a token shows within a few turns


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak_chat", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("policy", ["rotate", "truncate-turns"])
def test_short_soak(policy):
    soak = _soak_module()
    report = soak.soak(policy, seconds=20, model=store.DEFAULT_MODEL, ctx=128, max_tokens=24,
                       threads=2, min_turns=6, turn_timeout=180)
    assert not report.errors and report.exit_code == 0, report.summary()
    assert report.turns >= 6 and report.overflows >= 1, report.summary()
    assert report.empty_replies == 0, report.summary()
    assert report.probes >= 2 and report.probes_right >= 1, report.summary()
    assert report.rss_max_mib - report.rss_start_mib < RSS_GROWTH_MIB, report.summary()
