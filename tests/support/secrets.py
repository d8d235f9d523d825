"""Keys and passwords the suite's routers are given, and the scans that prove none leaks: into
a router process's environment (``/proc/<pid>/environ``), its log, or an error body a client
got. A test registers what it hands a router; ``RouterProcess`` and the stack's client scan."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

__all__ = [
    "REDIS_PASSWORD",
    "admin_key_flags",
    "assert_absent",
    "group_environ",
    "register",
    "scan_error_body",
]

#: The password of the ``protected_redis`` fixture's server (tests/conftest.py).
REDIS_PASSWORD = "redis-pw-91b7e3a0c2"

_KNOWN: set[str] = {REDIS_PASSWORD}


def admin_key_flags(folder: Path, key: str) -> tuple[str, str]:
    """The admin key as a router takes it, from a file: no flag carries a secret."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "admin-key"
    path.write_text(key + "\n")
    return ("--admin-key-file", str(path))


def register(*secrets: str) -> None:
    _KNOWN.update(s for s in secrets if s)


def assert_absent(text: str, where: str) -> None:
    found = sorted(s for s in _KNOWN if s in text)
    assert not found, f"{where} holds a secret: {found}"


def group_environ(pgid: int) -> dict[int, str]:
    """The environment of every live process of a process group, by pid."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            found[int(entry.name)] = (entry / "environ").read_bytes().decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
    return found


async def scan_error_body(response: httpx.Response) -> None:
    """An httpx response hook: an error answer's body holds no secret."""
    if response.status_code >= 400:
        await response.aread()
        assert_absent(response.text, f"the {response.status_code} body of {response.url}")
