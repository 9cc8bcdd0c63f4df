"""`edgellm chat`: chat with a model in the terminal (a streaming REPL).

In a terminal it reads with line editing and a persistent history; with stdin piped it
reads one turn per line and prints the replies plainly, so it scripts cleanly. The
conversation itself (prompt-cache reuse, regen, save/load, budget policy) is
``edgellm.chat.ChatSession``; the slash commands are in ``chat_commands``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from edgellm.chat import ChatEvent, ChatSession, Notice

from .chat_commands import ExitChat, ReplState, format_stats, is_command, run_command
from .common import (
    add_draft_args,
    add_model_args,
    add_sampling_args,
    load_draft_from_args,
    load_from_args,
    sampling_from_args,
)

PROMPT = ">>> "
CONTINUATION = "... "
FENCE = '"""'


# -- arguments ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgellm chat", description=__doc__.splitlines()[0])
    add_model_args(p)
    p.set_defaults(policy="truncate-turns")  # chat drops whole old turns by default
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--verbose", dest="verbose", action="store_true", default=None,
                   help="a stats line after each reply (default in a terminal)")
    p.add_argument("--quiet", dest="verbose", action="store_false",
                   help="no stats lines (default with piped stdin)")
    p.add_argument("--no-color", action="store_true", help="plain output (also: NO_COLOR=1)")
    add_sampling_args(p, max_tokens=512)
    add_draft_args(p)
    return p


# -- output ---------------------------------------------------------------------------------
class Console:
    """Everything the REPL writes, colour only where it is welcome.

    In a terminal all of it goes to stdout; with stdin piped, stdout carries the replies
    alone and everything else (command output, notices, stats) goes to stderr.
    """

    STYLES = {"user": "1;32", "assistant": "1;36", "info": "2", "stats": "2", "notice": "33",
              "error": "31"}

    def __init__(self, interactive: bool, color: bool):
        self.interactive = interactive
        self.color = color
        self._at_line_start = True

    def paint(self, text: str, style: str) -> str:
        return f"\033[{self.STYLES[style]}m{text}\033[0m" if self.color else text

    def _line(self, text: str, style: str, stream=None) -> None:
        stream = stream or (sys.stdout if self.interactive else sys.stderr)
        print(self.paint(text, style) if stream.isatty() else text, file=stream, flush=True)

    def info(self, text: str) -> None:
        self._line(text, "info")

    def notice(self, text: str) -> None:
        self._line(text, "notice")

    def error(self, text: str) -> None:
        self._line(f"error: {text}", "error", sys.stderr)

    def stats(self, text: str) -> None:
        self._line(text, "stats")

    def reply_piece(self, text: str) -> None:
        if text:
            self._at_line_start = text.endswith("\n")
        sys.stdout.write(text)
        sys.stdout.flush()

    def end_reply(self, cut: bool) -> None:
        """Close a reply: a [cut] mark if it was stopped, and a newline unless there is one."""
        mark = self.paint("[cut]", "notice") if cut else ""
        if self._at_line_start:
            sys.stdout.write(mark + "\n" if mark else "")
        else:
            sys.stdout.write((" " + mark if mark else "") + "\n")
        self._at_line_start = True
        sys.stdout.flush()

    def transcript(self, role: str, text: str, cut: bool = False) -> None:
        """A past message (shown after /load)."""
        label = self.paint(PROMPT, "user") if role == "user" else ""
        stream = sys.stdout if self.interactive else sys.stderr
        print(f"{label}{text}" + (" [cut]" if cut else ""), file=stream, flush=True)


def wants_color(no_color_flag: bool) -> bool:
    """Colour only on a real terminal, and never when NO_COLOR is set (no-color.org)."""
    return (not no_color_flag and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
            and os.environ.get("TERM") != "dumb")


# -- input ----------------------------------------------------------------------------------
def history_path() -> Path:
    """$EDGELLM_HOME/chat_history, else $XDG_DATA_HOME/edgellm/, else ~/.local/share/edgellm/."""
    if home := os.environ.get("EDGELLM_HOME"):
        base = Path(home)
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "edgellm"
    return base / "chat_history"


def collect_message(first: str, read_more: Callable[[], str | None]) -> str:
    """Join a multi-line message: a \"\"\" ... \"\"\" block, or lines ending in a backslash.

    ``read_more`` returns the next line, or None at end of input (which ends the message).
    """
    if first.lstrip().startswith(FENCE):
        body = first.lstrip()[len(FENCE):]
        lines: list[str] = []
        while FENCE not in body:
            lines.append(body)
            body = read_more()
            if body is None:
                return "\n".join(lines).strip("\n")
        lines.append(body[: body.index(FENCE)])
        return "\n".join(lines).strip("\n")
    lines = []
    line: str | None = first
    while line is not None and line.endswith("\\"):
        lines.append(line[:-1])
        line = read_more()
    if line is not None:
        lines.append(line)
    return "\n".join(lines)


