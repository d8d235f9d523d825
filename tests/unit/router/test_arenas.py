"""A served worker's threads share two glibc malloc arenas (router/memory.py): each thread
that renders a large request would otherwise grow an arena of its own, whose freed pages
stay resident."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest

from carryover.router.config import CONFIG_ENV
from carryover.router.config.load import load_config
from carryover.router.http import asgi
from carryover.router.memory import ARENAS, limit_arenas

# Six threads alive at once, each allocating through malloc (100 kB: above pymalloc's small
# objects, below glibc's mmap threshold); then glibc's own account of its arenas.
_PROBE = """
import ctypes, ctypes.util, sys, threading
from carryover.router.memory import limit_arenas
if sys.argv[1] == "limited":
    assert limit_arenas()
together = threading.Barrier(6)
def work():
    blocks = [bytearray(100_000) for _ in range(10)]
    together.wait()
threads = [threading.Thread(target=work) for _ in range(6)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
sys.stderr.flush()
ctypes.CDLL(ctypes.util.find_library("c")).malloc_stats()
"""


def _arenas(mode: str, **environ: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | environ
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return sum(line.startswith("Arena ") for line in done.stderr.splitlines())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_stats")
def test_threads_share_the_capped_arenas() -> None:
    assert _arenas("default") > ARENAS  # glibc: an arena a thread, up to 8 a core
    assert _arenas("limited") <= ARENAS


def test_an_operators_malloc_arena_max_is_left_to_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_arenas() is False


def test_a_worker_built_for_serving_caps_its_arenas_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(
        ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10"], environ={}
    )
    path = tmp_path / "config.json"
    path.write_bytes(msgspec.json.encode(config))
    monkeypatch.setenv(CONFIG_ENV, str(path))
    threads_when_capped: list[int] = []
    monkeypatch.setattr(
        asgi, "limit_arenas", lambda: threads_when_capped.append(threading.active_count())
    )
    asgi.build()
    # Once, and building the app started no thread after it (those would have arenas of
    # their own).
    assert threads_when_capped == [threading.active_count()]
