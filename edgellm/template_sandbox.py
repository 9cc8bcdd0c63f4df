"""A Jinja sandbox for chat templates bounded in time, work and size.

A GGUF's chat template is code written by whoever made the file. Jinja's immutable sandbox
already refuses attribute tricks (``__class__``, ``__globals__``, ``mro``, ``|attr``,
format-string field access) and mutation of the messages; it does not bound the work a
template does or the size of what it builds. ``BoundedSandbox`` adds, per render:

- a step budget and a deadline: every loop iteration, call, filter and operator is a step;
  past ``max_steps`` or ``max_seconds`` the render stops (huge or nested loops, exponential
  macro recursion);
- a size limit on every string or list a call, filter, ``~`` or operator produces, checked
  before the big operands are built where Python would allocate first (``'a' * 10**12``,
  ``x.ljust(10**10)``, ``'%99999999d'``, ``10 ** 10 ** 10``);
- no loader (``include``/``import``/``extends`` name nothing), and any Python error a
  template provokes (a recursion too deep, a division by zero) becomes one ``TemplateError``.

Loops are bounded by rewriting each ``{% for %}``'s iterable into ``__edgellm_loop(...)`` when
the template is parsed, since Jinja compiles loops to plain Python ``for`` statements that no
sandbox hook sees.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_STEPS = 2_000_000
MAX_SECONDS = 2.0
MAX_CHARS = 4_000_000  # largest string/list a template may build (and its output)
MAX_INT_ARG = 1_000_000  # widths, counts, repeats passed to calls and filters
_LOOP = "__edgellm_loop"
_WIDE_FORMAT = re.compile(r"\d{7,}")  # a format width/precision of a million or more


class TemplateLimit(jinja2.TemplateError):
    """A chat template exceeded its time, work or size budget (or its sandbox)."""


@dataclass
class RenderBudget:
    """What one render may spend; counters start at zero."""

    max_steps: int = MAX_STEPS
    max_seconds: float = MAX_SECONDS
    max_chars: int = MAX_CHARS
    steps: int = 0
    deadline: float = field(default=0.0)

    def start(self) -> RenderBudget:
        self.deadline = time.monotonic() + self.max_seconds
        return self

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > self.max_steps:
            raise TemplateLimit(f"the chat template ran more than {self.max_steps:,} steps "
                                "(a huge or endless loop, or runaway recursion)")
        if self.steps % 1024 == 0 and time.monotonic() > self.deadline:
            raise TemplateLimit(f"the chat template ran longer than {self.max_seconds:g} s")

    def size(self, value: Any, what: str) -> Any:
        if isinstance(value, str | bytes | list | tuple | dict) and len(value) > self.max_chars:
            raise TemplateLimit(f"the chat template built a {type(value).__name__} of "
                                f"{len(value):,} items in {what} (limit {self.max_chars:,})")
        return value


_budget: ContextVar[RenderBudget | None] = ContextVar("edgellm_template_budget", default=None)


def _current() -> RenderBudget:
    return _budget.get() or RenderBudget().start()


def _check_int_args(args: Iterable[Any], what: str) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG:
            raise TemplateLimit(f"the chat template passed {a:,} to {what} "
                                f"(limit {MAX_INT_ARG:,})")


def _check_format(text: Any, what: str) -> None:
    """Refuse format strings asking for a width or precision of a million or more."""
    if isinstance(text, str) and ("%" in text or "{" in text) and _WIDE_FORMAT.search(text):
        raise TemplateLimit(f"the chat template's format string in {what} asks for a "
                            "width of a million or more characters")


def _loop(iterable: Any) -> Iterator[Any]:
    """Every {% for %} iterates through this: one step per item."""
    budget = _current()
    budget.size(iterable, "a loop")
    for item in iterable:
        budget.step()
        yield item


def _guard_filter(name: str, fn: Any) -> Any:
    """A filter wrapped with the step budget and the size checks."""

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = _current()
        budget.step()
        values = [*args, *kwargs.values()]
        _check_int_args(values, f"the {name!r} filter")
        if name == "format" and args:
            _check_format(next((a for a in args if isinstance(a, str)), None), "|format")
        return budget.size(fn(*args, **kwargs), f"the {name!r} filter")

    return guarded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox plus per-render budgets (see the module docstring)."""

    intercepted_binops = frozenset({"+", "*", "**", "%", "//", "/"})
    intercepted_unops = frozenset()

    def __init__(self, **options: Any):
        options.setdefault("loader", jinja2.DictLoader({}))  # include/import find nothing
        super().__init__(**options)
        self.globals[_LOOP] = _loop
        self.filters = {name: _guard_filter(name, fn) for name, fn in self.filters.items()}

    # -- parsing: bound every loop ------------------------------------------------------------
    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.Name(_LOOP, "load"), [loop.iter], [], None, None,
                                   lineno=loop.lineno)
        for concat in list(tree.find_all(nodes.Concat)):
            concat.nodes = [nodes.Call(nodes.Name("__edgellm_sized", "load"), [n], [], None,
                                       None, lineno=concat.lineno) for n in concat.nodes]
        return tree

    # -- every call, operator and attribute --------------------------------------------------
    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        """Refuse at once: Jinja's default prints an unsafe attribute as "" and goes on."""
        raise SecurityError(f"the chat template reached for the unsafe attribute "
                            f"{attribute!r} of a {type(obj).__name__}: refused")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _current()
        budget.step()
        what = getattr(__obj, "__name__", "a call")
        _check_int_args([*args, *kwargs.values()], f"{what}()")
        if what in ("format", "format_map"):  # the sandbox's wrapper around str.format
            method = getattr(__obj, "__wrapped__", __obj)
            _check_format(getattr(method, "__self__", None), f"{what}()")
        return budget.size(super().call(__context, __obj, *args, **kwargs), f"{what}()")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _current()
        budget.step()
        sized = (str, bytes, list, tuple)
        if operator == "*":
            seq, count = (left, right) if isinstance(left, sized) else (right, left)
            if isinstance(seq, sized) and isinstance(count, int):
                if len(seq) * max(count, 0) > budget.max_chars:
                    raise TemplateLimit(f"the chat template multiplies a sequence of "
                                        f"{len(seq):,} by {count:,} (limit "
                                        f"{budget.max_chars:,} items)")
        elif operator == "+" and isinstance(left, sized) and isinstance(right, sized):
            if len(left) + len(right) > budget.max_chars:
                raise TemplateLimit(f"the chat template built a value of more than "
                                    f"{budget.max_chars:,} items with '+'")
        elif operator == "**" and isinstance(right, int | float) and abs(right) > 1024:
            raise TemplateLimit(f"the chat template raises to the power {right} (limit 1024)")
        elif operator == "%":
            _check_format(left, "'%'")
        return budget.size(super().call_binop(context, operator, left, right),
                           f"'{operator}'")


