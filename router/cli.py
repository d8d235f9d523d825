"""``carryover serve``: the configuration read (``router/config/load.py``), checked once,
then uvicorn's workers started with it."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from carryover.router.config import CONFIG_ENV, ConfigError, RouterConfig
from carryover.router.config.keys import ENV_PREFIX, keys
from carryover.router.config.load import load_config
from carryover.router.metrics import MULTIPROC_ENV

__all__ = ["main", "server_options"]


def _serve(argv: Sequence[str]) -> None:
    # uvicorn (httptools, uvloop) rather than granian: one thread per worker, no handoff
    # between a server thread and the event loop; a turn costs 15-40% less CPU at concurrency 1
    # (bench/RESULTS.md, "Router overhead"). With several workers this process only
    # supervises: each worker is spawned and builds the app itself (router.http.asgi).
    import uvicorn

    config = load_config(argv)
    _preflight(config)
    for name in _secret_variables():  # read: the workers must not inherit them
        os.environ.pop(name, None)
    remove_dead_scratch()
    with _private_config(config), _worker_metrics(config.workers or 1):
        _run_uvicorn(uvicorn, config)


#: This process's scratch folders: ``carryover-serve-<pid>-…`` (the workers' config) and
#: ``carryover-metrics-<pid>-…`` (their samples), removed at exit.
_SCRATCH = re.compile(r"carryover-(?:serve|metrics)-(\d+)-")


def _scratch(kind: str) -> tempfile.TemporaryDirectory[str]:
    """A scratch folder named by this process's id, so that a later start can tell one whose
    router died without removing it (SIGKILL, the OOM killer) from one still in use."""
    return tempfile.TemporaryDirectory(prefix=f"carryover-{kind}-{os.getpid()}-")  # mode 0700


def remove_dead_scratch() -> list[Path]:
    """Scratch folders of this user's routers that are no longer running: removed."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob("carryover-*-*-*"):
        found = _SCRATCH.match(folder.name)
        if found is None or not folder.is_dir() or folder.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(found.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        except PermissionError:
            pass  # a process of another user has that id now: its folder is not this one
    return removed


def _preflight(config: RouterConfig) -> None:
    """What would stop every worker as it starts, checked once here first: a failure is one
    line and exit 2 however many workers there are (uvicorn's supervisor of several workers
    exits 0 when they fail). An unreachable store is not one: turns are served cold."""
    from carryover.router.store import check_store, open_store
    from carryover.router.tenants.salt import salts_of

    salts_of(config)
    if config.redis is None:
        return

    async def check() -> None:
        store = open_store(config)
        try:
            await check_store(store, config)
        finally:
            await store.close()

    asyncio.run(check())


def _secret_variables() -> list[str]:
    """Variables that may hold a key or a password and that this process has read: the
    secret keys' (config/keys.py) and the Redis URL, which may carry one. Files are the
    recommended way; ``CARRYOVER_REDIS_PASSWORD`` stays, each worker reads it."""
    return [k.env for k in keys() if k.flag is None] + [ENV_PREFIX + "REDIS"]


@contextlib.contextmanager
def _private_config(config: RouterConfig) -> Iterator[None]:
    """The config for the workers, in a file only this user can read, removed at exit."""
    with _scratch("serve") as folder:
        path = Path(folder) / "config.json"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(msgspec.json.encode(config))
        os.environ[CONFIG_ENV] = str(path)
        try:
            yield
        finally:
            del os.environ[CONFIG_ENV]


@contextlib.contextmanager
def _worker_metrics(workers: int) -> Iterator[None]:
    """Several workers share one view of the metrics (router/metrics.py): their samples go to
    files in ``PROMETHEUS_MULTIPROC_DIR``, the operator's folder if set (emptied now: samples
    of an earlier run would add up with these), else a temporary one removed at exit."""
    if workers <= 1:
        yield
        return
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        folder = Path(given)
        if not folder.is_dir():
            raise ConfigError(f"{MULTIPROC_ENV}={given} is not a directory")
        for stale in folder.glob("*.db"):
            stale.unlink()
        yield
        return
    with _scratch("metrics") as made:
        os.environ[MULTIPROC_ENV] = made
        try:
            yield
        finally:
            del os.environ[MULTIPROC_ENV]


def _run_uvicorn(uvicorn: Any, config: RouterConfig) -> None:
    uvicorn.run(
        "carryover.router.http.asgi:build",
        factory=True,
        workers=config.workers,
        **server_options(config),
    )


def server_options(config: RouterConfig) -> dict[str, Any]:
    """How uvicorn serves the router: every process that serves one uses these."""
    return dict(
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        ws="none",
        lifespan="on",
        log_config=None,  # router.logs configures logging in each worker
        log_level=config.log_level,
        access_log=False,
        proxy_headers=False,  # clients' addresses are not read
        server_header=False,
        timeout_graceful_shutdown=math.ceil(config.shutdown_grace),
        timeout_keep_alive=math.ceil(config.timeouts.client_keepalive),
    )


_USAGE = """usage: carryover serve [ARGS]

  serve   run the router in front of vLLM prefill/decode instances
"""


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return
    command, rest = args[0], args[1:]
    try:
        if command == "serve":
            _serve(rest)
        else:
            print(_USAGE, file=sys.stderr)
            raise SystemExit(2)
    except ConfigError as exc:
        print(f"carryover: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
