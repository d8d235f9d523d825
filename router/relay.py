"""What passes from D to the client: internal fields stripped, ids collected on the way."""

from __future__ import annotations

from typing import Any

import msgspec

from carryover.router.errors import EngineFailed
from carryover.router.outcomes import NoHandleCause

__all__ = ["CUT_JSON", "DecodeOutput", "cut_ids", "decode_answer", "parse_chunk"]

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()
_ids = msgspec.json.Decoder(list[int])

_IDS_KEY = b'"prompt_token_ids":'
_NOT_A_FLAT_ARRAY = (b"[", b"{", b'"')
#: What stands in the cut array's place until it is put back there (any other
#: ``prompt_token_ids`` holds null).
_CUT = "\u0000carryover-prompt-ids"
#: ``_CUT`` as it stands in the cut JSON.
CUT_JSON = _encoder.encode(_CUT)


def cut_ids(content: bytes) -> tuple[bytes, bytes] | None:
    """``content`` with its one prompt id array replaced by ``_CUT``, and that array's JSON;
    ``None`` unless exactly one ``"prompt_token_ids"`` key holds a flat array (any others
    ``null``). Such a key's closing quote is unescaped, so it cannot lie inside a string,
    and every key of D's answer is vLLM's own."""
    cut: tuple[int, int] | None = None
    at = content.find(_IDS_KEY)
    while at >= 0:
        start = at + len(_IDS_KEY)
        while content[start : start + 1] in (b" ", b"\n", b"\r", b"\t"):
            start += 1
        if content.startswith(b"[", start):
            end = content.find(b"]", start)
            if cut is not None or end < 0:
                return None
            if any(mark in content[start + 1 : end] for mark in _NOT_A_FLAT_ARRAY):
                return None
            cut = (start, end + 1)
        elif not content.startswith(b"null", start):
            return None
        at = content.find(_IDS_KEY, start)
    if cut is None:
        return None
    start, end = cut
    return content[:start] + CUT_JSON + content[end:], content[start:end]


def decode_answer(content: bytes) -> Any:
    """D's whole answer, its prompt ids left as their JSON (``msgspec.Raw``, encoded back
    verbatim): at 20k tokens, decoding them into a list and comparing that with the checked
    ids was a tenth of the router's instructions per turn (``bench/RESULTS.md``)."""
    cut = cut_ids(content)
    if cut is None:
        return _decoder.decode(content)
    body, array = cut
    obj = _decoder.decode(body)
    holders = [obj, *(obj.get("choices") or ())] if isinstance(obj, dict) else []
    for holder in holders:
        if isinstance(holder, dict) and holder.get("prompt_token_ids") == _CUT:
            holder["prompt_token_ids"] = msgspec.Raw(array)
            return obj
    return _decoder.decode(content)  # the array sat elsewhere: decoded whole


def parse_chunk(data: bytes) -> dict[str, Any]:
    """One SSE ``data:`` payload from D; an error event or garbage is an ``EngineFailed``.
    The chunk that carries the prompt's ids keeps them as their JSON, as a whole answer does
    (``decode_answer``): decoding them cost each streamed turn more than all its other
    chunks together (``bench/RESULTS.md``)."""
    try:
        obj = decode_answer(data)
    except msgspec.DecodeError as exc:
        raise EngineFailed("decode instance sent a malformed stream chunk") from exc
    if not isinstance(obj, dict):
        raise EngineFailed("decode instance sent a malformed stream chunk")
    if "error" in obj and not obj.get("choices"):
        error = obj["error"] if isinstance(obj["error"], dict) else {}
        raise EngineFailed(str(error.get("message") or "decode instance failed mid-stream"))
    return obj


class DecodeOutput:
    """Collects what the router needs from D's answer (prompt ids, output ids, handle) while
    removing it from what the client sees, unless the client asked for token ids."""

    def __init__(self, *, client_wants_ids: bool) -> None:
        self.client_wants_ids = client_wants_ids
        self._prompt_ids: list[int] | msgspec.Raw | None = None
        self.output_ids: list[int] = []
        self.handle: Any = None
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.saw_content = False
        self.no_handle: NoHandleCause | None = None  # why, when the engine API knows better
        # The handle came after a stream whose own pin the router cannot release
        # (Record.shadowed): a tokens-only stream's captured handle.
        self.shadowed = False
        self._content: list[str] = []  # choice 0's message content (chat), as the client got it

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt ids D said it ran (``None``: it did not say, or not as ints)."""
        if isinstance(self._prompt_ids, msgspec.Raw):
            try:
                self._prompt_ids = _ids.decode(self._prompt_ids)
            except msgspec.DecodeError:
                self._prompt_ids = None
        return self._prompt_ids

    def ran(self, ids: list[int], ids_json: bytes) -> bool:
        """Whether D ran exactly ``ids`` (``ids_json``: their JSON, compared first)."""
        if isinstance(self._prompt_ids, msgspec.Raw) and bytes(self._prompt_ids) == ids_json:
            return True
        return self.prompt_ids == ids

    def collect(self, obj: dict[str, Any]) -> None:
        """Take what the router needs from one answer or chunk of D: the handle, the ids it
        ran and generated, how choice 0 finished, and its text."""
        handle = obj.get("kv_transfer_params")
        if handle is not None:
            self.handle = handle
        prompt_ids = obj.get("prompt_token_ids")
        if isinstance(prompt_ids, list | msgspec.Raw) and self._prompt_ids is None:
            self._prompt_ids = prompt_ids
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            message = choice.get("message") or choice.get("delta")
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                self._content.append(message["content"])
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.output_ids.extend(ids)
                self.saw_content = True
            choice_prompt = choice.get("prompt_token_ids")
            if isinstance(choice_prompt, list | msgspec.Raw) and self._prompt_ids is None:
                self._prompt_ids = choice_prompt
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")

    def _strip(self, obj: dict[str, Any]) -> None:
        """Remove the handle, and the ids the router asked D for, from what the client sees."""
        obj.pop("kv_transfer_params", None)
        if self.client_wants_ids:
            return
        obj.pop("prompt_token_ids", None)
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)

    def add_content(self, text: str) -> None:
        self._content.append(text)

    def chunk(self, data: bytes) -> bytes:
        """One SSE ``data:`` payload from D, as the client gets it."""
        obj = parse_chunk(data)
        self.collect(obj)
        self._strip(obj)
        return b"data: " + _encoder.encode(obj) + b"\n\n"

    def body(self, obj: dict[str, Any]) -> bytes:
        """A non-streamed D answer, as the client gets it."""
        self.collect(obj)
        return self.client_body(obj)

    def client_body(self, obj: dict[str, Any]) -> bytes:
        """A collected answer, as the client gets it."""
        self._strip(obj)
        return _encoder.encode(obj)
