"""What the router takes from D's answer on the way to the client (router/relay.py)."""

from __future__ import annotations

import json

from carryover.router.relay import DecodeOutput


def test_the_answer_text_of_the_first_choice_is_collected_from_a_body_and_a_stream() -> None:
    whole = DecodeOutput(client_wants_ids=False)
    whole.body(
        {
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "fine"}},
                {"index": 1, "message": {"role": "assistant", "content": "other"}},
            ]
        }
    )
    assert whole.content == "fine"
    streamed = DecodeOutput(client_wants_ids=False)
    for delta in ({"role": "assistant", "content": ""}, {"content": "fi"}, {"content": "ne"}, {}):
        streamed.chunk(json.dumps({"choices": [{"index": 0, "delta": delta}]}).encode())
    assert streamed.content == "fine"
    tools = DecodeOutput(client_wants_ids=False)
    tools.body({"choices": [{"index": 0, "message": {"content": None, "tool_calls": []}}]})
    assert tools.content == ""


def test_ids_the_router_asked_for_are_stripped_from_every_choice_not_only_the_first() -> None:
    # D is always asked for token ids; a client that did not ask must not get them for any
    # choice of an n > 1 answer, nor the handle.
    answer = {
        "kv_transfer_params": {"do_remote_decode": True},
        "prompt_token_ids": [1, 2],
        "choices": [
            {"index": 0, "text": "a", "token_ids": [7], "prompt_token_ids": [1, 2]},
            {"index": 1, "text": "b", "token_ids": [8], "prompt_token_ids": [1, 2]},
        ],
    }
    output = DecodeOutput(client_wants_ids=False)
    seen = json.loads(output.body(json.loads(json.dumps(answer))))
    assert "kv_transfer_params" not in seen and "prompt_token_ids" not in seen
    assert [sorted(c) for c in seen["choices"]] == [["index", "text"], ["index", "text"]]
    assert (output.handle, output.prompt_ids, output.output_ids) == (
        {"do_remote_decode": True},
        [1, 2],
        [7],
    )
    chunk = DecodeOutput(client_wants_ids=False).chunk(json.dumps(answer).encode())
    assert b"token_ids" not in chunk and b"kv_transfer_params" not in chunk
    kept = json.loads(DecodeOutput(client_wants_ids=True).body(json.loads(json.dumps(answer))))
    assert [c["token_ids"] for c in kept["choices"]] == [[7], [8]]
