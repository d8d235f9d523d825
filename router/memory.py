"""What the worker keeps of its startup: freed heap goes back to the operating system, and
what stays is moved out of the garbage collector's sight."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable

__all__ = ["settle_heap", "trim_after_large_requests", "trim_heap"]

#: Seconds between a large request's end and the trim: the request's objects are gone by
#: then, and a burst of large requests costs one trim a second at most.
TRIM_PAUSE = 1.0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def trim_heap() -> None:
    """Give glibc's freed arenas back: loading a tokenizer parses its JSON (11 MB for Qwen3)
    and leaves about 50 MB freed but resident, which a worker at rest would otherwise keep."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


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
