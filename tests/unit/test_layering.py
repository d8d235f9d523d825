"""Dependencies point one way: state knows nothing of the router, HTTP or Litestar; the router
never reaches into bench; only the benchmark plots, and its plotting library is an extra."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _top(module: str) -> str:
    """The part of the project a module belongs to: ``carryover.router.x`` is ``router``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "carryover" and len(parts) > 1 else parts[0]


def imports_of(folder: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {_top(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(_top(node.module))
        found[str(path.relative_to(ROOT))] = names
    return found


def test_state_imports_no_router_http_or_web_framework() -> None:
    for path, names in imports_of("state").items():
        assert not names & {"router", "bench", "litestar", "httpx", "aiohttp", "uvicorn"}, path


def test_router_does_not_import_bench() -> None:
    # `carryover sim|bench|demo` are dispatched by the umbrella command (carryover/cli.py).
    for path, names in imports_of("router").items():
        assert not names & {"bench", "cli"}, path


def test_the_simulator_imports_nothing_of_the_router() -> None:
    # The simulator is the oracle the router is tested against: its chat rendering and its
    # KV-event encoding are its own (bench/sim/chat.py, bench/sim/kv_wire.py).
    for path, names in imports_of("bench/sim").items():
        assert not names & {"router", "state"}, path


def test_the_router_runs_without_the_bench_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
    assert any(d.startswith("matplotlib") for d in project["optional-dependencies"]["bench"])
    probe = (
        "import sys, router.http.app, router.cli, carryover.cli, bench.sim.server;"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=ROOT)


def test_the_supervisor_of_several_workers_leaves_the_app_to_them() -> None:
    # With --workers N, `carryover serve` only supervises uvicorn's workers: importing the app
    # there would keep a second copy of the router's modules resident for nothing.
    probe = """
import sys, uvicorn
def run(app, **options):
    assert options["workers"] == 2 and options["factory"], options
    loaded = {"carryover.router.http.app", "litestar", "tokenizers", "redis"} & set(sys.modules)
    assert not loaded, loaded
    print("served")
uvicorn.run = run
from carryover.router.cli import main
main(["serve", "--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10",
      "--workers", "2", "--redis", "redis://127.0.0.1:9/0"])
"""
    ran = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert ran.stdout.strip() == "served"


def test_a_worker_loads_neither_redis_py_nor_httpx() -> None:
    # The store speaks RESP itself (state/resp.py) and engine calls go over router/engines/h1.py:
    # redis-py's package alone is ~20 MiB of a worker's resident memory, httpx ~10. Tests,
    # benchmarks and the in-process fakes (router/engines/wire_httpx.py) may still use them.
    probe = (
        "import sys, carryover.router.http.asgi, carryover.router.http.app,"
        " carryover.router.engines.upstream, carryover.state.redis_store;"
        "loaded = {'redis', 'httpx'} & set(sys.modules);"
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=ROOT)


def test_nothing_imports_the_projects_folders_by_their_checkout_names() -> None:
    # In a checkout router/, state/ and bench/ are importable from the top too; a module reached
    # both ways would load twice, with two copies of its state. The wheel has only carryover.
    for folder in ("carryover", "router", "state", "bench", "tests"):
        for path in imports_of(folder):
            lines = (ROOT / path).read_text().splitlines()
            bare = [
                line
                for line in lines
                if line.lstrip().startswith(("from router", "from state", "from bench"))
                or line.lstrip().startswith(("import router", "import state", "import bench"))
            ]
            assert not bare, (path, bare)
