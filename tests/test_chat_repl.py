"""`edgellm chat` end to end: the real REPL in a real terminal (tmux) with the default model.

One chat process serves the interactive tests in order (loading the model costs ~10 s per
process on the numpy backend); /load starts a second one, and piped stdin a third. Replies
are short (-n 24). The tmux server runs on its own socket, so no other session is touched.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from edgellm import store

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
    pytest.mark.skipif(not store.is_installed(store.DEFAULT_MODEL),
                       reason="needs the default model (edgellm pull)"),
]

CHAT = [sys.executable, "-m", "edgellm.apps.cli", "chat", "--max-tokens", "24"]
STATS_LINE = re.compile(r"^ttft \d+\.\d+s · .*$", re.M)
WAIT_S = 240  # generous: the numpy backend on a busy 2-core machine


class TmuxChat:
    """`edgellm chat` in a detached tmux pane: type into it, read its screen."""

    def __init__(self, tmp: Path, name: str, extra_args: tuple[str, ...] = ()):
        self.socket = f"edgellm-test-{os.getpid()}"
        self.name = name
        env = {"XDG_DATA_HOME": str(tmp / "data"), "TERM": "xterm-256color"}
        command = " ".join([
            "env -u NO_COLOR", *(f"{k}={shlex.quote(v)}" for k, v in env.items()),
            *map(shlex.quote, [*CHAT, *extra_args]),
        ])
        self.tmux("new-session", "-d", "-s", name, "-x", "110", "-y", "50", command)
        self.tmux("set-option", "-t", name, "remain-on-exit", "on")

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], check=True,
                              capture_output=True, text=True).stdout

    def screen(self) -> str:
        """Everything the pane shows, scrollback included, wrapped lines joined."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", self.name)

    def wait_for(self, ready: Callable[[str], bool], what: str, timeout: float = WAIT_S) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.screen()
            if ready(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; the screen:\n{self.screen()}")

    def wait_for_prompt(self, timeout: float = WAIT_S) -> str:
        return self.wait_for(at_prompt, "the >>> prompt", timeout)

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", self.name, "-l", text)
        self.tmux("send-keys", "-t", self.name, "Enter")

    def key(self, key: str) -> None:
        self.tmux("send-keys", "-t", self.name, key)

    def ask(self, text: str) -> str:
        """Send a line and wait for the reply's stats line and the next prompt."""
        before = len(STATS_LINE.findall(self.screen()))
        self.type(text)
        return self.wait_for(lambda s: len(STATS_LINE.findall(s)) > before and at_prompt(s),
                             f"a reply to {text!r}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-session", "-t", self.name],
                       capture_output=True)


def at_prompt(screen: str) -> bool:
    lines = screen.rstrip("\n").splitlines()
    return bool(lines) and lines[-1].rstrip() == ">>>"


def last_reply(screen: str, after: str) -> str:
    """The reply text between the last input line ``>>> after`` and the stats line."""
    start = screen.rindex(f">>> {after}\n") + len(f">>> {after}\n")
    end = STATS_LINE.search(screen, start).start()
    return screen[start:end].strip()


@pytest.fixture(scope="module")
def chat_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chat")


@pytest.fixture(scope="module")
def chat(chat_tmp):
    session = TmuxChat(chat_tmp, "first")
    session.wait_for_prompt()
    yield session
    session.close()


def test_a_question_gets_a_streamed_answer(chat):
    before = len(STATS_LINE.findall(chat.screen()))
    chat.type("Write a short poem about the sea.")
    partial_states = set()
    while len(STATS_LINE.findall(screen := chat.screen())) == before:
        tail = screen.split(">>> Write a short poem about the sea.\n", 1)[-1].strip()
        if tail:
            partial_states.add(tail)
        time.sleep(0.05)
    screen = chat.wait_for_prompt()
    reply = last_reply(screen, "Write a short poem about the sea.")
    assert reply
    assert len(partial_states) >= 2, "the reply appeared all at once, not streamed"
    assert re.search(r"gen \d+ tok @ [\d.]+ t/s · kv \d+/\d+", screen)


def test_set_temp_0_then_regen_is_deterministic(chat):
    chat.type("/set temp 0")
    chat.wait_for(lambda s: "temp = 0" in s, "the /set acknowledgement")
    first = last_reply(chat.ask("/regen"), "/regen")
    second = last_reply(chat.ask("/regen"), "/regen")
    assert first and first == second


def test_ctrl_c_mid_reply_returns_to_prompt_and_the_next_turn_works(chat):
    chat.type("/set max_tokens 400")
    chat.wait_for(lambda s: "max_tokens = 400" in s, "the /set acknowledgement")
    chat.type("Count from 1 to 300, one number per line.")
    chat.wait_for(lambda s: re.search(r"one number per line\.\n.*\d", s, re.S) is not None,
                  "the reply to start")
    chat.key("C-c")
    screen = chat.wait_for_prompt(timeout=60)
    assert "[cut]" in screen and "· cut" in screen
    assert "^C" not in screen
    chat.type("/set max_tokens 24")
    screen = chat.ask("What is 2+2? Answer with one number.")
    assert last_reply(screen, "What is 2+2? Answer with one number.")
    assert not STATS_LINE.findall(screen)[-1].endswith("cut")


def test_save_then_load_in_a_new_process_restores_the_conversation(chat, chat_tmp):
    saved = chat_tmp / "conversation.json"
    chat.type(f"/save {saved}")
    chat.wait_for(lambda s: "saved " in s and str(saved) in s, "the /save acknowledgement")
    second = TmuxChat(chat_tmp, "second")
    try:
        second.wait_for_prompt()
        second.type(f"/load {saved}")
        screen = second.wait_for(lambda s: "loaded " in s and at_prompt(s), "/load")
        assert ">>> Write a short poem about the sea." in screen
        assert ">>> What is 2+2? Answer with one number." in screen
        assert "[cut]" in screen  # the cut reply stays marked
        assert "temp 0.0" in screen and "max_tokens 24" in screen  # parameters came back
        screen = second.ask("/regen")
        assert last_reply(screen, "/regen")
    finally:
        second.close()


def test_piped_stdin_reads_turns_and_prints_plain_replies(tmp_path):
    turns = "Say hello.\n/set temp 0\nWhat is 2+2?\n"
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    env.pop("NO_COLOR", None)
    done = subprocess.run(CHAT, input=turns, capture_output=True, text=True, env=env,
                          timeout=WAIT_S * 2)
    assert done.returncode == 0, done.stderr
    assert "temp = 0" in done.stderr  # command output stays off stdout
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) >= 2
    assert ">>>" not in done.stdout and "\x1b" not in done.stdout + done.stderr
