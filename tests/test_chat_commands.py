"""The chat REPL's pieces without a terminal: multi-line input, slash commands, stats line."""

from __future__ import annotations

import pytest

from edgellm.apps.chat import collect_message
from edgellm.apps.chat_commands import (
    ExitChat,
    ReplState,
    format_stats,
    is_command,
    run_command,
)
from edgellm.chat import ChatSession, TurnStats
from tests.test_chat_session import GREEDY, FakeModel, reply_text


class Recorder:
    def __init__(self):
        self.lines: list[tuple[str, str]] = []

    def info(self, text: str) -> None:
        self.lines.append(("info", text))

    def notice(self, text: str) -> None:
        self.lines.append(("notice", text))

    def transcript(self, role: str, text: str, cut: bool = False) -> None:
        self.lines.append((role, text + (" [cut]" if cut else "")))

    def text(self) -> str:
        return "\n".join(t for _, t in self.lines)


def feed(*lines: str):
    it = iter(lines)
    return lambda: next(it, None)


def test_triple_quote_block_spans_lines():
    assert collect_message('"""first', feed("second", 'third"""')) == "first\nsecond\nthird"
    assert collect_message('"""', feed("a", '"""')) == "a"
    assert collect_message('"""one line"""', feed()) == "one line"


def test_trailing_backslash_continues():
    assert collect_message("a \\", feed("b\\", "c")) == "a \nb\nc"


def test_unterminated_block_ends_at_end_of_input():
    assert collect_message('"""x', feed("y")) == "x\ny"


def test_double_slash_is_a_message():
    assert is_command("/help") and not is_command("//etc/hosts is a path")


@pytest.fixture
def state():
    return ReplState(ChatSession(FakeModel(), GREEDY), Recorder())


def test_unknown_command_gets_a_hint(state):
    assert run_command(state, "/sett temp 0") is None
    kind, text = state.out.lines[-1]
    assert kind == "notice" and "/set" in text and "/help" in text


def test_set_changes_params_and_rejects_bad_values(state):
    run_command(state, "/set temp 0")
    run_command(state, "/set top_k 5")
    run_command(state, "/set seed none")
    assert (state.session.params.temperature, state.session.params.top_k) == (0.0, 5)
    run_command(state, "/set top_p 7")
    assert "top_p" in state.out.lines[-1][1] and state.session.params.top_p == 0.95
    run_command(state, "/set verbose off")
    assert state.verbose is False


def test_exit_quit_and_bye_leave(state):
    for line in ("/exit", "/quit", "/bye", "/QUIT"):
        with pytest.raises(ExitChat):
            run_command(state, line)


def test_regen_and_read_return_reply_streams(state, tmp_path):
    reply_text(state.session.send("hello"))
    assert reply_text(run_command(state, "/regen"))
    notes = tmp_path / "notes.txt"
    notes.write_text("line one\nline two\n")
    assert reply_text(run_command(state, f"/read {notes} summarise"))
    assert state.session.messages[-2]["content"] == "summarise\n\nline one\nline two\n"


def test_save_load_replays_the_transcript(state, tmp_path):
    reply_text(state.session.send("remember me"))
    run_command(state, f"/save {tmp_path / 'c.json'}")
    other = ReplState(ChatSession(FakeModel(), GREEDY), Recorder())
    run_command(other, f"/load {tmp_path / 'c.json'}")
    assert ("user", "remember me") in other.out.lines
    assert other.session.messages == state.session.messages


def test_show_and_help_describe_the_session(state):
    run_command(state, "/show")
    shown = state.out.text()
    assert "fake" in shown and "temp 0" in shown and "truncate-turns" in shown
    run_command(state, "/help")
    assert "/regen" in state.out.text()


def test_stats_line_has_ttft_speeds_kv_and_draft():
    stats = TurnStats(prompt_tokens=12, reused_tokens=40, generation_tokens=24, ttft_s=0.31,
                      prompt_tps=80.0, generation_tps=9.5, kv_used=76, kv_budget=4096,
                      finish_reason="cut", draft={"drafted": 20, "accepted": 15,
                                                  "acceptance_rate": 0.75})
    line = format_stats(stats)
    assert line == ("ttft 0.31s · prompt 12 tok @ 80.0 t/s (40 cached) · gen 24 tok @ 9.5 t/s"
                    " · kv 76/4096 · draft 15/20 (75%) · cut")
