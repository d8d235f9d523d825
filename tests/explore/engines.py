"""P and D engines for the fault-schedule exploration: in process, on the router's transport
seam, with an oracle for the KV itself.

The engines keep what a real P and D would: D pins each finished turn's blocks (the prompt
and answer ids, the model and the salt they were computed under) behind a single-use handle;
P, given a handle, pulls the pinned ids and computes the rest of the prompt. The KV P hands
to D is those ids, so an answer is a function of the KV D decodes from: the answer of a turn
whose KV is right equals the answer computed cold. Every read that real engines would get
wrong is written down as a violation: a handle read after it was released or read, a pin
of another model, salt or prefix. Faults are queued per role and served in order.

Nothing here renders or encodes with router code: text becomes ids one character at a time.
"""

from __future__ import annotations

import itertools
import json
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "explore-model"


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def render(messages: list[dict[str, Any]]) -> list[int]:
    """The engines' own chat rendering (what P's ``/tokenize`` answers)."""
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<{m['role']}>{content or ''}</>")
    return encode("".join(parts) + "<assistant>")


def answer_of(kv: list[int]) -> str:
    """What D generates from the KV of a prompt: right KV, right answer."""
    return f"ans{zlib.crc32(bytes(str(kv), 'ascii')):08x}"


class _LoopStep:
    """One pass of the event loop: the task gives way once, as a read from a socket that
    has no data yet would. Nothing is waited for; other tasks (a client leaving, a second
    request) get their turn, so a schedule can place a fault between any two steps."""

    def __await__(self):  # type: ignore[no-untyped-def]
        yield  # a bare yield: asyncio's Task runs the others and resumes this one next pass


def loop_step() -> _LoopStep:
    return _LoopStep()


class Fault:
    """What an engine does with a request instead of serving it."""

    REFUSE = "refuse"  # no connection: the request never left
    TIMEOUT = "timeout"  # sent, no answer in time
    NO_PARAMS = "no_params"  # P: 200 without kv_transfer_params
    BREAK = "break"  # D stream: the connection drops after the handle's chunk
    BREAK_EARLY = "break_early"  # D stream: drops after the first chunk
    NO_DONE = "no_done"  # D stream: ends after the handle's chunk without [DONE]


@dataclass
class Pin:
    ids: list[int]
    model: str
    salt: str | None
    state: str = "pinned"  # pinned | read | released


