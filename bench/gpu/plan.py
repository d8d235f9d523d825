"""The device calls of one GPU run, in order: each carries one part of the payload
(``payload.py``) and does what the parts carried so far allow, so that the whole run fits one
warm machine (30 minutes held at most) in calls of under 10 minutes each.

``carryover bench gpu plan`` prints them; whoever holds the device tool makes them, one after
the other without a pause (the machine goes back 30 s after a call). What a machine installed
is gone with it: a run whose machine was taken back starts again at the first call."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Call", "plan", "render"]

#: The device tool's limits (its README): a command line, paths carried, seconds a call.
COMMAND_LIMIT = 2000
CARRY_LIMIT = 8
CALL_LIMIT_S = 600

_DEVICE = "python3 bench/gpu/device.py"
#: Every later step imports carryover and vLLM from the installed site.
_SITE = "export PYTHONPATH=/tmp/gpu/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 "
_SITE += "TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
_TURNS = "python3 -m carryover.bench.gpu.turns"
_RESULTS = "/tmp/gpu/results"


def _collected(name: str, body: str, budget_s: int = CALL_LIMIT_S - 40) -> str:
    """``body`` under a deadline short of the call's, whatever it leaves (results, the
    engines' and routers' logs) packed into one file of ``$OUT`` even when it fails: what
    comes back is at most eight files."""
    pack = f"tar -C /tmp/gpu -cJf $OUT/{name}.tar.xz results logs probe.json 2>/dev/null"
    return f"mkdir -p {_RESULTS}; trap '{pack}' EXIT; timeout {budget_s} bash -ec '{body}'"


@dataclass(frozen=True)
class Call:
    why: str
    carry: list[str]
    command: str
    timeout_s: int = CALL_LIMIT_S


def plan(
    parts: Sequence[Path],
    *,
    root: Path,
    sizes: str = "8000x4,16000x4,32000x4",
    peer: str = "vllm-router:consistent_hash",
    prefill_gpu: str = "0",
    decode_gpu: str = "0",
) -> list[Call]:
    """The calls for ``parts`` (paths relative to the repository ``root``): the transport
    probe and the model with the first part, the engines once every part is in, the proof,
    carryover's arms, then the engines again without bidirectional transfer for vLLM Router
    (as its users run it: a router that never hands handles back would leave D's pins to
    fill D)."""
    carried = [str(p.relative_to(root)) for p in parts]
    install = f"{_DEVICE} install"
    engines = f"{_DEVICE} engines --prefill-gpu {prefill_gpu} --decode-gpu {decode_gpu}"
    first, *rest = sizes.split(",")
    turns = f"{_TURNS} run --out {_RESULTS}"
    ours = "--arms carryover-no-reuse,carryover"
    calls = [
        Call(
            "part 1: NIXL, vLLM's Python and FA3; probe the transport; make the model",
            [carried[0]],
            _collected(
                "call-1", f"{install} {carried[0]}; {_DEVICE} probe --out /tmp/gpu; {_DEVICE} model"
            ),
        )
    ]
    for index, part in enumerate(carried[1:-1], start=2):
        calls.append(Call(f"part {index}", [part], f"set -e; {install} {part}"))
    last = carried[-1] if len(carried) > 1 else None
    ship = f"{install} {last}; " if last else ""
    calls.append(
        Call(
            "the last part; P and D with bidirectional transfer; the proof; carryover's arms "
            "on the first size",
            [last] if last else [],
            _collected(
                "call-engines",
                f"{ship}{engines}; {_SITE}; {_TURNS} prove --out {_RESULTS}; "
                f"{turns} {ours} --sizes {first}",
            ),
        )
    )
    if rest:
        calls.append(
            Call(
                "carryover's arms on the other sizes",
                [],
                _collected("call-sizes", f"{_SITE}; {turns} {ours} --sizes {','.join(rest)}"),
            )
        )
    calls.append(
        Call(
            "P and D again, without bidirectional transfer; vLLM Router on every size",
            [],
            _collected(
                "call-peer",
                f"{_DEVICE} stop; {engines} --no-bidirectional; {_SITE}; "
                f"{turns} --arms {peer} --sizes {sizes}",
            ),
        )
    )
    for call in calls:
        if len(call.command) > COMMAND_LIMIT or len(call.carry) > CARRY_LIMIT:
            raise ValueError(f"a device call over the tool's limits: {call.why}")
    return calls


def render(calls: Sequence[Call]) -> str:
    """One JSON object a line: what the device tool's ``run`` takes, and why."""
    return "\n".join(json.dumps(asdict(call)) for call in calls)
