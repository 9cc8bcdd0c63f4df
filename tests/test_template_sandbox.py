"""Hostile chat templates: each is refused (sandbox escapes) or stopped within its budget
(huge loops, recursion, exponential growth), quickly, with the reason in the message; and
the chat goes on after a template fails."""

from __future__ import annotations

import time

import pytest

from edgellm.chat import FALLBACK_TEMPLATE, TemplateError, render_chat

MESSAGES = [{"role": "user", "content": "hi"}]

# template -> a regex the error message must match (the reason)
HOSTILE = {
    # attribute tricks: the sandbox refuses them
    "class": ("{{ ''.__class__ }}", "unsafe|__class__"),
    "mro": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe|__class__"),
    "subclasses_via_attr_filter": ("{{ (''|attr('__class__')) }}", "unsafe|__class__"),
    "globals_of_a_global": ("{{ raise_exception.__globals__ }}", "unsafe|__globals__"),
    "init_globals": ("{{ cycler.__init__.__globals__.os }}", "unsafe|__init__"),
    "builtins_via_namespace": ("{{ namespace.__init__.__globals__['__builtins__'] }}",
                               "unsafe|__init__"),
    "format_field_attack": ("{{ '{0.__class__}'.format(messages) }}", "unsafe|__class__"),
    "format_map_attack": ("{{ '{m.__class__.__mro__}'.format_map({'m': messages}) }}",
                          "unsafe|__class__"),
    "percent_format_width": ("{{ '%999999999d' % 1 }}", "width of a million"),
    "format_filter_width": ("{{ '%099999999999s'|format('x') }}", "width of a million"),
    "str_format_width": ("{{ '{:>99999999999}'.format('x') }}", "width of a million"),
    "mutate_messages": ("{{ messages.append({'role': 'user', 'content': 'x'}) }}",
                        "unsafe|not safely callable|append"),
    "dict_update": ("{% set d = {} %}{{ d.update({'a': 1}) }}", "unsafe|not safely callable"),
    "include": ("{% include '/etc/passwd' %}", "include or import '/etc/passwd'"),
    "import": ("{% import 'os' as os %}", "include or import 'os'"),
    # work and size bounds
    "nested_huge_loops": ("{% for i in range(99999) %}{% for j in range(99999) %}"
                          "{% endfor %}{% endfor %}", "steps|longer than"),
    "loop_over_big_list": ("{% set x = range(99999)|list %}{% for a in x %}{% for b in x %}"
                           "{{ '' }}{% endfor %}{% endfor %}", "steps|longer than"),
    "macro_recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
                        "recursed too deeply|steps"),
    "exponential_macro": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}"
                          "{% endif %}x{% endmacro %}{{ f(60) }}", "steps|longer than|output"),
    "exponential_concat": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                           "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                           "built a str|limit"),
    "exponential_plus": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                         "{% set ns.s = ns.s + ns.s %}{% endfor %}", "more than"),
    "string_times_huge": ("{{ 'a' * 1000000000000 }}", "multiplies a sequence"),
    "list_times_huge": ("{{ ([1] * 100000000)|length }}", "multiplies a sequence"),
    "huge_power": ("{{ 2 ** 99999999 }}", "power"),
    "ljust_huge": ("{{ 'a'.ljust(10000000000) }}", "passed 10,000,000,000"),
    "center_filter_huge": ("{{ 'a'|center(10000000000) }}", "passed 10,000,000,000"),
    "indent_filter_huge": ("{{ 'a\nb'|indent(10000000000) }}", "passed 10,000,000,000"),
    "lipsum_huge": ("{{ lipsum(n=100000000) }}", "passed 100,000,000"),
    "huge_output": ("{% for i in range(99999) %}{{ 'x' * 99 }}{% endfor %}"
                    "{% for i in range(99999) %}{{ 'y' * 99 }}{% endfor %}",
                    "output passed"),
    "replace_growth": ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                       "{% set ns.s = ns.s|replace('a', 'aa') ~ ns.s %}{% endfor %}",
                       "built a str|limit|more than"),
    # plain Python errors a template can provoke: one TemplateError, not a crash
    "zero_division": ("{{ 1 / 0 }}", "ZeroDivisionError|division"),
    "bad_index": ("{{ messages[10]['content'].upper() }}", "no element 10"),
    "raise_exception": ("{{ raise_exception('this template refuses') }}",
                        "^this template refuses$"),
    "syntax_error": ("{% for %}", "does not parse"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_template_is_refused_or_bounded(case):
    template, reason = HOSTILE[case]
    start = time.monotonic()
    with pytest.raises(TemplateError, match=reason) as info:
        render_chat(template, MESSAGES)
    elapsed = time.monotonic() - start
    assert elapsed < 5.0, f"{case} took {elapsed:.1f} s"
    assert "\n" not in str(info.value).strip() or case == "indent_filter_huge", str(info.value)


def test_hostile_list_is_large_enough():
    assert len(HOSTILE) >= 20


def test_real_templates_still_render(model_path):
    """The bounds do not get in the way of the real models' templates."""
    from edgellm.converters.gguf_reader import read_gguf

    for name in ("qwen2.5-coder-0.5b-instruct", "gemma-3-270m"):
        template = read_gguf(model_path(name)).metadata.get("tokenizer.chat_template")
        long_chat = [{"role": "user" if i % 2 == 0 else "assistant",
                      "content": f"turn {i} " + "word " * 400} for i in range(200)]
        text = render_chat(template, long_chat)
        assert "turn 199" in text and len(text) > 400_000


def test_fallback_template_renders_a_big_conversation_quickly():
    chat = [{"role": "user", "content": "x" * 100_000}] * 20
    start = time.monotonic()
    assert len(render_chat(FALLBACK_TEMPLATE, chat)) > 2_000_000
    assert time.monotonic() - start < 2.0


def test_a_failing_template_does_not_end_the_chat(tmp_path):
    """The turn is refused with the template's reason; the session stays usable."""
    from dataclasses import replace

    from edgellm.api import load
    from edgellm.chat import ChatSession
    from edgellm.sampling import SamplingParams
    from tests.tiny_models import write_tiny_llama

    model = load(write_tiny_llama(tmp_path / "tiny.gguf"), backend="numpy")
    model.metadata["tokenizer.chat_template"] = (
        "{% if messages|length > 1 %}{% for i in range(99999) %}{% for j in range(99999) %}"
        "{% endfor %}{% endfor %}{% endif %}{{ messages[-1]['content'] }}")
    session = ChatSession(replace(model), SamplingParams(temperature=0, max_tokens=3))
    list(session.send("hello"))  # one message: renders
    assert len(session.messages) == 2
    with pytest.raises(TemplateError, match="steps|longer than"):
        list(session.send("again"))
    assert len(session.messages) == 2  # the refused turn was not kept
    session.clear()
    assert list(session.send("fresh start"))