@dataclass
class Engines(httpx.AsyncBaseTransport):
    prefill: list[str]
    decode: list[str]
    faults: dict[str, list[str | int]] = field(default_factory=dict)  # by role, in order
    models_down: bool = False  # /v1/models fails: the served name stays unknown
    pins: dict[str, Pin] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    delivered: int = 0  # handles D delivered to the router
    _kv: dict[str, tuple[list[int], str | None]] = field(default_factory=dict)  # P's params
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def _fault(self, role: str) -> str | int | None:
        queue = self.faults.get(role)
        return queue.pop(0) if queue else None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.netloc.decode()
        role = "prefill" if host in self.prefill else "decode" if host in self.decode else None
        if role is None:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if request.method == "GET":
            return self._get(path)
        body = json.loads(await request.aread())
        await loop_step()  # on its way: a client may leave before the engine has it
        response = self._serve(request, role, path, body)
        await loop_step()  # the engine has run it: a client may leave before the answer
        if role == "decode" and not body.get("stream") and response.status_code == 200:
            self.delivered += 1  # the whole answer, with its handle, reaches the router now
        return response

    def _serve(
        self, request: httpx.Request, role: str, path: str, body: dict[str, Any]
    ) -> httpx.Response:
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": render(body["messages"])})
        kv = body.get("kv_transfer_params") or {}
        releasing = kv.get("remote_num_tokens") == 0 and kv.get("remote_block_ids")
        fault = None if releasing else self._fault(role)
        if fault == Fault.REFUSE:
            raise httpx.ConnectError("connection refused", request=request)
        if fault == Fault.TIMEOUT:
            if role == "prefill":
                self._read(body, kv)  # P took it, and may have read the handle
            raise httpx.ReadTimeout("timed out", request=request)
        if isinstance(fault, int):
            if role == "prefill" and fault in (408, 429, 500, 503):
                self._read(body, kv)  # a proxy's answer, or P's failure after its read
            return httpx.Response(fault, json={"error": {"message": "injected", "code": fault}})
        if role == "prefill":
            return self._prefill(body, kv, no_params=fault == Fault.NO_PARAMS)
        return self._decode(body, kv, fault)

    def _get(self, path: str) -> httpx.Response:
        if path == "/v1/models":
            if self.models_down:
                return httpx.Response(500, json={"error": {"message": "down", "code": 500}})
            return httpx.Response(200, json={"data": [{"id": MODEL}]})
        if path == "/metrics":
            return httpx.Response(200, text="process_start_time_seconds 1.0\n")
        if path == "/version":
            return httpx.Response(200, json={"version": "0.33.0"})
        return httpx.Response(200, json={})

    def _prompt(self, body: dict[str, Any], kv: dict[str, Any]) -> list[int]:
        ids = kv.get("prompt_token_ids")
        if isinstance(ids, list):
            if _has_media(body.get("messages")):
                # The engine would run these ids, not the media placeholders it expands.
                self.violations.append("ids forwarded for a prompt with media")
            return ids
        if isinstance(body.get("prompt"), list):
            return list(body["prompt"])
        return render(body["messages"])

    def _read(self, body: dict[str, Any], kv: dict[str, Any]) -> list[int] | None:
        """P pulls the pinned KV a handle names (or frees it), checking what real engines
        could not: ``None`` when nothing is pulled."""
        if not (kv.get("do_remote_decode") and kv.get("remote_block_ids")):
            return None
        handle = str(kv["remote_request_id"])
        pin = self.pins.get(handle)
        if pin is None:
            self.violations.append(f"P was sent a handle D never gave: {handle}")
            return None
        if kv.get("remote_num_tokens") == 0:
            if pin.state != "pinned":
                self.violations.append(f"{handle} released after it was {pin.state}")
            pin.state = "released"
            return None
        prompt = self._prompt(body, kv)
        n = int(kv["remote_num_tokens"])
        if pin.state != "pinned":
            # Real engines read freed blocks as if they held this history: wrong KV.
            self.violations.append(f"P read {handle} after it was {pin.state}")
        elif pin.model != body.get("model"):
            self.violations.append(f"P read {handle} of {pin.model} for {body.get('model')}")
        elif pin.salt != body.get("cache_salt"):
            self.violations.append(f"P read {handle} of another salt")
        elif pin.ids[:n] != prompt[:n] or n > len(prompt):
            self.violations.append(f"P read {handle}: its tokens are not the prompt's prefix")
        was = pin.state
        pin.state = "read"
        return [-1] * n if was != "pinned" else pin.ids[:n]

    def _prefill(
        self, body: dict[str, Any], kv: dict[str, Any], *, no_params: bool
    ) -> httpx.Response:
        prompt = self._prompt(body, kv)
        pulled = self._read(body, kv) or []
        request_id = f"p-{next(self._ids)}"
        self._kv[request_id] = ([*pulled, *prompt[len(pulled) :]], body.get("cache_salt"))
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "p",
            "remote_request_id": request_id,
            "remote_host": "p",
            "remote_port": 1,
            "remote_block_ids": [[0]],
            "remote_num_tokens": len(prompt),
        }
        answer: dict[str, Any] = {"choices": [{"index": 0}], "prompt_token_ids": prompt}
        if not no_params:
            answer["kv_transfer_params"] = params
        return httpx.Response(200, json=answer)

    def _decode(
        self, body: dict[str, Any], kv: dict[str, Any], fault: str | int | None
    ) -> httpx.Response:
        prompt = self._prompt(body, kv)
        computed = self._kv.pop(str(kv.get("remote_request_id")), None)
        # D decodes from the KV P computed when it pulls it, else from its own prompt.
        cache = computed[0] if kv.get("do_remote_prefill") and computed is not None else prompt
        text = answer_of(cache)
        output = encode(text)
        handle_id = f"d-{next(self._ids)}"
        # D's handle covers the whole sequence but its last token (vLLM's remote_num_tokens).
        self.pins[handle_id] = Pin(
            [*prompt, *output][:-1], body.get("model"), body.get("cache_salt")
        )
        tokens = len(prompt) + len(output) - 1
        handle = {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_engine_id": "d",
            "remote_request_id": handle_id,
            "remote_host": "d",
            "remote_port": 1,
            "remote_block_ids": [list(range(-(-tokens // 16)))],
            "remote_num_tokens": tokens,
        }
        chat = "messages" in body
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "token_ids": output}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if not body.get("stream"):
            answer = {"choices": [choice], "prompt_token_ids": prompt, "kv_transfer_params": handle}
            return httpx.Response(200, json=answer)
        delta = {"content": text} if chat else {}
        first = {
            "choices": [{"index": 0, "delta": {"content": ""}, "text": ""}],
            "prompt_token_ids": prompt,
        }
        last = {
            "choices": [{**choice, "delta": delta, "text": text}],
            "kv_transfer_params": handle,
        }
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=_Stream(self, first, last, fault),
        )


def _has_media(messages: Any) -> bool:
    """The engines' own rule: any content part but a plain text one is media."""
    for message in messages or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and part.keys() <= {"type", "text"}
            ):
                return True
    return False


class _Stream(httpx.AsyncByteStream):
    def __init__(
        self, engines: Engines, first: dict[str, Any], last: dict[str, Any], fault: Any
    ) -> None:
        self._engines, self._first, self._last, self._fault = engines, first, last, fault

    async def __aiter__(self) -> AsyncIterator[bytes]:
        # A loop step before each chunk, as the network takes: a client may leave between.
        await loop_step()
        yield f"data: {json.dumps(self._first)}\n\n".encode()
        await loop_step()
        if self._fault == Fault.BREAK_EARLY:
            raise httpx.ReadError("connection reset by peer")
        # The router parses what it is given before it next waits: it sees this handle.
        self._engines.delivered += 1
        yield f"data: {json.dumps(self._last)}\n\n".encode()
        await loop_step()
        if self._fault == Fault.BREAK:
            raise httpx.ReadError("connection reset by peer")
        if self._fault != Fault.NO_DONE:
            yield b"data: [DONE]\n\n"
