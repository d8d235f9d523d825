"""The simulator's KV-event encoder writes the bytes vLLM's own classes write
(``vllm.distributed.kv_events``, in the real tier's environment, no engine): the fast tier
then checks the router against a publisher that speaks vLLM's wire format exactly."""

from __future__ import annotations

import subprocess

import msgspec
import pytest

from carryover.bench.real.env import ensure_env
from carryover.bench.real.process import offline_env
from carryover.bench.sim.kv_wire import encode_batch
from tests.unit.sim.cases import CASES, sim_events

pytestmark = pytest.mark.real

#: Reads the cases (msgpack on stdin), writes vLLM's encoding of each (msgpack on stdout).
_VLLM_ENCODES = """
import sys, msgspec
from vllm.distributed import kv_events
cases = msgspec.msgpack.decode(sys.stdin.buffer.read())
out = []
for ts, events, rank in cases:
    made = []
    for name, fields in events:
        if "extra_keys" in fields:
            fields["extra_keys"] = [tuple(k) if k is not None else None for k in fields["extra_keys"]]
        made.append(getattr(kv_events, name)(**fields))
    out.append(msgspec.msgpack.encode(kv_events.KVEventBatch(ts=ts, events=made, data_parallel_rank=rank)))
sys.stdout.buffer.write(msgspec.msgpack.encode(out))
"""


def test_the_simulator_encodes_kv_events_as_vllm_does() -> None:
    done = subprocess.run(
        [str(ensure_env()), "-c", _VLLM_ENCODES],
        input=msgspec.msgpack.encode(CASES),
        capture_output=True,
        env=offline_env(),
        check=True,
        timeout=300,
    )
    theirs = msgspec.msgpack.decode(done.stdout)
    ours = [encode_batch(ts, sim_events(events), rank) for ts, events, rank in CASES]
    assert ours == theirs
