"""Calls to vLLM's render server: render a client's request into a ``GenerateRequest``,
derender an engine's token answer into an OpenAI answer (vLLM 0.32
``entrypoints/scale_out/render`` and ``derender``)."""

from __future__ import annotations

from typing import Any

from carryover.router.engines.upstream import Upstream
from carryover.router.errors import EngineFailed, EngineUnavailable, UpstreamError

__all__ = ["RenderServerClient"]


def _request_field(chat: bool) -> str:
    return "chat_request" if chat else "completion_request"


class RenderServerClient:
    """One model's render server. A 4xx is the client's request (its message goes back as
    it is); anything else means no turn can run, since the engines cannot render."""

    def __init__(self, upstream: Upstream, url: str, timeout: float) -> None:
        self._upstream = upstream
        self.url = url.rstrip("/")
        self._timeout = timeout

    async def get_json(self, path: str) -> Any:
        try:
            answer = await self._upstream.get(f"{self.url}{path}", timeout=self._timeout)
        except UpstreamError as exc:
            raise EngineUnavailable(f"render server unreachable: {exc.message}") from exc
        if answer.status_code != 200:
            raise EngineUnavailable(f"render server answered {path} with {answer.status_code}")
        return answer.json()

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        return await self._post(path, body)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            return await self._upstream.post_json(f"{self.url}{path}", body, timeout=self._timeout)
        except EngineFailed as exc:
            if exc.upstream_status is not None and 400 <= exc.upstream_status < 500:
                raise
            raise EngineUnavailable(f"render server failed: {exc.message}") from exc
        except UpstreamError as exc:
            raise EngineUnavailable(f"render server unreachable: {exc.message}") from exc

    async def render(self, body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
        """The ``GenerateRequest`` of one chat or completion request."""
        if chat:
            answer = await self._post("/v1/chat/completions/render", body)
        else:
            rendered = await self._post("/v1/completions/render", body)
            if isinstance(rendered, list) and len(rendered) != 1:
                raise EngineFailed(
                    "a tokens-only model serves one prompt per completion request",
                    status=400,
                )
            answer = rendered[0] if isinstance(rendered, list) else None
        if not isinstance(answer, dict) or not isinstance(answer.get("token_ids"), list):
            raise EngineUnavailable("render server answered without token ids")
        return answer

    async def derender(
        self, response: dict[str, Any], prompt_tokens: int, request: dict[str, Any], *, chat: bool
    ) -> dict[str, Any]:
        """A whole generate answer as the OpenAI answer ``vllm serve`` would give."""
        body: dict[str, Any] = {"stream": False, _request_field(chat): request}
        if chat:
            body["generate_response"] = response
            body["prompt_tokens"] = prompt_tokens
        else:
            body["generate_responses"] = [response]
            body["prompt_tokens"] = [prompt_tokens]
        answer = await self._post(
            "/v1/chat/completions/derender" if chat else "/v1/completions/derender", body
        )
        if not isinstance(answer, dict):
            raise EngineUnavailable("render server answered a derender with a non-object")
        return answer

    async def derender_chunk(
        self,
        chunk: dict[str, Any],
        state: dict[str, Any] | None,
        prompt_ids: list[int],
        request: dict[str, Any],
        *,
        chat: bool,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """One (coalesced) stream chunk: the OpenAI chunk and the state for the next call.
        vLLM wants the full prompt ids and the request on every call."""
        body = {
            "stream": True,
            "generate_chunk": chunk,
            "stream_state": state,
            "prompt_token_ids": prompt_ids,
            _request_field(chat): request,
        }
        answer = await self._post(
            "/v1/chat/completions/derender" if chat else "/v1/completions/derender", body
        )
        if (
            not isinstance(answer, dict)
            or not isinstance(answer.get("chunk"), dict)
            or not isinstance(answer.get("stream_state"), dict)
        ):
            raise EngineUnavailable("render server answered a stream derender without a chunk")
        return answer["chunk"], answer["stream_state"]
