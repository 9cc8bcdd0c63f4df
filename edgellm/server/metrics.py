"""/metrics in the Prometheus text format: requests, queue, sequences, tokens, KV use."""

from __future__ import annotations

import os
from collections import Counter

from edgellm.engine import EngineStats

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def _metric(lines: list[str], name: str, kind: str, help_text: str,
            samples: list[tuple[str, float]]) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lines.append(f"{name}{labels} {value:g}" if isinstance(value, float)
                     else f"{name}{labels} {value}")


def render_metrics(s: EngineStats, http: Counter) -> str:
    """The exposition text for the engine's stats and the HTTP responses by route/status."""
    lines: list[str] = []
    _metric(lines, "edgellm_http_requests_total", "counter", "HTTP responses by route and status",
            [(f'{{route="{route}",status="{code}"}}', n)
             for (route, code), n in sorted(http.items())])
    _metric(lines, "edgellm_requests_submitted_total", "counter",
            "sequences submitted to the engine", [("", s.requests_submitted)])
    _metric(lines, "edgellm_requests_finished_total", "counter",
            "sequences finished, by finish reason",
            [(f'{{reason="{r}"}}', n) for r, n in sorted(s.requests_finished.items())])
    gauges = [
        ("edgellm_queue_depth", "requests waiting for a sequence slot", s.queue_depth),
        ("edgellm_slots", "sequence slots (KV caches) in the budget", s.slots),
        ("edgellm_slots_active", "slots generating now", s.slots_active),
        ("edgellm_slots_free", "slots free for a new request", s.slots_free),
        ("edgellm_sequence_context_tokens", "tokens one sequence may hold (--ctx)", s.ctx),
        ("edgellm_kv_cache_bytes", "bytes of the KV budget, allocated up front", s.kv_bytes),
        ("edgellm_kv_cache_tokens_used", "tokens held by active sequences", s.kv_tokens_used),
        ("edgellm_kv_cache_tokens_budget", "tokens all slots hold", s.kv_tokens_budget),
        ("edgellm_decode_tokens_per_second", "tokens sampled per second over the last 10 s",
         round(s.decode_tps, 3)),
        ("edgellm_cancel_steps_max", "most engine steps between a cancel and the slot's release",
         s.cancel_steps_max),
        ("process_resident_memory_bytes", "resident memory of the server process",
         resident_bytes()),
    ]
    for name, help_text, value in gauges:
        _metric(lines, name, "gauge", help_text, [("", value)])
    counters = [
        ("edgellm_prompt_tokens_total", "prompt tokens run through the model", s.prompt_tokens),
        ("edgellm_prompt_tokens_cached_total", "prompt tokens reused from a slot's cache",
         s.cached_tokens),
        ("edgellm_generated_tokens_total", "tokens generated", s.generated_tokens),
        ("edgellm_steps_total", "engine steps (forward passes)", s.steps),
        ("edgellm_engine_errors_total", "forward passes that failed", s.errors),
    ]
    for name, help_text, value in counters:
        _metric(lines, name, "counter", help_text, [("", value)])
    return "\n".join(lines) + "\n"
