"""What the worker keeps of its startup: freed heap goes back to the operating system, and
what stays is moved out of the garbage collector's sight."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import os

__all__ = ["ARENAS", "limit_arenas", "settle_heap", "trim_after_large_requests", "trim_heap"]

#: glibc malloc arenas a worker's threads share. glibc gives each new thread an arena of its
#: own, up to 8 a core; large requests rendered in the thread pool grow each one, and what
#: they free between live chunks stays resident, arena by arena. In the churn soak the
#: router's lowest RSS rose 15% in five minutes with glibc's default and 0.4% with 2, at the
#: same CPU a turn (bench/RESULTS.md, "Churn soak"). ``MALLOC_ARENA_MAX`` set in the
#: environment is left to win.
ARENAS = 2
_M_ARENA_MAX = -8  # <malloc.h>

#: Seconds between a large request's end and the trim: the request's objects are gone by
#: then, and a burst of large requests costs one trim a second at most.
TRIM_PAUSE = 1.0


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    # musl and the BSDs have neither call.
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def limit_arenas(count: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``count`` for the threads started from now on; call it
    before the worker starts any. Says whether the cap was set (not on another libc, nor
    where ``MALLOC_ARENA_MAX`` is in the environment: glibc read that at startup)."""
    libc = _glibc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, count))


def trim_heap() -> None:
    """Give glibc's freed arenas back: loading a tokenizer parses its JSON (11 MB for Qwen3)
    and leaves about 50 MB freed but resident, which a worker at rest would otherwise keep."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def settle_heap() -> None:
    """Once the worker is up: collect startup's garbage, freeze what is left (the app, the
    tokenizers' tables, the modules) so that no later collection walks it again, and trim.

    A full collection walks every tracked object; startup leaves about 100k of them, which
    never become garbage. vLLM's API server freezes its startup heap the same way
    (``vllm/entrypoints/launchers/utils/server_utils.py``, ``freeze_gc_heap``). Only the served
    process does this: objects frozen and later dropped are never collected, which in a test
    process that builds many apps would be a leak."""
    gc.collect()
    gc.freeze()
    trim_heap()


async def trim_after_large_requests(ended: asyncio.Event, pause: float = TRIM_PAUSE) -> None:
    """Forever: after a large request has ended (``ended`` set), trim the heap in a thread.

    A large body's copies (its bytes, its decoded strings, the rendered prompt) are freed
    into glibc's arenas, where free pages between live chunks stay resident until trimmed.
    In the churn soak it lowered the router's lowest RSS but did not stop its rise
    (bench/RESULTS.md, "Churn soak"). ctypes releases the GIL while ``malloc_trim`` runs."""
    while True:
        await ended.wait()
        ended.clear()
        await asyncio.sleep(pause)
        await asyncio.to_thread(trim_heap)
