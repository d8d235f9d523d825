"""Content format detection as vLLM's (router/render/content_format.py): a loop over a
message's content makes a template take parts; the differential test compares the ids of
such a template with vLLM's own (tests/real/test_render_vllm.py)."""

from __future__ import annotations

import jinja2
import pytest

from carryover.router.render.chat_template import ChatTemplate
from carryover.router.render.content_format import ContentFormat, content_format


def detect(source: str) -> ContentFormat:
    return content_format(jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source))


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% for p in m['content'] | list %}{% endfor %}{% endfor %}",
            "openai",
        ),
        # Through an alias of the messages.
        (
            "{% set msgs = messages[1:] %}{% for m in msgs %}{% for p in m.content %}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        # A variable named content, outside macros.
        (
            "{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        # A macro parameter filled with a message's content.
        (
            "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ show(m.content) }}{% endfor %}",
            "openai",
        ),
        # A loop over content with two targets: vLLM's detection gives up, to its default.
        ("{% for m in messages %}{% for k, v in m.content %}{% endfor %}{% endfor %}", "string"),
        # Over the messages with two targets: the same.
        ("{% for i, m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}", "string"),
    ],
)
def test_the_format_is_vllm_s(source: str, expected: str) -> None:
    assert detect(source) == expected


def test_qwen3_takes_strings() -> None:
    template = ChatTemplate.qwen3()
    assert not any(t.openai_content for t in template._templates.values())
