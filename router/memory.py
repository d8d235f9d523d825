"""How the worker's heap stays small: its threads share few malloc arenas, freed heap goes
back to the operating system, and what startup keeps is moved out of the garbage
collector's sight."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import os

__all__ = [
    "MALLOC_SETTINGS",
    "settle_heap",
    "trim_after_large_requests",
    "trim_heap",
    "tune_malloc",
]

#: glibc malloc settings a served worker makes at its start, each as ``mallopt`` parameter and
#: value under the environment variable that would set it (one set in the environment wins:
#: glibc read it at startup). With glibc's defaults the churn soak's router kept what large
#: requests left behind: its lowest RSS rose 9-15% in five minutes, peaking at 244 MB; with
#: these, 1.6%, peaking at 186 MB (bench/RESULTS.md, "Churn soak").
#:
#: - Arenas: glibc gives each new thread an arena of its own, up to 8 a core, and each pool
#:   thread that rendered a large request kept its grown arena.
#: - The mmap threshold: glibc raises it to the size of each mapped block freed, up to 32 MB,
#:   so after one 4 MB body the next ones come from the heap, where what they free between
#:   live chunks stays resident. Fixed at 1 MiB, a large request's buffers are mapped and
#:   unmapped, while a turn's bodies (a 20k-token prompt's JSON is 100-400 kB) come from the
#:   heap: mapped, each faulted its pages in again, and encoding a body cost 5x as much.
#: - The trim threshold: fixing the mmap threshold also fixes it, at 128 kB, and a body freed
#:   at the heap's top was given back and faulted in again on the next. At 8 MiB the top
#:   keeps that much; ``trim_after_large_requests`` gives it back after a large request.
MALLOC_SETTINGS: dict[str, tuple[int, int]] = {
    "MALLOC_ARENA_MAX": (-8, 2),  # M_ARENA_MAX
    "MALLOC_MMAP_THRESHOLD_": (-3, 1 << 20),  # M_MMAP_THRESHOLD
    "MALLOC_TRIM_THRESHOLD_": (-1, 8 << 20),  # M_TRIM_THRESHOLD
}

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


def tune_malloc() -> list[str]:
    """Make :data:`MALLOC_SETTINGS` before the worker starts a thread; returns the names of
    those made (none on another libc, nor where the environment set them)."""
    libc = _glibc()
    if libc is None:
        return []
    return [
        name
        for name, (parameter, value) in MALLOC_SETTINGS.items()
        if name not in os.environ and libc.mallopt(parameter, value)
    ]


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
    Alone it lowered the churn soak's lowest RSS but did not stop its rise; with
    :data:`MALLOC_SETTINGS` the rise stopped (bench/RESULTS.md, "Churn soak"). ctypes
    releases the GIL while ``malloc_trim`` runs."""
    while True:
        await ended.wait()
        ended.clear()
        await asyncio.sleep(pause)
        await asyncio.to_thread(trim_heap)
