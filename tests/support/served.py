"""The serialized config a served worker reads at its start (router/http/asgi.py ``build``)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from carryover.router.config import CONFIG_ENV
from carryover.router.config.load import load_config


def hand_a_worker_its_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Write a config as ``carryover serve`` does and point the worker's variable at it."""
    config = load_config(
        ["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10"], environ={}
    )
    path = tmp_path / "config.json"
    path.write_bytes(msgspec.json.encode(config))
    monkeypatch.setenv(CONFIG_ENV, str(path))
