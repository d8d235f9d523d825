"""What the router takes from D's answer on the way to the client (router/relay.py)."""

from __future__ import annotations

import json

from router.relay import DecodeOutput


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
        streamed.chunk(json.dumps({"choices": [{"index": 0, "delta": delta}]}))
    assert streamed.content == "fine"
    tools = DecodeOutput(client_wants_ids=False)
    tools.body({"choices": [{"index": 0, "message": {"content": None, "tool_calls": []}}]})
    assert tools.content == ""
