"""What the render server's derendered answers lack against ``vllm serve``, mended on the
way to the client (docs/tokens-pipeline.md, "Gaps of the render server").

- A whole chat answer with tool calls says ``finish_reason: "stop"`` (the fix is vLLM PR
  #47931, not in 0.32); ``vllm serve`` says ``"tool_calls"``.
- Ids are the generate request's (``generate-tokens-chatcmpl-…``), not the chat ids
  clients get from ``vllm serve``.
- A streamed tool call keeps the id its first delta gave it: the parser runs again over
  the whole output on each derender call, and nothing in vLLM 0.32 pins the id across calls
  (vLLM issue #57571).
- Chunks the parser emits with nothing in them (it is between markers) are dropped.
- Token ids go to a client that asked for them (``return_token_ids``), from the engine's
  answer, since the derendered one has none.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StreamMender", "mend_whole", "public_id"]

_GENERATE_PREFIX = "generate-tokens-"


def public_id(engine_id: Any, *, chat: bool = True) -> Any:
    """``chatcmpl-…`` (``cmpl-…``) as ``vllm serve`` names answers, from the generate
    request's id (``generate-tokens-`` and the router's request id)."""
    if not isinstance(engine_id, str):
        return engine_id
    if engine_id.startswith(_GENERATE_PREFIX):
        engine_id = engine_id[len(_GENERATE_PREFIX) :]
    prefix = "chatcmpl-" if chat else "cmpl-"
    return engine_id if engine_id.startswith(prefix) else prefix + engine_id


def _tool_finish(choice: dict[str, Any], saw_tool_calls: bool) -> None:
    if saw_tool_calls and choice.get("finish_reason") == "stop":
        choice["finish_reason"] = "tool_calls"


def mend_whole(
    answer: dict[str, Any], generated: dict[str, Any], *, client_wants_ids: bool, chat: bool
) -> dict[str, Any]:
    """A derendered whole answer, as ``vllm serve`` gives it. ``generated``: the engine's
    generate answer it came from."""
    answer["id"] = public_id(answer.get("id"), chat=chat)
    answer.pop("kv_transfer_params", None)  # the derender copies the engine's handle through
    engine_choices = {
        c.get("index", 0): c for c in generated.get("choices") or () if isinstance(c, dict)
    }
    for choice in answer.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        if isinstance(message, dict):
            _tool_finish(choice, bool(message.get("tool_calls")))
        if client_wants_ids:
            engine = engine_choices.get(choice.get("index", 0), {})
            choice["token_ids"] = engine.get("token_ids")
    if client_wants_ids:
        answer["prompt_token_ids"] = generated.get("prompt_token_ids")
    return answer


def _is_empty(choice: dict[str, Any]) -> bool:
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    if choice.get("token_ids"):
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return choice.get("text") in (None, "")  # completions
    return all(value in (None, "", []) for value in delta.values())


class StreamMender:
    """Mends each derendered chunk of one streamed answer."""

    def __init__(self, *, client_wants_ids: bool, chat: bool) -> None:
        self.client_wants_ids = client_wants_ids
        self.chat = chat
        self._tool_ids: dict[tuple[int, int], str] = {}  # (choice, tool call) -> first id
        self._saw_tools: set[int] = set()
        self._content: list[str] = []  # choice 0's content, as the client got it

    @property
    def content(self) -> str:
        return "".join(self._content)

    def mend(self, chunk: dict[str, Any], token_ids: dict[int, list[int]]) -> dict[str, Any] | None:
        """The chunk to send, or ``None`` when it carries nothing. ``token_ids``: the engine
        ids each choice's part of this chunk came from."""
        chunk["id"] = public_id(chunk.get("id"), chat=self.chat)
        kept = []
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._pin_tool_ids(index, delta)
                if index == 0 and isinstance(delta.get("content"), str):
                    self._content.append(delta["content"])
            _tool_finish(choice, index in self._saw_tools)
            if self.client_wants_ids:
                choice["token_ids"] = token_ids.get(index)
            if not _is_empty(choice):
                kept.append(choice)
        if not kept and chunk.get("usage") is None:
            return None
        chunk["choices"] = kept
        return chunk

    def _pin_tool_ids(self, index: int, delta: dict[str, Any]) -> None:
        calls = delta.get("tool_calls")
        if not isinstance(calls, list) or not calls:
            return
        self._saw_tools.add(index)
        for call in calls:
            if not isinstance(call, dict) or not call.get("id"):
                continue
            key = (index, int(call.get("index") or 0))
            call["id"] = self._tool_ids.setdefault(key, call["id"])
