"""D's whole answer keeps its prompt ids as their JSON (router/relay.py): what the client gets
and what the commit compares are D's own bytes, whatever else the answer holds."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from carryover.router.relay import DecodeOutput, decode_answer

IDS = list(range(5, 400, 7))


def chat_answer(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        "prompt_token_ids": IDS,
        "kv_transfer_params": {"do_remote_decode": True, "remote_block_ids": [[1, 2]]},
        **extra,
    }


def completion_answer() -> dict[str, Any]:
    return {"id": "cmpl-1", "choices": [{"index": 0, "text": "x", "prompt_token_ids": IDS}]}


# A message quoting the key (escaped inside its string), spacing as another encoder writes it.
TRICKY = 'here: {"prompt_token_ids": [1, 2]} and "prompt_token_ids":[3]'


@pytest.mark.parametrize(
    "answer",
    [chat_answer("hi"), chat_answer(TRICKY), completion_answer(), chat_answer("", usage=None)],
)
@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
@pytest.mark.parametrize("wants_ids", [True, False])
def test_the_client_gets_d_s_answer_and_the_commit_d_s_ids(
    answer: dict[str, Any], separators: tuple[str, str], wants_ids: bool
) -> None:
    content = json.dumps(answer, separators=separators).encode()
    decoded = decode_answer(content)
    output = DecodeOutput(client_wants_ids=wants_ids)
    body = output.body(decoded)
    assert output.prompt_ids == IDS
    assert output.ran(IDS, msgspec.json.encode(IDS))
    assert not output.ran([*IDS, 1], msgspec.json.encode([*IDS, 1]))
    want = json.loads(content)
    want.pop("kv_transfer_params", None)
    if not wants_ids:
        want.pop("prompt_token_ids", None)
        for choice in want["choices"]:
            choice.pop("prompt_token_ids", None)
    assert json.loads(body) == want


@pytest.mark.parametrize("wants_ids", [True, False])
def test_a_streamed_chunk_keeps_d_s_ids_as_their_json(wants_ids: bool) -> None:
    first = {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": TRICKY}}],
        "prompt_token_ids": IDS,
    }
    output = DecodeOutput(client_wants_ids=wants_ids)
    frame = output.chunk(json.dumps(first, separators=(",", ":")).encode())
    assert isinstance(output._prompt_ids, msgspec.Raw)  # compared as bytes, not decoded
    assert output.ran(IDS, msgspec.json.encode(IDS))
    assert not output.ran([*IDS, 1], msgspec.json.encode([*IDS, 1]))
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    want = dict(first) if wants_ids else {k: v for k, v in first.items() if k != "prompt_token_ids"}
    assert json.loads(frame[6:]) == want


def test_ids_the_router_did_not_check_are_compared_by_value() -> None:
    content = json.dumps(chat_answer("hi"), separators=(", ", ": ")).encode()
    output = DecodeOutput(client_wants_ids=False)
    output.collect(decode_answer(content))
    # Spaced JSON is not the router's encoding: the bytes differ, the values do not.
    assert output.ran(IDS, msgspec.json.encode(IDS))


@pytest.mark.parametrize(
    "content",
    [
        b'{"prompt_token_ids": [1, 2], "choices": [{"prompt_token_ids": [1, 2]}]}',  # two arrays
        b'{"prompt_token_ids": [1, [2]], "choices": []}',  # not flat
        b'{"prompt_token_ids": ["1"], "choices": []}',  # not numbers
        b'{"choices": [], "prompt_token_ids": [1, 2}',  # broken: the decoder says so
    ],
)
def test_other_shapes_are_decoded_whole(content: bytes) -> None:
    try:
        want = msgspec.json.decode(content)
    except msgspec.DecodeError:
        with pytest.raises(msgspec.DecodeError):
            decode_answer(content)
        return
    assert decode_answer(content) == want


def test_the_ids_go_back_where_they_were_beside_a_null_key() -> None:
    answer = completion_answer() | {"prompt_token_ids": None}
    content = json.dumps(answer).encode()
    output = DecodeOutput(client_wants_ids=True)
    body = output.body(decode_answer(content))
    assert json.loads(body) == answer
    assert output.prompt_ids == IDS