class PipedInput:
    """Turns from a non-terminal stdin, one per line (multi-line forms still apply)."""

    def read(self, prompt: str) -> str | None:
        line = sys.stdin.readline()
        return None if line == "" else line.rstrip("\r\n")


class TerminalInput:
    """prompt_toolkit line editing: arrows, persistent history, bracketed paste.

    Ctrl-C with text on the line clears it; at an empty prompt it raises KeyboardInterrupt.
    """

    def __init__(self, color: bool):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory
        from prompt_toolkit.key_binding import KeyBindings

        path = history_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        keys = KeyBindings()

        @keys.add("c-c")
        def _interrupt(event) -> None:
            buffer = event.app.current_buffer
            if buffer.text:
                buffer.reset()
            else:
                event.app.exit(exception=KeyboardInterrupt)

        self.color = color
        self.session = PromptSession(history=FileHistory(str(path)), key_bindings=keys,
                                     enable_history_search=False)

    def read(self, prompt: str) -> str | None:
        styled = [("ansigreen bold", prompt)] if self.color else prompt
        try:
            return self.session.prompt(styled)
        except EOFError:
            return None


# -- replies --------------------------------------------------------------------------------
class StopRequest:
    """Set by the first Ctrl-C during a reply; a second one interrupts for real."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


@contextmanager
def ctrl_c_stops_reply() -> Iterator[StopRequest]:
    """While a reply streams, Ctrl-C asks it to stop at the next token (not mid-layer)."""
    stop = StopRequest()
    previous = signal.signal(signal.SIGINT, stop)
    try:
        with terminal_echo_off():
            yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def terminal_echo_off() -> Iterator[None]:
    """Keep keys typed during a reply (and the ^C echo) out of it; they reach the next prompt."""
    if not sys.stdin.isatty():
        yield
        return
    import termios

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    quiet = list(saved)
    quiet[3] &= ~(termios.ECHO | termios.ECHOCTL)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def stream_reply(state: ReplState, console: Console, events: Iterator[ChatEvent]) -> None:
    """Render a reply as it streams; Ctrl-C cuts it and the session keeps it, marked."""
    started = False
    with ctrl_c_stops_reply() as stop:
        try:
            for event in events:
                if isinstance(event, Notice):
                    console.notice(event.message)
                    continue
                started = True
                console.reply_piece(event.text)
                if stop.requested:
                    break
        except KeyboardInterrupt:  # a second Ctrl-C inside a forward pass
            pass
        finally:
            events.close()
    stats = state.session.last_stats
    cut = stats is not None and stats.finish_reason == "cut"
    if started or cut:
        console.end_reply(cut)
    if stats and state.verbose:
        console.stats(format_stats(stats))


# -- the loop -------------------------------------------------------------------------------
def handle_line(state: ReplState, console: Console, text: str) -> None:
    """One input: a slash command, or a message to send."""
    if is_command(text):
        events = run_command(state, text.strip())
    else:
        events = state.session.send(text[1:] if text.startswith("//") else text)
    if events is not None:
        stream_reply(state, console, events)


def repl(state: ReplState, console: Console, reader: PipedInput | TerminalInput) -> int:
    """Read, answer, repeat, until /exit, end of input, or Ctrl-C twice at the prompt."""
    interrupted = False
    while True:
        try:
            first = reader.read(PROMPT)
        except KeyboardInterrupt:
            if interrupted:
                return 0
            interrupted = True
            console.info("(Ctrl-C again, Ctrl-D or /exit to quit)")
            continue
        interrupted = False
        if first is None:
            return 0
        text = collect_message(first, lambda: reader.read(CONTINUATION))
        if not text.strip():
            continue
        try:
            handle_line(state, console, text)
        except ExitChat:
            return 0
        except (ValueError, OSError) as exc:  # bad /load file, full context, unreadable /read
            console.error(str(exc))


def draft_options(args: argparse.Namespace, model) -> dict:
    """stream_generate's ``draft``/``draft_n`` options from --draft and --draft-n."""
    draft = load_draft_from_args(args, model)
    return {"draft": draft, "draft_n": args.draft_n} if draft is not None else {}


def main(argv: list[str], command: str = "chat") -> int:
    args = build_parser().parse_args(argv)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    console = Console(interactive, wants_color(args.no_color))
    model = load_from_args(args)
    session = ChatSession(model, sampling_from_args(args), system=args.system,
                          policy=args.policy, generate_options=draft_options(args, model))
    verbose = interactive if args.verbose is None else args.verbose
    state = ReplState(session, console, verbose)
    if interactive:
        console.info(f"edgellm chat · {model.name} · {model.backend.name} · "
                     f"{session.kv_budget} tokens · {session.policy}\n"
                     f'/help for commands, """ for multi-line input, Ctrl-D or /exit to quit')
        return repl(state, console, TerminalInput(console.color))
    return repl(state, console, PipedInput())