def _sized(value: Any) -> Any:
    """Each piece of a ``~`` concatenation, checked before the join."""
    budget = _current()
    budget.step()
    return budget.size(value, "'~'")


def make_environment() -> BoundedSandbox:
    """The chat-template environment: trims blocks like HF's, loop controls on."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols"])
    env.globals["__edgellm_sized"] = _sized
    return env


def render_bounded(template: jinja2.Template, budget: RenderBudget | None = None,
                   passthrough: tuple[type[BaseException], ...] = (), **variables: Any) -> str:
    """Render under ``budget``: a ``TemplateLimit`` past it, and every other failure the
    template provokes as a ``jinja2.TemplateError`` (never a bare Python exception), except
    the ``passthrough`` types (a global's own error, e.g. ``raise_exception``)."""
    budget = (budget or RenderBudget()).start()
    token = _budget.set(budget)
    try:
        pieces: list[str] = []
        total = 0
        for piece in template.generate(**variables):
            total += len(piece)
            if total > budget.max_chars:
                raise TemplateLimit(f"the chat template's output passed {budget.max_chars:,} "
                                    "characters")
            pieces.append(piece)
        return "".join(pieces)
    except jinja2.TemplateNotFound as exc:
        raise TemplateLimit(f"the chat template tried to include or import {exc.name!r}: "
                            "chat templates may not load other files") from None
    except (jinja2.TemplateError, *passthrough):
        raise
    except RecursionError:
        raise TemplateLimit("the chat template recursed too deeply") from None
    except MemoryError:
        raise TemplateLimit("the chat template ran out of memory") from None
    except Exception as exc:  # a template's own Python error: 1/0, a bad index, a bad call
        raise jinja2.TemplateRuntimeError(f"{type(exc).__name__}: {exc}") from None
    finally:
        _budget.reset(token)
