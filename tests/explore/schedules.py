"""Fault schedules for one conversation and a driver that runs the real router on them.

A schedule is drawn from a seed: the fleet (one or two P and D), the policy when no P can
serve, whether the engines' served name is known, and for each turn of a three-turn
conversation the faults P, D and the store meet in order, the loop step at which the client
leaves, and whether a second request of the same conversation arrives meanwhile (and at
which step). The driver builds the app in process (its lifespan, the real turn code, the
in-process store behind a faulty wrapper, the engines of ``engines.py`` on the transport
seam), sends each request through the ASGI interface as a server would, counts event-loop
steps to place the faults of time, then lets every background task end and checks the
invariants (:func:`violations`). Everything runs on one event loop with no I/O, so a seed
replays exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from litestar import Litestar

from carryover.router.config.load import load_config
from carryover.router.http.app import create_app
from carryover.state import Committed, ConversationKey, MemoryStore, Record, StoreUnavailable
from tests.explore.engines import MODEL, Engines, Fault, answer_of, loop_step, render

KEYS = {"k1": "t1", "k2": "t2"}
NOW = 1_000_000.0  # the router's and the store's clock: nothing expires within a schedule
_P_FAULTS: list[str | int | None] = [
    None,
    None,
    Fault.REFUSE,
    Fault.TIMEOUT,
    Fault.NO_PARAMS,
    400,
    408,
    429,
    500,
    503,
]
_D_FAULTS: list[str | int | None] = [
    None,
    None,
    Fault.REFUSE,
    Fault.TIMEOUT,
    500,
    Fault.BREAK,
    Fault.BREAK_EARLY,
    Fault.NO_DONE,
]
_STORE_FAULTS: list[str | None] = [None, None, None, "before", "after"]
#: Content parts a client may send beside text: the engines treat each as media.
_ODD_PARTS: list[dict[str, Any]] = [
    {"type": "text", "text": "look", "video_embeds": "AAAA"},
    {"input_image": "http://x/i.png"},
    {"type": "text", "text": "see", "prompt_embeds": "AAAA"},
]


@dataclass(frozen=True)
class TurnPlan:
    stream: bool
    tenant_key: str
    salt: str | None
    model: str
    odd_part: dict[str, Any] | None
    leave_at: int | None  # the loop step at which the client leaves
    again_at: int | None  # the step at which a second request of the turn arrives
    p_faults: tuple[str | int | None, ...] = ()  # what P's requests meet, in order
    d_faults: tuple[str | int | None, ...] = ()
    claim_faults: tuple[str | None, ...] = ()  # what the store's claims meet
    commit_faults: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class Schedule:
    seed: int
    prefills: int
    decodes: int
    when_prefill_down: str
    names_known: bool
    turns: tuple[TurnPlan, ...]


def draw(seed: int) -> Schedule:
    rng = random.Random(seed)
    names_known = rng.random() > 0.2
    key, salt = rng.choice(list(KEYS)), rng.choice([None, "A"])
    turns = []
    for _ in range(3):
        if rng.random() < 0.15:  # the same conversation id from another tenant or salt
            key = rng.choice(list(KEYS))
        if rng.random() < 0.15:
            salt = rng.choice([None, "A", "B"])
        turns.append(
            TurnPlan(
                stream=rng.random() < 0.5,
                tenant_key=key,
                salt=salt,
                model=MODEL if names_known or rng.random() < 0.5 else "lora-a",
                odd_part=rng.choice(_ODD_PARTS) if rng.random() < 0.1 else None,
                leave_at=rng.randrange(60) if rng.random() < 0.3 else None,
                again_at=rng.randrange(40) if rng.random() < 0.15 else None,
                p_faults=_some(rng, _P_FAULTS, 3),
                d_faults=_some(rng, _D_FAULTS, 2),
                claim_faults=_some(rng, _STORE_FAULTS, 1),
                commit_faults=_some(rng, _STORE_FAULTS, 2),
            )
        )
    return Schedule(
        seed=seed,
        prefills=rng.choice([1, 1, 2]),
        decodes=rng.choice([1, 2]),
        when_prefill_down=rng.choice(["decode-alone", "fail"]),
        names_known=names_known,
        turns=tuple(turns),
    )


def _some(rng: random.Random, faults: list[Any], most: int) -> tuple[Any, ...]:
    """None in half the turns, else one to ``most`` faults in a row."""
    if rng.random() < 0.5:
        return ()
    return tuple(rng.choice(faults) for _ in range(rng.randint(1, most)))


#: A client timer that never fires within a turn: it counts the turn's loop steps.
NEVER = 1_000_000


def leaving_at(schedule: Schedule, turn: int, step: int | None) -> Schedule:
    """``schedule`` with the client of ``turn`` leaving at loop step ``step``."""
    turns = list(schedule.turns)
    turns[turn] = dataclasses.replace(turns[turn], leave_at=step)
    return dataclasses.replace(schedule, turns=tuple(turns))


async def sweep(schedule: Schedule, turn: int) -> list[Run]:
    """``schedule`` once for every loop step of ``turn`` at which its client can leave: the
    turn's length is measured first, with a timer that never fires."""
    measured = await run(leaving_at(schedule, turn, NEVER))
    return [measured] + [
        await run(leaving_at(schedule, turn, step)) for step in range(measured.steps[turn])
    ]


