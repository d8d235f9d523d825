"""How far one reuse turn walks through the turn's code, and the shape that keeps it short:
a prepared turn and the stages' outcomes are values nothing changes, the path is assigned in
one file, and the services record has no behaviour of its own.

Two counts, over the second turn of a conversation whose first turn stored a handle (the
turn reuses it), whole and streamed:

- **stops**: the distinct functions of ``router/turn`` and ``router/handles`` the turn
  enters from the runner to its commit. Named functions and methods only: properties,
  comprehensions, closures and dunder methods are attribute reads and expressions (a
  closure is read where it is defined), not places a reader goes to.
- **chain**: the distinct functions of ``router/`` on the call stack at each of the turn's
  I/O (render, claim, P, D, commit), from the HTTP handler: the walk from the request to
  each thing the turn does.

The ceilings are today's counts: a change that lengthens the walk fails here and must say
why in the ceiling it raises.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import functools
import importlib
import inspect
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import carryover
from carryover.router.config.load import load_config
from carryover.router.http.app import create_app
from carryover.router.turn import model
from carryover.router.turn.services import TurnServices
from carryover.state import MemoryStore
from tests.explore.engines import MODEL, Engines, answer_of, render
from tests.explore.schedules import KEYS, NOW, _messages, _request, until

ROUTER = Path(carryover.__file__).parent / "router"
_ROOT = f"{ROUTER}/"
_STAGES = ("turn/", "handles/")
#: Where the turn's I/O leaves the router's code (the transport seam and the store).
_IO = frozenset({"handle_async_request", "claim", "commit"})

#: By mode (whole, streamed): 48 and 51 in 12 files before the turn became stages (eedea3f).
STOPS_CEILING = {False: 25, True: 25}
#: 17 and 19 at eedea3f.
CHAIN_CEILING = 16


@dataclasses.dataclass
class Walk:
    entered: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    chain: dict[tuple[str, str], None] = dataclasses.field(default_factory=dict)
    stream: bool = False
    path: str = ""

    def profile(self, frame: FrameType, event: str, _: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(_ROOT):
            self.entered.append((code.co_filename[len(_ROOT) :], code.co_qualname))
        elif code.co_name in _IO:
            stack: list[tuple[str, str]] = []
            caller = frame.f_back
            while caller is not None:
                if caller.f_code.co_filename.startswith(_ROOT):
                    name = caller.f_code.co_filename[len(_ROOT) :]
                    stack.append((name, caller.f_code.co_qualname))
                caller = caller.f_back
            self.chain.update(dict.fromkeys(reversed(stack)))

    @property
    def stops(self) -> list[tuple[str, str]]:
        return sorted({(f, q) for f, q in self.entered if f.startswith(_STAGES) and _is_stop(f, q)})

    @property
    def services_entered(self) -> int:
        return sum(1 for f, _ in self.entered if f == "turn/services.py")


@functools.cache
def _is_stop(file: str, qualname: str) -> bool:
    if "<" in qualname or qualname.rsplit(".", 1)[-1].startswith("__"):
        return False
    module = importlib.import_module("carryover.router." + file[:-3].replace("/", "."))
    owner: Any = module
    *outer, name = qualname.split(".")
    for part in outer:
        owner = getattr(owner, part)
    found = vars(owner).get(name) if isinstance(owner, type) else None
    return not isinstance(found, property | functools.cached_property)


async def _walk(stream: bool) -> Walk:
    engines = Engines(["p0:8000"], ["d0:8000"])
    args = ["--health-interval", "3600", "--render-backend", "engine", "--expose-path-header"]
    args += ["--prefill", "http://p0:8000", "--decode", "http://d0:8000"]
    config = load_config(args, environ={"CARRYOVER_API_KEYS": json.dumps(KEYS)})
    app = create_app(
        config, transport=engines, store=MemoryStore(clock=lambda: NOW), clock=lambda: NOW, seed=1
    )
    walk = Walk(stream=stream)
    async with app.lifespan():
        services = app.state.services
        await until(lambda: all(r.name for r in services.models), "the served model's name")
        history: list[dict[str, Any]] = []
        for turn in range(2):
            messages = _messages(history, turn, None)
            body = {"model": MODEL, "messages": messages, "conversation_id": "c1"}
            body |= {"stream": stream, "max_tokens": 16}
            if turn == 1:
                sys.setprofile(walk.profile)
            try:
                reply = await _request(app, body, "k1", asyncio.Event())
            finally:
                sys.setprofile(None)
            assert reply.status == 200
            history = [*messages, {"role": "assistant", "content": answer_of(render(messages))}]
        walk.path = reply.path
        await services.runner.drain_background()
    return walk


@pytest.fixture(scope="module", params=[False, True], ids=["whole", "streamed"])
def walk(request: pytest.FixtureRequest) -> Iterator[Walk]:
    yield asyncio.run(_walk(request.param))


def test_a_reuse_turn_makes_few_stops(walk: Walk) -> None:
    assert walk.path == "reuse"
    stops = [f"{f}:{q}" for f, q in walk.stops]
    print(f"{len(stops)} stops in {len({s.split(':')[0] for s in stops})} files: {stops}")
    assert len(stops) <= STOPS_CEILING[walk.stream], stops


def test_the_walk_from_the_handler_to_each_io_is_short(walk: Walk) -> None:
    chain = [f"{f}:{q}" for f, q in walk.chain]
    print(f"chain of {len(chain)}: {chain}")
    assert "http/inference.py:chat_completions" in chain and "turn/commit.py:commit" in chain
    assert len(chain) <= CHAIN_CEILING, chain


def test_the_turn_never_calls_into_its_services_record(walk: Walk) -> None:
    assert walk.services_entered == 0
    behaviour = {
        name
        for name, value in vars(TurnServices).items()
        if inspect.isfunction(value)
        and value.__qualname__.startswith("TurnServices.")
        and name not in ("__post_init__", "__init__", "__eq__", "__repr__")
    }
    assert behaviour == set()


def test_what_a_turn_carries_between_stages_are_values() -> None:
    for carried in (model.Prepared, model.PrefillOutcome, model.Started, model.TurnOutcome):
        assert carried.__dataclass_params__.frozen, carried  # type: ignore[attr-defined]


def test_only_the_path_module_assigns_a_turns_path() -> None:
    """Elsewhere a path's members are only compared with: the stages return notes, and
    ``router/turn/path.py`` folds them."""
    assigned = []
    for file in sorted(ROUTER.rglob("*.py")):
        if file.name == "path.py" and file.parent.name == "turn":
            continue
        tree = ast.parse(file.read_text())
        compared = {
            id(node)
            for compare in ast.walk(tree)
            if isinstance(compare, ast.Compare)
            for node in ast.walk(compare)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "TurnPath"
                and id(node) not in compared
            ):
                assigned.append(f"{file.relative_to(ROUTER)}:{node.lineno}")
    assert assigned == []
