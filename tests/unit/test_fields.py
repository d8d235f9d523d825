"""The request-field table covers every field of vLLM 0.33.0's chat and completion requests,
and each class does what docs/request-fields.md says."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest

from carryover.router.errors import BadRequest
from carryover.router.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    NON_TEXT_CONTENT,
    FieldClass,
    refused_field,
    reuse_blockers,
)
from carryover.router.openai import BodyLimits, parse_body
from carryover.router.render.backends import EngineTokenize, Renderer
from carryover.router.turn.api import engine_api
from carryover.router.turn.runtime import ModelRuntime

# The fields of ChatCompletionRequest and CompletionRequest in vLLM 0.33.0
# (vllm/entrypoints/openai/chat_completion/protocol.py, .../completion/protocol.py).
VLLM_CHAT = [
    "messages",
    "model",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "presence_penalty",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "thinking_token_budget",
    "include_reasoning",
    "parallel_tool_calls",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "prompt_logprobs",
    "logprob_token_ids",
    "allowed_token_ids",
    "bad_words",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "return_weight_versions",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "return_prompt_text",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "stream_interval",
]
VLLM_COMPLETION = [
    "model",
    "prompt",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "use_beam_search",
    "top_k",
    "min_p",
    "repetition_penalty",
    "watermarking",
    "length_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "allowed_token_ids",
    "prompt_logprobs",
    "logprob_token_ids",
    "bad_words",
    "prompt_embeds",
    "add_special_tokens",
    "response_format",
    "structured_outputs",
    "priority",
    "request_id",
    "session_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "return_weight_versions",
    "routed_experts_prompt_start",
    "return_token_offsets",
    "mm_payload",
    "return_mm_kwargs",
    "cache_salt",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "repetition_detection",
    "thinking_token_budget",
    "stream_interval",
]

TOKENIZE = EngineTokenize.renders  # what P's /tokenize applies
TEXT = [{"role": "user", "content": "hi"}]


def test_every_vllm_field_is_classified() -> None:
    assert set(CHAT_FIELDS) == set(VLLM_CHAT)
    assert set(COMPLETION_FIELDS) == set(VLLM_COMPLETION)


def test_passing_and_rendered_fields_keep_the_turn_checked() -> None:
    body = {
        "messages": TEXT,
        "temperature": 0.3,
        "cache_salt": "tenant-a",
        "tools": [],
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "echo": False,
    }
    assert reuse_blockers(body, chat=True, renders=TOKENIZE) == []


@pytest.mark.parametrize(
    ("extra", "blocker"),
    [
        ({"echo": True}, "echo"),
        ({"truncate_prompt_tokens": 100}, "truncate_prompt_tokens"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"mm_processor_kwargs": {"x": 1}}, "mm_processor_kwargs"),
        ({"documents": [{"title": "a", "text": "b"}]}, "documents"),  # /tokenize cannot
        ({"reasoning_effort": "low"}, "reasoning_effort"),
    ],
)
def test_fields_the_engine_must_apply_make_the_turn_unchecked(
    extra: dict[str, object], blocker: str
) -> None:
    assert reuse_blockers({"messages": TEXT, **extra}, chat=True, renders=TOKENIZE) == [blocker]


def test_a_rendered_field_is_checked_only_by_a_renderer_that_applies_it() -> None:
    body = {"messages": TEXT, "continue_final_message": True}
    assert reuse_blockers(body, chat=True, renders=TOKENIZE) == []
    assert reuse_blockers(body, chat=True, renders=frozenset({"messages"})) == [
        "continue_final_message"
    ]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "text", "text": "x", "image_url": {"url": "u"}},  # a media key, any type
    ],
)
def test_non_text_content_makes_the_turn_unchecked(part: dict[str, object]) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    assert reuse_blockers({"messages": messages}, chat=True, renders=TOKENIZE) == [NON_TEXT_CONTENT]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "look"}]}]
    assert reuse_blockers({"messages": text_only}, chat=True, renders=TOKENIZE) == []


def test_completion_fields() -> None:
    prompt = frozenset({"prompt"})
    assert reuse_blockers({"prompt": [1, 2], "echo": True}, chat=False, renders=prompt) == []
    assert reuse_blockers(
        {"prompt": "x", "add_special_tokens": False}, chat=False, renders=prompt
    ) == ["add_special_tokens"]
    assert reuse_blockers({"prompt": "x", "suffix": "y"}, chat=False, renders=prompt) == ["suffix"]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize(
    ("name", "value"), [("use_beam_search", True), ("ec_transfer_params", {"a": 1})]
)
def test_refused_fields_are_a_400_naming_the_field(chat: bool, name: str, value: object) -> None:
    body = {"messages": TEXT} if chat else {"prompt": "hi"}
    assert refused_field({**body, name: value}, chat=chat) == name
    assert refused_field({**body, "use_beam_search": False}, chat=chat) is None
    with pytest.raises(BadRequest) as raised:
        parse_body(
            json.dumps({**body, name: value}).encode(), chat=chat, limits=BodyLimits(8, 8, 8)
        )
    assert raised.value.param == name


def test_every_class_is_used() -> None:
    assert set(CHAT_FIELDS.values()) | set(COMPLETION_FIELDS.values()) == set(FieldClass)


def test_the_docs_table_is_the_code_table() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "request-fields.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [cell.strip(" `") for cell in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 3:  # the field table, not the classes
            rows[cells[0]] = (cells[1], cells[2])
    for name in set(CHAT_FIELDS) | set(COMPLETION_FIELDS):
        chat = CHAT_FIELDS[name].value if name in CHAT_FIELDS else "—"
        completion = COMPLETION_FIELDS[name].value if name in COMPLETION_FIELDS else "—"
        assert rows.pop(name) == (chat, completion), name
    assert rows == {}


@pytest.mark.parametrize("chat", [True, False])
def test_prefill_gets_only_known_fields_and_decode_what_the_client_sent(chat: bool) -> None:
    """P's body is built from an allow-list (a field vLLM adds later could make P render the
    prompt itself); D's keeps every field. One field of each class, and one unknown."""
    from carryover.router.config import InstanceConfig, ModelConfig
    from carryover.router.turn.model import Prepared, TurnRequest
    from carryover.router.turn.path import Entry
    from carryover.router.turn.placement import KvView
    from carryover.state import Path, Plan, Reason

    table = CHAT_FIELDS if chat else COMPLETION_FIELDS
    sample = {
        FieldClass.PASSES: "seed",
        FieldClass.RENDERED: "messages" if chat else "prompt",
        FieldClass.DISABLES_REUSE: "truncate_prompt_tokens",
    }
    body = {name: 1 for name in sample.values()}
    body["future_vllm_field"] = True
    body["min_tokens"] = 2  # known, but P's one token cannot honour it
    assert all(table[name] is kind for kind, name in sample.items())
    model = ModelConfig(decode=[InstanceConfig("http://d:1")], prefill=[])
    runtime = ModelRuntime(model, cast(Renderer, None), engine_api(model))
    req = TurnRequest(runtime, "m", None, body, chat, False, False, "r", 1)
    cold = Plan(Path.COLD, Reason.NO_RECORD)
    kv = KvView(None, None, None, None)
    prepared = Prepared([1, 2, 3], None, None, Entry(cold, True, True, True), kv)
    _, p = runtime.api.prefill(req, prepared, {"do_remote_decode": True})
    _, d = runtime.api.decode(req, prepared, None)
    for name in sample.values():
        assert name in p and name in d
    assert "future_vllm_field" not in p and d["future_vllm_field"] is True
    assert "min_tokens" not in p and d["min_tokens"] == 2
