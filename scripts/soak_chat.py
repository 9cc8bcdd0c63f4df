"""Soak test: chat for a long time through `edgellm chat` with stdin piped, under a small KV
budget, and watch resident memory, errors, overflows and whether the replies stay sensible.

Each turn is one line on the REPL's stdin; the reply comes back on stdout and the stats line
(``--verbose``) on stderr marks its end. Every third turn is an arithmetic probe ("What is
17 plus 25? ...") whose answer is checked, as a cheap measure of coherence. Resident memory
(VmRSS of the chat process) is read after every turn.

    .venv/bin/python scripts/soak_chat.py --policy rotate --minutes 60 --json rotate.json

Reports, per policy: RSS after warm-up (the first turns), after 5 minutes and at the end, the
largest RSS seen, turns completed, overflows handled (truncation or rotation notices), probe
answers right, and errors (any ``error:`` line from the REPL, or the process dying).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATS_LINE = re.compile(r"^ttft \d+\.\d+s · ")
OVERFLOW_NOTICE = re.compile(r"^(dropped the oldest|the KV budget of \d+ tokens is full)")
TOPICS = ["a haiku about rivers", "what a Python list comprehension is",
          "why the sky is blue", "a tip for writing readable code", "what a hash map is",
          "a sentence about autumn", "how binary search works", "what recursion is"]
WARMUP_TURNS = 3


@dataclass
class SoakReport:
    """What one soak run measured (memory in MiB, times in seconds)."""

    policy: str
    model: str
    ctx: int
    max_tokens: int
    seconds: float = 0.0
    turns: int = 0
    overflows: int = 0
    probes: int = 0
    probes_right: int = 0
    errors: list[str] = field(default_factory=list)
    exit_code: int | None = None
    rss_start_mib: float = 0.0  # after the warm-up turns
    rss_5min_mib: float | None = None
    rss_end_mib: float = 0.0
    rss_max_mib: float = 0.0
    rss_samples: list[tuple[float, float]] = field(default_factory=list)  # (s, MiB)
    empty_replies: int = 0

    def summary(self) -> str:
        five = f"{self.rss_5min_mib:.1f}" if self.rss_5min_mib is not None else "n/a"
        return (f"{self.policy}: {self.seconds / 60:.1f} min, {self.turns} turns, "
                f"{self.overflows} overflows, probes {self.probes_right}/{self.probes}, "
                f"RSS start {self.rss_start_mib:.1f} / 5 min {five} / end "
                f"{self.rss_end_mib:.1f} / max {self.rss_max_mib:.1f} MiB, "
                f"{len(self.errors)} errors, exit {self.exit_code}")


def rss_mib(pid: int) -> float:
    """Resident memory of a process (VmRSS), in MiB; 0 once it has gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _pump(stream, sink: queue.Queue) -> None:
    """Lines of ``stream`` into ``sink`` (None at end of file)."""
    for line in iter(stream.readline, ""):
        sink.put(line)
    sink.put(None)


def next_turn(turn: int, rng: random.Random) -> tuple[str, str | None]:
    """(the line to send, the answer a probe expects or None)."""
    if turn % 3 == 2:
        a, b = rng.randint(10, 60), rng.randint(10, 60)
        return f"What is {a} plus {b}? Reply with just the number.", str(a + b)
    return f"In two sentences, tell me {rng.choice(TOPICS)}.", None


