"""Mending derendered answers: what the render server gives against what ``vllm serve`` does."""

from __future__ import annotations

from typing import Any

from carryover.router.tokens.answers import StreamMender, mend_whole, public_id

_TOOL_CALL = {"id": "a1", "type": "function", "function": {"name": "get", "arguments": "{}"}}


def _whole(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "generate-tokens-req7",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": None}],
        "kv_transfer_params": {"do_remote_decode": True},
    }


def _generated() -> dict[str, Any]:
    return {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "token_ids": [9, 8]}]}


def test_a_whole_answer_with_tool_calls_finishes_with_tool_calls() -> None:
    mended = mend_whole(
        _whole({"content": None, "tool_calls": [_TOOL_CALL]}),
        _generated(),
        client_wants_ids=False,
        chat=True,
    )
    assert mended["choices"][0]["finish_reason"] == "tool_calls"
    assert "kv_transfer_params" not in mended
    assert mended["id"] == "chatcmpl-req7"


def test_a_whole_answer_without_tool_calls_keeps_its_finish_reason() -> None:
    for finish in ("stop", "length"):
        mended = mend_whole(
            _whole({"content": "hi"}, finish), _generated(), client_wants_ids=False, chat=True
        )
        assert mended["choices"][0]["finish_reason"] == finish


def test_token_ids_come_from_the_engine_when_the_client_asked() -> None:
    mended = mend_whole(_whole({"content": "x"}), _generated(), client_wants_ids=True, chat=True)
    assert mended["prompt_token_ids"] == [1, 2, 3]
    assert mended["choices"][0]["token_ids"] == [9, 8]


def test_public_ids_follow_vllm_serve() -> None:
    assert public_id("generate-tokens-abc", chat=False) == "cmpl-abc"
    assert public_id("generate-tokens-chatcmpl-abc") == "chatcmpl-abc"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "generate-tokens-r",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        "usage": None,
    }


def _call(call_id: str | None, arguments: str) -> dict[str, Any]:
    return {"index": 0, "id": call_id, "function": {"name": None, "arguments": arguments}}


def test_a_streamed_tool_call_keeps_its_first_id_and_finishes_with_tool_calls() -> None:
    mender = StreamMender(client_wants_ids=False, chat=True)
    first = mender.mend(_chunk({"tool_calls": [_call("id-1", "")]}), {0: [1]})
    # A later derender call that parsed the whole output again names the call anew.
    again = mender.mend(_chunk({"tool_calls": [_call("id-2", '{"a": 1}')]}), {0: [2]})
    last = mender.mend(_chunk({"content": None}, finish="stop"), {0: [3]})
    assert first is not None and again is not None and last is not None
    assert first["choices"][0]["delta"]["tool_calls"][0]["id"] == "id-1"
    assert again["choices"][0]["delta"]["tool_calls"][0]["id"] == "id-1"
    assert last["choices"][0]["finish_reason"] == "tool_calls"


def test_empty_chunks_are_dropped_and_content_is_kept_for_the_next_turn() -> None:
    mender = StreamMender(client_wants_ids=False, chat=True)
    assert mender.mend(_chunk({"role": None, "content": None, "reasoning": None}), {0: [5]}) is None
    sent = mender.mend(_chunk({"content": "Hel"}), {0: [6]})
    sent2 = mender.mend(_chunk({"content": "lo"}), {0: [7]})
    assert sent is not None and sent2 is not None
    assert mender.content == "Hello"
    usage_only = {"id": "generate-tokens-r", "choices": [], "usage": {"completion_tokens": 3}}
    assert mender.mend(usage_only, {}) is not None  # usage goes through


def test_streamed_token_ids_go_to_a_client_that_asked() -> None:
    mender = StreamMender(client_wants_ids=True, chat=True)
    sent = mender.mend(_chunk({"content": "a"}), {0: [11, 12]})
    assert sent is not None and sent["choices"][0]["token_ids"] == [11, 12]
