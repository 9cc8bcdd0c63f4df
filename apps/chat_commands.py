"""The slash commands of `edgellm chat`: parsing, and what each one does to the session.

A handler gets the REPL state and the text after the command name. It returns None when it
is done, or a stream of chat events (``/regen``, ``/read``) for the REPL to render; it raises
``ExitChat`` to leave. Handlers print through the REPL's ``Console``, never directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from edgellm.chat import ChatEvent, ChatSession

if TYPE_CHECKING:
    from edgellm.chat import TurnStats


class ExitChat(Exception):
    """The user asked to leave (/exit, /quit, /bye)."""


class Output(Protocol):
    def info(self, text: str) -> None: ...
    def notice(self, text: str) -> None: ...
    def transcript(self, role: str, text: str, cut: bool = False) -> None: ...


@dataclass
class ReplState:
    """What commands may read and change: the session, output, and display settings."""

    session: ChatSession
    out: Output
    verbose: bool = True  # a stats line after each reply


Handler = Callable[[ReplState, str], Iterator[ChatEvent] | None]

# /set NAME -> (SamplingParams field, parser); "none" clears the seed
SETTABLE: dict[str, tuple[str, Callable[[str], object]]] = {
    "temp": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "max_tokens": ("max_tokens", int),
    "seed": ("seed", lambda v: None if v.lower() in ("none", "off", "random") else int(v)),
    "repeat_penalty": ("repetition_penalty", float),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
}
PARAM_LABELS = {field: name for name, (field, _) in SETTABLE.items()}


def cmd_help(state: ReplState, arg: str) -> None:
    lines = ["commands:"]
    lines += [f"  /{name:<16} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ['multi-line input: start with """ and end with """, or end a line with \\',
              "Ctrl-C stops a reply; Ctrl-C twice at an empty prompt, Ctrl-D or /exit quits",
              "start a message with // to send text that begins with /"]
    state.out.info("\n".join(lines))


def cmd_exit(state: ReplState, arg: str) -> None:
    raise ExitChat


def cmd_clear(state: ReplState, arg: str) -> None:
    state.session.clear()
    state.out.info("conversation cleared (the system prompt stays)")


def cmd_system(state: ReplState, arg: str) -> None:
    state.session.set_system(arg.strip())
    if arg.strip():
        state.out.info("system prompt set")
    else:
        state.out.info("system prompt cleared (the template's default applies)")


def cmd_set(state: ReplState, arg: str) -> None:
    name, _, value = arg.strip().partition(" ")
    value = value.strip()
    if name == "verbose":
        state.verbose = value.lower() not in ("off", "0", "false", "no")
        state.out.info(f"stats after each reply: {'on' if state.verbose else 'off'}")
        return
    if name not in SETTABLE or not value:
        names = " | ".join([*SETTABLE, "verbose"])
        state.out.notice(f"usage: /set {names} VALUE")
        return
    field_name, parse = SETTABLE[name]
    try:
        state.session.set_params(**{field_name: parse(value)})
    except ValueError as exc:
        state.out.notice(f"/set {name}: {exc}")
        return
    state.out.info(f"{name} = {value}")


def describe_params(session: ChatSession) -> str:
    p = session.params
    parts = [f"{PARAM_LABELS[f]} {getattr(p, f)}" for f in PARAM_LABELS
             if f not in ("presence_penalty", "frequency_penalty") or getattr(p, f)]
    return "  ".join(part.replace(" None", " none") for part in parts)


def cmd_show(state: ReplState, arg: str) -> None:
    s = state.session
    kv_mib = s.cache.nbytes / 2**20
    dtype = s.cache.config.dtype
    lines = [
        f"model    {s.model.name}  ({s.model.path})",
        f"backend  {s.model.backend.name}",
        f"params   {describe_params(s)}",
        f"budget   {s.kv_used} / {s.kv_budget} tokens in the KV cache "
        f"({dtype}, {kv_mib:.1f} MiB)",
        f"policy   {s.policy}" + (f" (keep {s.cache.config.keep})" if s.policy == "rotate" else ""),
        f"system   {s.system or '(template default)'}",
        f"turns    {len(s.messages)} messages",
    ]
    if s.generate_options.get("draft") is not None:
        draft = s.generate_options["draft"]
        lines.insert(2, f"draft    {getattr(draft, 'name', draft)}")
    state.out.info("\n".join(lines))


def cmd_save(state: ReplState, arg: str) -> None:
    if not arg.strip():
        state.out.notice("usage: /save FILE")
        return
    path = state.session.save(arg.strip())
    state.out.info(f"saved {len(state.session.messages)} messages and parameters to {path}")


def cmd_load(state: ReplState, arg: str) -> None:
    if not arg.strip():
        state.out.notice("usage: /load FILE")
        return
    state.session.load(arg.strip())
    for m in state.session.messages:
        state.out.transcript(m["role"], m["content"], cut=bool(m.get("cut")))
    state.out.info(f"loaded {len(state.session.messages)} messages from {arg.strip()}"
                   f" ({describe_params(state.session)})")


def cmd_regen(state: ReplState, arg: str) -> Iterator[ChatEvent]:
    return state.session.regen()


def cmd_read(state: ReplState, arg: str) -> Iterator[ChatEvent] | None:
    name, _, question = arg.strip().partition(" ")
    if not name:
        state.out.notice("usage: /read FILE [question about it]")
        return None
    text = Path(name).expanduser().read_text(encoding="utf-8", errors="replace")
    message = f"{question.strip()}\n\n{text}" if question.strip() else text
    state.out.info(f"sending {name} ({len(text)} characters)")
    return state.session.send(message)


def format_stats(stats: TurnStats) -> str:
    """One calm line: ttft, prefill and decode speed, tokens, KV fill, draft acceptance."""
    parts = [
        f"ttft {stats.ttft_s:.2f}s",
        f"prompt {stats.prompt_tokens} tok @ {stats.prompt_tps:.1f} t/s"
        + (f" ({stats.reused_tokens} cached)" if stats.reused_tokens else ""),
        f"gen {stats.generation_tokens} tok @ {stats.generation_tps:.1f} t/s",
        f"kv {stats.kv_used}/{stats.kv_budget}",
    ]
    draft = stats.draft
    if draft.get("drafted"):
        rate = draft.get("acceptance_rate", draft.get("accepted", 0) / draft["drafted"])
        parts.append(f"draft {draft.get('accepted', 0)}/{draft['drafted']} ({rate:.0%})")
    if stats.finish_reason not in ("stop",):
        parts.append(stats.finish_reason)
    return " · ".join(parts)


def cmd_stats(state: ReplState, arg: str) -> None:
    stats = state.session.last_stats
    state.out.info(format_stats(stats) if stats else "no reply yet")


COMMANDS: dict[str, tuple[Handler, str]] = {
    "help": (cmd_help, "this list"),
    "exit": (cmd_exit, "leave (also /quit, /bye, Ctrl-D)"),
    "quit": (cmd_exit, "leave"),
    "bye": (cmd_exit, "leave"),
    "clear": (cmd_clear, "forget the conversation"),
    "system": (cmd_system, "TEXT: set the system prompt (empty: template default)"),
    "set": (cmd_set, "NAME VALUE: temp top_p top_k min_p max_tokens seed repeat_penalty "
                     "verbose"),
    "show": (cmd_show, "model, parameters, KV budget and policy"),
    "save": (cmd_save, "FILE: save the conversation and parameters as JSON"),
    "load": (cmd_load, "FILE: restore a saved conversation"),
    "regen": (cmd_regen, "replace the last reply with a new one"),
    "read": (cmd_read, "FILE [question]: send a file's text"),
    "stats": (cmd_stats, "timings of the last reply"),
}


def is_command(line: str) -> bool:
    """A slash command, as opposed to a message ("//text" sends "/text")."""
    return line.startswith("/") and not line.startswith("//")


def run_command(state: ReplState, line: str) -> Iterator[ChatEvent] | None:
    """Run one slash command; an unknown one gets a hint, not an error."""
    name, _, arg = line[1:].partition(" ")
    entry = COMMANDS.get(name.lower())
    if entry is None:
        close = [c for c in COMMANDS if c.startswith(name.lower()[:2])] if name else []
        hint = f" (did you mean /{close[0]}?)" if close else ""
        state.out.notice(f"unknown command /{name}{hint}: /help lists the commands")
        return None
    return entry[0](state, arg)
