"""Messages and tools prepared as vLLM prepares them before templating (vLLM 0.33.0
``renderers/chat_utils/chat_message.py``: ``parse_chat_message_content``,
``_postprocess_messages``; ``ChatCompletionToolsParam.model_dump``), and what the Qwen3
template then renders from them."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from carryover.router.render.chat_template import ChatTemplate
from carryover.router.render.messages import (
    RenderDeclined,
    RenderInputError,
    vllm_messages,
    vllm_tools,
)

QWEN3 = ChatTemplate.qwen3()


def call(arguments: Any, **extra: Any) -> dict[str, Any]:
    return {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": arguments},
        **extra,
    }


def assistant(*calls: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": list(calls), **extra}


def test_tool_call_arguments_reach_the_template_parsed_and_spaced_as_vllm_writes_them() -> None:
    (message,) = vllm_messages([assistant(call('{"id":7,"tag":"ä"}'))])
    assert message["tool_calls"][0]["function"]["arguments"] == {"id": 7, "tag": "ä"}
    text = QWEN3.render_text([{"role": "user", "content": "q"}, assistant(call('{"id":7}'))])
    assert '{"id": 7}' in text and '{"id":7}' not in text


@pytest.mark.parametrize("arguments", ["", "{not json", "[1, 2]", "42", "true", "null"], ids=repr)
def test_arguments_that_are_empty_not_json_or_not_an_object_become_an_empty_object(
    arguments: str,
) -> None:
    (message,) = vllm_messages([assistant(call(arguments))])
    assert message["tool_calls"][0]["function"]["arguments"] == {}


def test_a_tool_call_keeps_vllms_key_order_and_the_functions_other_keys() -> None:
    function = {"x": 1, "name": "f", "arguments": '{"b":1,"a":2}'}
    sent = {"function": function, "type": "function", "id": "c"}
    (message,) = vllm_messages([assistant(sent)])
    (kept,) = message["tool_calls"]
    assert list(kept) == ["id", "function", "type"]
    assert list(kept["function"]) == ["arguments", "name", "x"]
    assert list(kept["function"]["arguments"]) == ["b", "a"]


@pytest.mark.parametrize(
    "sent",
    [
        call({"id": 7}),
        call(None),
        {**call("{}"), "extra": 1},
        {"id": "c", "function": {"name": "f", "arguments": "{}"}},
    ],
    ids=["object-arguments", "null-arguments", "extra-key", "no-type"],
)
def test_a_tool_call_the_request_model_would_refuse_or_reshape_is_left_to_the_engine(
    sent: dict[str, Any],
) -> None:
    with pytest.raises(RenderDeclined):
        vllm_messages([assistant(sent)])


def test_an_empty_tool_call_list_is_dropped_and_bad_entries_are_refused() -> None:
    (message,) = vllm_messages([assistant()])
    assert "tool_calls" not in message
    with pytest.raises(RenderInputError, match="objects"):
        vllm_messages([assistant("not a call")])  # type: ignore[arg-type]
    with pytest.raises(RenderInputError, match="function"):
        vllm_messages([assistant({**call("{}"), "type": "custom"})])


def test_reasoning_reaches_the_template_under_both_names() -> None:
    (kept,) = vllm_messages([{"role": "assistant", "content": "a", "reasoning": "r"}])
    assert kept["reasoning"] == kept["reasoning_content"] == "r"
    # The chat request renames the deprecated field; reasoning wins when both are set.
    (renamed,) = vllm_messages([{"role": "assistant", "content": "a", "reasoning_content": "r"}])
    assert renamed["reasoning"] == renamed["reasoning_content"] == "r"
    (both,) = vllm_messages(
        [{"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "old"}]
    )
    assert both["reasoning_content"] == "r"


def test_only_the_keys_vllm_builds_reach_the_template() -> None:
    messages = [
        {"role": "user", "content": "u", "name": "ann", "audio": None, "refusal": "x"},
        {"role": "tool", "content": "t", "tool_call_id": "c1"},
        {"role": "developer", "content": "d", "tools": [{"x": 1}], "task": "t"},
        {"role": "user", "content": "u", "tool_call_id": "only for tools"},
    ]
    assert vllm_messages(messages) == [
        {"role": "user", "content": "u", "name": "ann"},
        {"role": "tool", "content": "t", "tool_call_id": "c1"},
        {"role": "developer", "content": "d", "task": "t", "tools": [{"x": 1}]},
        {"role": "user", "content": "u"},
    ]


def test_text_parts_are_joined_and_empty_ones_skipped() -> None:
    parts = [
        {"type": "text", "text": "a"},
        {"type": "refusal", "refusal": "b"},
        {"type": "thinking", "thinking": "c"},
        {"type": "text", "text": ""},
    ]
    (message,) = vllm_messages([{"role": "user", "content": parts}])
    assert message["content"] == "a\nb\nc"
    (empty,) = vllm_messages([{"role": "assistant", "content": None}])
    assert empty["content"] == ""


def test_a_custom_role_takes_every_text_part_type_as_vllms_request_model_does() -> None:
    parts = [
        {"type": "input_text", "text": "a"},
        {"type": "output_text", "text": "b"},
        "c",
        {"type": "text", "text": None},
    ]
    (message,) = vllm_messages([{"role": "narrator", "content": parts}])
    assert message["content"] == "a\nb\nc"


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "input_text", "text": "a"}],
        [{"type": "output_text", "text": "a"}],
        ["a bare string"],
        [{"type": "text", "text": None}],
        None,
    ],
    ids=["input_text", "output_text", "bare", "null-text", "null-content"],
)
def test_what_the_request_model_refuses_for_openais_roles_is_left_to_the_engine(
    content: Any,
) -> None:
    with pytest.raises(RenderDeclined):
        vllm_messages([{"role": "user", "content": content}])


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        {"type": "tool_reference", "name": "lookup"},
        {"type": "text", "text": "a", "uuid": "u1"},
        {"text": "no type"},
    ],
    ids=["image", "tool_reference", "uuid", "untyped"],
)
def test_parts_that_are_not_plain_text_are_left_to_the_engine(part: dict[str, Any]) -> None:
    with pytest.raises(RenderDeclined):
        vllm_messages([{"role": "user", "content": [part]}])


def test_a_system_texts_billing_header_line_is_dropped_as_vllm_drops_it() -> None:
    header = "x-anthropic-billing-header: cch=123"
    messages = [
        {"role": "system", "content": f"{header}\nBe brief."},
        {
            "role": "system",
            "content": [{"type": "text", "text": header}, {"type": "text", "text": "kept"}],
        },
        {"role": "user", "content": f"{header}\nnot a system message"},
    ]
    assert [m["content"] for m in vllm_messages(messages)] == [
        "Be brief.",
        "kept",
        f"{header}\nnot a system message",
    ]


@given(
    st.lists(
        st.fixed_dictionaries(
            {"id": st.integers(), "tag": st.text(max_size=5)},
            optional={"n": st.none() | st.booleans() | st.floats(allow_nan=False)},
        ),
        min_size=1,
        max_size=3,
    ),
    st.booleans(),
)
def test_the_clients_messages_are_never_changed(
    arguments: list[dict[str, Any]], spaced: bool
) -> None:
    dumps = json.dumps if spaced else (lambda v: json.dumps(v, separators=(",", ":")))
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        assistant(*(call(dumps(a)) for a in arguments), reasoning="r"),
    ]
    before = copy.deepcopy(messages)
    prepared = vllm_messages(messages)
    assert messages == before
    # Compact or spaced, the template gets the same objects.
    assert [c["function"]["arguments"] for c in prepared[1]["tool_calls"]] == arguments


def test_tools_are_dumped_with_vllms_fields_in_its_order() -> None:
    tools = [
        {
            "function": {"parameters": {"type": "object"}, "name": "f", "extra": 1},
            "type": "function",
        },
        {"type": "function", "function": {"name": "g", "strict": True}, "defer_loading": False},
    ]
    assert vllm_tools(tools) == [
        {
            "type": "function",
            "function": {"name": "f", "description": None, "parameters": {"type": "object"}},
        },
        {
            "type": "function",
            "function": {
                "name": "g",
                "description": None,
                "parameters": None,
                "strict": True,
                "defer_loading": False,
            },
            "defer_loading": False,
        },
    ]
    first, second = vllm_tools(tools) or []
    assert list(first) == ["type", "function"] and list(second) == [
        "type",
        "function",
        "defer_loading",
    ]
    assert list(first["function"]) == ["name", "description", "parameters"]
    assert vllm_tools(None) is None
    with pytest.raises(RenderInputError, match="empty"):
        vllm_tools([])  # as vLLM's chat request refuses it


@pytest.mark.parametrize(
    "tool",
    [
        {"type": "function", "function": {"name": "f", "strict": "true"}},
        {"type": "function", "function": {"name": "f", "description": 3}},
        {"type": "function", "function": {"name": "f", "parameters": []}},
        {"type": "custom", "function": {"name": "f"}},
        {"type": "function", "function": {"description": "no name"}},
        "lookup",
    ],
    ids=["strict", "description", "parameters", "type", "name", "not-an-object"],
)
def test_tools_pydantic_would_coerce_or_refuse_are_left_to_the_engine(tool: Any) -> None:
    with pytest.raises(RenderDeclined):
        vllm_tools([tool])


@pytest.mark.parametrize("key", ["name", "task", "tool_call_id"])
def test_fields_of_another_type_than_the_request_models_are_left_to_the_engine(key: str) -> None:
    with pytest.raises(RenderDeclined):
        vllm_messages([{"role": "tool", "content": "t", key: 3}])


def test_arguments_nested_past_the_parsers_depth_are_a_clear_refusal() -> None:
    """A RecursionError would be a 500 with a traceback; vLLM answers such a request 400."""
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call("[" * 5000 + "]" * 5000)]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
    ]
    with pytest.raises(RenderInputError, match="nested too deeply"):
        vllm_messages(messages)
