"""A served worker sets glibc's malloc up to give back what large requests leave behind
(router/memory.py): its threads share two arenas, and large blocks are always mapped. Each
probe runs in a process of its own, as the settings hold for a whole process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from carryover.router.http import asgi
from carryover.router.memory import MALLOC_SETTINGS
from tests.support.served import hand_a_worker_its_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

_TUNE = """
import ctypes, ctypes.util, sys, threading
from carryover.router.memory import tune_malloc
if sys.argv[1] == "tuned":
    assert tune_malloc()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
"""

# Six threads alive at once, each allocating through malloc (100 kB: above pymalloc's small
# objects, below glibc's mmap threshold); then glibc's own account of its arenas.
_ARENAS = """
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
libc.malloc_stats()
"""

# A 4 MB block freed, then four of 1 MB: how many bytes of them glibc mapped.
_MAPPED = """
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
libc.mallinfo2.restype = Mallinfo2
body = bytearray(4 << 20)
del body
before = libc.mallinfo2().hblkhd
blocks = [bytearray(1 << 20) for _ in range(4)]
print(libc.mallinfo2().hblkhd - before)
"""

# A turn's bodies: a 20k-token prompt's JSON is 100-400 kB, built, sent and freed twice a
# turn. How many page faults 200 of them cost once the first was made.
_REUSED = """
import resource
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
bytearray(300_000)
before = faults()
for _ in range(200):
    body = bytearray(300_000)
    del body
print(faults() - before)
"""


def _probe(code: str, mode: str, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_SETTINGS} | environ
    done = subprocess.run(
        [sys.executable, "-c", _TUNE + code, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done


def _arenas(mode: str) -> int:
    return sum(line.startswith("Arena ") for line in _probe(_ARENAS, mode).stderr.splitlines())


def test_threads_share_two_arenas() -> None:
    assert _arenas("default") > 2  # glibc: an arena a thread, up to 8 a core
    assert _arenas("tuned") == 2


def test_large_blocks_are_mapped_even_after_a_larger_one_was_freed() -> None:
    # glibc's default raised its threshold to the 4 MB block's size when it was freed: the
    # 1 MB blocks came from the heap, where freed pages between live chunks stay resident.
    assert int(_probe(_MAPPED, "default").stdout) == 0
    assert int(_probe(_MAPPED, "tuned").stdout) >= 4 << 20


def test_a_turns_bodies_reuse_the_heap_instead_of_faulting_in_fresh_pages_each_time() -> None:
    # Mapped (a threshold below them) or trimmed off the heap's top each time they are
    # freed, each body faulted its ~73 pages in again: 5x the cost of encoding it.
    assert int(_probe(_REUSED, "tuned").stdout) < 200


def test_what_an_operator_set_in_the_environment_is_left_to_win() -> None:
    done = _probe("print(tune_malloc())", "as set", MALLOC_ARENA_MAX="4")
    assert done.stdout.strip() == "['MALLOC_MMAP_THRESHOLD_', 'MALLOC_TRIM_THRESHOLD_']"


def test_a_worker_built_for_serving_tunes_malloc_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hand_a_worker_its_config(tmp_path, monkeypatch)
    threads_when_tuned: list[int] = []
    monkeypatch.setattr(
        asgi, "tune_malloc", lambda: threads_when_tuned.append(threading.active_count())
    )
    asgi.build()
    # Once, and building the app started no thread after it (those would have arenas of
    # their own).
    assert threads_when_tuned == [threading.active_count()]
