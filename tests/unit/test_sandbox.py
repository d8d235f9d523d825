"""The chat templates' sandbox renders what Jinja's immutable sandbox renders and refuses what
it refuses (router/render/sandbox.py)."""

from __future__ import annotations

import json
from typing import Any

import jinja2
import jinja2.ext
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from carryover.router.render.chat_template import bundled_qwen3_dir
from carryover.router.render.sandbox import ChatTemplateSandbox

QWEN3 = json.loads((bundled_qwen3_dir() / "tokenizer_config.json").read_text())["chat_template"]


def environment(kind: type[jinja2.Environment]) -> jinja2.Environment:
    env = kind(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda value, **_: json.dumps(value, ensure_ascii=False)
    return env


def outcome(kind: type[jinja2.Environment], source: str, **context: Any) -> str:
    """What rendering gives: the text, or the name of the error it raised."""
    try:
        return environment(kind).from_string(source).render(**context)
    except (SecurityError, jinja2.TemplateError, TypeError, AttributeError) as exc:
        return f"<{type(exc).__name__}>"


contents = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["<think>\nhm\n</think>\n\nyes", "<tool_response>x</tool_response>", ""]),
)
tool_call = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g"]), "arguments": st.sampled_from(["{}", {"a": 1}])}
        ),
    }
)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": contents}),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": contents},
        optional={
            "tool_calls": st.lists(tool_call, max_size=2),
            "reasoning_content": contents,
        },
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "content": contents}),
)
tools = st.none() | st.lists(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.just({"name": "f"})}),
    min_size=1,
    max_size=2,
)


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(message, min_size=1, max_size=8),
    tools=tools,
    generation=st.booleans(),
    thinking=st.none() | st.booleans(),
)
def test_qwen3_renders_as_in_jinjas_sandbox(
    messages: list[dict[str, Any]], tools: Any, generation: bool, thinking: bool | None
) -> None:
    context: dict[str, Any] = {
        "messages": messages,
        "tools": tools,
        "add_generation_prompt": generation,
    }
    if thinking is not None:
        context["enable_thinking"] = thinking
    assert outcome(ChatTemplateSandbox, QWEN3, **context) == outcome(
        ImmutableSandboxedEnvironment, QWEN3, **context
    )


ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ m.__class__ }}",
    "{{ m.items.__self__ }}",
    "{{ m.pop('role') }}",
    "{{ m.clear() }}",
    "{{ m.update({'role': 'system'}) }}",
    "{{ messages.append(m) }}",
    "{{ messages.pop() }}",
    "{{ '{0.__class__}'.format(m) }}",
    "{{ '{role.__class__}'.format_map(m) }}",
    "{% set ns = namespace(a=1) %}{{ ns.__init__ }}",
    "{% for x in messages %}{{ loop.__class__ }}{% endfor %}",
    "{{ (1).__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
]

READS = [
    "{{ m.role }}|{{ m['role'] }}|{{ m.missing is defined }}|{{ m._private }}",
    "{{ m.items() | list }}|{{ m.keys() | list }}|{{ m.get('role') }}",
    "{{ m.content.startswith('hi') }}|{{ m.content.split(' ') }}|{{ m.content.upper() }}",
    "{% set ns = namespace(a=1) %}{% set ns.a = ns.a + 1 %}{{ ns.a }}",
    "{% for x in messages %}{{ loop.index }}{{ loop.last }}{% endfor %}",
    "{{ messages | length }}|{{ messages[0].content | trim }}",
]


@pytest.mark.parametrize("source", ESCAPES + READS)
def test_the_sandbox_refuses_and_allows_what_jinjas_does(source: str) -> None:
    m = {"role": "user", "content": "hi there", "_private": "kept"}
    context = {"m": m, "messages": [m]}
    ours = outcome(ChatTemplateSandbox, source, **context)
    assert ours == outcome(ImmutableSandboxedEnvironment, source, **context)
    assert m == {"role": "user", "content": "hi there", "_private": "kept"}
    if source in ESCAPES:  # refused, or an undefined value that prints as nothing
        assert ours in ("<SecurityError>", ""), source
    else:
        assert not ours.startswith("<"), ours


def test_a_verdict_is_kept_per_type_and_name() -> None:
    env = ChatTemplateSandbox()
    assert env.is_safe_attribute("text", "upper", "text".upper)
    assert not env.is_safe_attribute([], "append", [].append)
    assert not env.is_safe_attribute({}, "__class__", dict)
    # A second list gets the first one's verdict; an object of another type is checked anew.
    assert not env.is_safe_attribute([1], "append", [1].append)
    assert env._verdicts == {
        (str, "upper"): True,
        (list, "append"): False,
        (dict, "__class__"): False,
    }
