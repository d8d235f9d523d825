"""What the router reads of P's answer: P's dict for D, and the prompt ids P says it ran,
kept as P's own JSON.

The ids are there to be compared with the checked ids once D has answered
(router/turn/commit.py). Decoded into Python ints and compared one by one, a 20k-token
prompt's ids were about a tenth of a turn's instructions (bench/RESULTS.md); compared as
JSON with the checked ids encoded the same way, they cost one encode and a memcmp. JSON that
differs only in its spacing is decoded and compared as before.
"""

from __future__ import annotations

from typing import Any

import msgspec

from carryover.router.relay import CUT_JSON, cut_ids

__all__ = ["PrefillAnswer", "RanIds", "read", "same_ids"]

_encoder = msgspec.json.Encoder()
_ids = msgspec.json.Decoder(list[int])


class _Choice(msgspec.Struct):
    index: Any = 0
    prompt_token_ids: msgspec.Raw = msgspec.Raw()


class PrefillAnswer(msgspec.Struct):
    """The fields of P's answer the router reads; the rest is skipped unread."""

    kv_transfer_params: Any = None
    prompt_token_ids: msgspec.Raw = msgspec.Raw()
    choices: list[_Choice] | None = None

    @property
    def ran(self) -> RanIds | None:
        """The prompt ids P ran, where D's answer carries them too (the answer's own, else
        choice 0's); ``None`` when P does not say."""
        chosen = (c.prompt_token_ids for c in self.choices or () if c.index == 0)
        for raw in (self.prompt_token_ids, *chosen):
            if memoryview(raw)[:1].tobytes() == b"[":  # an array, not absent or null
                return RanIds(bytes(raw))
        return None


class RanIds(msgspec.Struct, frozen=True):
    """A JSON array of prompt ids, as P sent it."""

    json: bytes


def same_ids(ran: RanIds, ids: list[int], ids_json: bytes | None = None) -> bool:
    """Whether ``ran`` holds exactly ``ids`` (an array that is not all ints does not);
    ``ids_json``: their JSON, when it is at hand."""
    if ran.json == (ids_json if ids_json is not None else _encoder.encode(ids)):
        return True
    try:
        return _ids.decode(ran.json) == ids
    except msgspec.DecodeError:
        return False


_decoder = msgspec.json.Decoder(PrefillAnswer)


def read(content: bytes) -> PrefillAnswer:
    """P's answer, its prompt ids cut out by position before the rest is decoded: skipping
    a 17k-token array as a ``Raw`` field validates it, 0.34 ms where finding it costs 0.1
    (``bench/RESULTS.md``)."""
    cut = cut_ids(content)
    if cut is None:
        return _decoder.decode(content)
    body, ids = cut
    answer = _decoder.decode(body)
    if bytes(answer.prompt_token_ids) == CUT_JSON:
        answer.prompt_token_ids = msgspec.Raw(ids)
        return answer
    for choice in answer.choices or ():
        if bytes(choice.prompt_token_ids) == CUT_JSON:
            choice.prompt_token_ids = msgspec.Raw(ids)
            return answer
    return _decoder.decode(content)  # the array sat elsewhere: decoded whole