def soak(policy: str, seconds: float, model: str, ctx: int = 256, max_tokens: int = 48,
         threads: int = 1, backend: str = "auto", seed: int = 0,
         turn_timeout: float = 300.0, log=None, min_turns: int = 0) -> SoakReport:
    """Chat through the piped REPL for ``seconds`` (and at least ``min_turns`` turns);
    returns the measurements."""
    cmd = [sys.executable, "-m", "edgellm.apps.cli", "chat", "-m", model, "--backend", backend,
           "--threads", str(threads), "--ctx", str(ctx), "--policy", policy, "-n",
           str(max_tokens), "--temp", "0", "--verbose", "--no-color"]
    report = SoakReport(policy, model, ctx, max_tokens)
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
    out_q: queue.Queue = queue.Queue()
    err_q: queue.Queue = queue.Queue()
    for stream, q in ((proc.stdout, out_q), (proc.stderr, err_q)):
        threading.Thread(target=_pump, args=(stream, q), daemon=True).start()
    rng = random.Random(seed)
    start = time.monotonic()
    warm_at = None
    try:
        while time.monotonic() - start < seconds or report.turns < min_turns:
            line, expected = next_turn(report.turns, rng)
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
            if not _await_reply(proc, out_q, err_q, report, expected, turn_timeout):
                break
            now = time.monotonic() - start
            rss = rss_mib(proc.pid)
            report.rss_samples.append((round(now, 1), round(rss, 1)))
            report.rss_max_mib = max(report.rss_max_mib, rss)
            if report.turns == WARMUP_TURNS:
                report.rss_start_mib, warm_at = rss, now
            if report.rss_5min_mib is None and warm_at is not None and now - warm_at >= 300:
                report.rss_5min_mib = rss
            report.rss_end_mib = rss
            if log and report.turns % 10 == 0:
                log(f"[{policy}] {now / 60:.1f} min: {report.turns} turns, "
                    f"{report.overflows} overflows, RSS {rss:.1f} MiB")
    finally:
        report.seconds = time.monotonic() - start
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            report.exit_code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            report.exit_code = proc.wait()
            report.errors.append("the chat did not exit at end of input")
        _drain(err_q, report)
    if not report.rss_start_mib:
        report.rss_start_mib = report.rss_samples[0][1] if report.rss_samples else 0.0
    return report


def _drain(err_q: queue.Queue, report: SoakReport) -> None:
    while True:
        try:
            line = err_q.get_nowait()
        except queue.Empty:
            return
        if line is not None:
            _note_stderr(line, report)


def _note_stderr(line: str, report: SoakReport) -> None:
    text = line.strip()
    if OVERFLOW_NOTICE.match(text):
        report.overflows += 1
    elif text.startswith(("error:", "edgellm: error:", "Traceback")):
        report.errors.append(text)


def _await_reply(proc, out_q, err_q, report: SoakReport, expected: str | None,
                 timeout: float) -> bool:
    """Wait for the turn's stats line; score the reply. False when the chat has gone."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = err_q.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None or time.monotonic() > deadline:
                report.errors.append("the chat died" if proc.poll() is not None else
                                     f"no reply within {timeout:.0f} s")
                return False
            continue
        if line is None:
            report.errors.append("the chat closed its stderr")
            return False
        if STATS_LINE.match(line):
            break
        _note_stderr(line, report)
        if report.errors and report.errors[-1].startswith(("error:", "edgellm: error:")):
            return True  # the REPL reported a failed turn and carries on
    time.sleep(0.05)  # the reply's last newline was flushed to stdout before the stats
    reply = []
    while True:
        try:
            piece = out_q.get_nowait()
        except queue.Empty:
            break
        if piece is not None:
            reply.append(piece)
    text = "".join(reply).strip()
    report.turns += 1
    report.empty_replies += not text
    if expected is not None:
        report.probes += 1
        report.probes_right += expected in text
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", choices=["rotate", "truncate-turns", "both"], default="both")
    p.add_argument("--minutes", type=float, default=60.0, help="per policy")
    p.add_argument("-m", "--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--ctx", type=int, default=256, help="KV budget in tokens (small on purpose)")
    p.add_argument("-n", "--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", default="auto")
    p.add_argument("--parallel", action="store_true", help="run both policies at once")
    p.add_argument("--json", type=Path, default=None, help="write the reports here")
    args = p.parse_args(argv)
    policies = ["rotate", "truncate-turns"] if args.policy == "both" else [args.policy]

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def one(policy: str) -> SoakReport:
        return soak(policy, args.minutes * 60, args.model, args.ctx, args.max_tokens,
                    args.threads, args.backend, log=log)

    if args.parallel:
        results: dict[str, SoakReport] = {}
        workers = [threading.Thread(target=lambda q=q: results.__setitem__(q, one(q)))
                   for q in policies]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        reports = [results[q] for q in policies]
    else:
        reports = [one(q) for q in policies]
    for r in reports:
        print(r.summary())
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=1) + "\n")
    return 0 if all(not r.errors and r.exit_code == 0 for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