class FaultyStore(MemoryStore):
    """The in-process store; each claim and commit takes a loop step, and fails as told:
    ``before`` (nothing done) or ``after`` (done, but the caller hears it failed)."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: NOW)
        self.faults: dict[str, list[str | None]] = {"claim": [], "commit": []}

    async def _fault(self, call: str) -> str | None:
        await loop_step()
        queue = self.faults[call]
        fault = queue.pop(0) if queue else None
        if fault == "before":
            raise StoreUnavailable(f"{call}: injected")
        return fault

    async def claim(self, key: ConversationKey) -> Record | None:
        fault = await self._fault("claim")
        record = await super().claim(key)
        if fault == "after":
            raise StoreUnavailable("claim: injected after it ran")
        return record

    async def commit(
        self, key: ConversationKey, record: Record, *, now: float, running_for: float | None = None
    ) -> Committed:
        fault = await self._fault("commit")
        committed = await super().commit(key, record, now=now, running_for=running_for)
        if fault == "after":
            raise StoreUnavailable("commit: injected after it ran")
        return committed

    def records(self) -> list[Record]:
        return list(self._records.values())


@dataclass
class Reply:
    status: int
    content: str | None  # the answer's text, when the client read it all
    messages: list[dict[str, Any]]
    path: str = ""  # X-Carryover-Path


@dataclass
class Run:
    schedule: Schedule
    engines: Engines
    store: FaultyStore
    replies: list[Reply] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # by turn, where the client had a timer
    held_decoded: float = 0.0
    open: int = 0
    ledger_errors: float = 0.0


def _scope(path: str, key: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"authorization", f"Bearer {key}".encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("router", 80),
        "state": {},
    }


async def _request(app: Any, body: dict[str, Any], key: str, leave: asyncio.Event) -> Reply:
    """One request through the ASGI interface; the client leaves when ``leave`` is set."""
    raw = json.dumps(body).encode()
    sent_body = False
    status = 0
    path = ""
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, path
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = dict(message.get("headers") or [])
            path = headers.get(b"x-carryover-path", b"").decode()
        elif message["type"] == "http.response.body" and not leave.is_set():
            chunks.append(message.get("body", b""))

    await app(_scope("/v1/chat/completions", key), receive, send)
    content = None if leave.is_set() else _content(b"".join(chunks), body)
    return Reply(status, content, body["messages"], path)


def _content(data: bytes, body: dict[str, Any]) -> str | None:
    if not body.get("stream"):
        try:
            return str(json.loads(data)["choices"][0]["message"]["content"])
        except (ValueError, KeyError, IndexError, TypeError):
            return None
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return None
    text = ""
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            return None
        for choice in chunk.get("choices", []):
            text += (choice.get("delta") or {}).get("content") or ""
    return text


def _messages(
    history: list[dict[str, Any]], turn: int, odd: dict[str, Any] | None
) -> list[dict[str, Any]]:
    question = f"question {turn}: tell me about rivers and stones " * 3
    content: Any = question if odd is None else [{"type": "text", "text": question}, odd]
    return [*history, {"role": "user", "content": content}]


async def until(condition: Callable[[], bool], what: str, steps: int = 10_000) -> None:
    """Wait for ``condition``, a loop step at a time (everything here is in process)."""
    for _ in range(steps):
        if condition():
            return
        await loop_step()
    raise AssertionError(f"{what}: not within {steps} loop steps")


async def _after(steps: int, event: asyncio.Event, counted: list[int]) -> None:
    for _ in range(steps):
        await loop_step()
        counted[0] += 1
    event.set()


class _Seam(httpx.AsyncBaseTransport):
    """The transport and the store one built app uses, pointed at each schedule's own in
    turn: building the app (Litestar parses every handler's signature) cost more than the
    schedule it ran."""

    def __init__(self) -> None:
        self.engines: Engines | None = None
        self.store: FaultyStore | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert self.engines is not None
        return await self.engines.handle_async_request(request)


class _SeamStore:
    def __init__(self, seam: _Seam) -> None:
        self._seam = seam

    def __getattr__(self, name: str) -> Any:
        return getattr(self._seam.store, name)


@functools.cache
def _router(prefills: int, decodes: int, when_prefill_down: str) -> tuple[Litestar, _Seam]:
    """One app per fleet and policy, whose lifespan each schedule enters afresh (a new pool,
    runner, ledger and metrics each time)."""
    args = ["--health-interval", "3600", "--when-prefill-down", when_prefill_down]
    args += [
        "--render-backend",
        "engine",
        "--expose-path-header",
    ]  # P's /tokenize: the engines' own rendering
    for i in range(prefills):
        args += ["--prefill", f"http://p{i}:8000"]
    for i in range(decodes):
        args += ["--decode", f"http://d{i}:8000"]
    config = load_config(args, environ={"CARRYOVER_API_KEYS": json.dumps(KEYS)})
    seam = _Seam()
    store: Any = _SeamStore(seam)
    return create_app(config, transport=seam, store=store, clock=lambda: NOW, seed=0), seam


async def run(schedule: Schedule) -> Run:
    prefill = [f"p{i}:8000" for i in range(schedule.prefills)]
    decode = [f"d{i}:8000" for i in range(schedule.decodes)]
    engines = Engines(prefill, decode, models_down=not schedule.names_known)
    store = FaultyStore()
    app, seam = _router(schedule.prefills, schedule.decodes, schedule.when_prefill_down)
    seam.engines, seam.store = engines, store
    result = Run(schedule, engines, store)
    async with app.lifespan():
        services = app.state.services
        services.runner._svc.rng.seed(schedule.seed)  # the pool's and the release's choices
        if schedule.names_known:  # the router asks the engines' served name in the background
            await until(lambda: all(r.name for r in services.models), "the served model's name")
        history: list[dict[str, Any]] = []
        for index, turn in enumerate(schedule.turns):
            messages = _messages(history, index, turn.odd_part)
            engines.faults = {"prefill": list(turn.p_faults), "decode": list(turn.d_faults)}
            store.faults = {"claim": list(turn.claim_faults), "commit": list(turn.commit_faults)}
            body: dict[str, Any] = {
                "model": turn.model,
                "messages": messages,
                "conversation_id": "c1",
                "stream": turn.stream,
                "max_tokens": 16,
            }
            if turn.salt is not None:
                body["cache_salt"] = turn.salt
            leave, never = asyncio.Event(), asyncio.Event()
            timers = []
            counted = [0]  # loop steps the turn took, while the client's timer ran
            if turn.leave_at is not None:
                timers.append(asyncio.create_task(_after(turn.leave_at, leave, counted)))
            requests = [_request(app, body, turn.tenant_key, leave)]
            if turn.again_at is not None:
                go = asyncio.Event()
                timers.append(asyncio.create_task(_after(turn.again_at, go, [0])))

                async def again(
                    go: asyncio.Event = go,
                    body: dict[str, Any] = body,
                    key: str = turn.tenant_key,
                    never: asyncio.Event = never,
                ) -> Reply:
                    await go.wait()
                    return await _request(app, dict(body), key, never)

                requests.append(again())
            replies = await asyncio.gather(*requests)
            for timer in timers:
                timer.cancel()
            result.steps.append(counted[0])
            result.replies += replies
            history = [*messages, {"role": "assistant", "content": answer_of(render(messages))}]
        await services.runner.drain_background()
        result.held_decoded = services.metrics.handles_held.labels("decoded")._value.get()
        result.open = services.runner.ledger.open
        result.ledger_errors = services.metrics.ledger_errors._value.get()
    return result


def violations(result: Run) -> list[str]:
    """What must hold after every schedule."""
    found = list(result.engines.violations)
    if result.open != 0:
        found.append(f"{result.open} handles without a fate")
    if result.ledger_errors:
        found.append(f"{result.ledger_errors:g} ledger errors")
    if result.held_decoded < result.engines.delivered:
        found.append(
            f"D delivered {result.engines.delivered} handles, the ledger held "
            f"{result.held_decoded:g}"
        )
    for record in result.store.records():
        pin = result.engines.pins.get(str(record.handle.get("remote_request_id")))
        if pin is None or pin.state != "pinned":
            found.append(
                f"a stored record names a handle that is {pin.state if pin else 'unknown'}"
            )
    for reply in result.replies:
        if reply.status == 200 and reply.content is not None:
            cold = answer_of(render(reply.messages))
            if reply.content != cold:
                found.append(f"an answer differs from the cold answer: {reply.content} != {cold}")
        elif reply.status >= 500 and reply.status not in (502, 503, 504):
            found.append(f"status {reply.status}")
    return found
