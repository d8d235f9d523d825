"""The simulator's KV-event encoder writes the bytes vLLM's own classes write: the class
definitions of ``vllm/distributed/kv_events.py`` in the real tier's vLLM, run as they are
(only those: importing vLLM would load torch, 10 s, for a few msgspec Structs). The fast tier
then checks the router against a publisher that speaks vLLM's wire format exactly."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import pytest

from carryover.bench.real.env import ensure_env
from carryover.bench.sim.kv_wire import encode_batch
from tests.unit.sim.cases import CASES, sim_events

pytestmark = pytest.mark.real

_CLASSES = (
    "EventBatch",
    "KVCacheEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEventBatch",
)


def _vllm_classes() -> dict[str, Any]:
    python = ensure_env()
    found = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    source = Path(found.stdout.strip()) / "vllm" / "distributed" / "kv_events.py"
    tree = ast.parse(source.read_text())
    wanted = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in _CLASSES]
    assert {n.name for n in wanted} == set(_CLASSES), "vLLM's event classes moved"
    namespace: dict[str, Any] = {"msgspec": msgspec, "Any": Any, "ExternalBlockHash": bytes | int}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(source), "exec"), namespace)
    return namespace


def test_the_simulator_encodes_kv_events_as_vllm_does() -> None:
    vllm = _vllm_classes()
    for ts, events, rank in CASES:
        made = []
        for name, fields in events:
            if "extra_keys" in fields:
                fields = {**fields, "extra_keys": [k and tuple(k) for k in fields["extra_keys"]]}
            made.append(vllm[name](**fields))
        theirs = msgspec.msgpack.encode(
            vllm["KVEventBatch"](ts=ts, events=made, data_parallel_rank=rank)
        )
        assert encode_batch(ts, sim_events(events), rank) == theirs
