"""A router killed with SIGKILL cannot remove its scratch folders (the workers' config, their
metric samples): the next router started on the machine removes those of dead routers, and
keeps those of routers still running."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.router_proc import RouterProcess

_ENGINES = ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10"]


def _exited_pid() -> int:
    """The id of a process that has run and exited."""
    probe = subprocess.Popen(["true"])
    probe.wait()
    return probe.pid


def _scratch(folder: Path) -> set[str]:
    return {p.name for p in folder.glob("carryover-*") if p.is_dir()}


async def test_the_next_start_removes_the_scratch_folders_of_a_killed_router(
    tmp_path: Path,
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    # A folder of a process that has exited, and of one of this user's that still runs.
    exited = _exited_pid()
    (temp / f"carryover-serve-{exited}-x1").mkdir()
    (temp / "carryover-serve-1-kept").mkdir()  # pid 1 always runs
    env = {"TMPDIR": str(temp)}
    first = RouterProcess(
        [*_ENGINES, "--workers", "2", "--redis", "redis://127.0.0.1:9"], tmp_path, env=env
    )
    try:
        await first.start(ready=False)
        assert first.process is not None
        made = {n for n in _scratch(temp) if f"-{first.process.pid}-" in n}
        assert {n.split("-")[1] for n in made} == {"serve", "metrics"}, _scratch(temp)
        assert f"carryover-serve-{exited}-x1" not in _scratch(temp)
        first.kill()
        assert made <= _scratch(temp)  # SIGKILL: nothing ran to remove them
        second = RouterProcess(_ENGINES, tmp_path, env=env)
        try:
            await second.start(ready=False)
            left = _scratch(temp)
            assert not made & left, left
            assert "carryover-serve-1-kept" in left
        finally:
            second.stop()
    finally:
        first.kill()
