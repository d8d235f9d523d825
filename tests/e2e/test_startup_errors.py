"""A start that every worker would fail is one line and exit 2 before any worker starts,
with several workers too (uvicorn's supervisor of several workers exits 0 when they fail)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from carryover.bench.redis_server import RedisServer


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "carryover", "serve", "--decode", "http://127.0.0.1:9", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_credentials_redis_refuses_stop_two_workers_in_one_line(
    protected_redis: RedisServer, tmp_path: Path
) -> None:
    wrong = tmp_path / "password"
    wrong.write_text("wrong-pw-0000")
    config = tmp_path / "carryover.toml"
    config.write_text(f'[router.redis_options]\npassword_file = "{wrong}"\n')
    done = _serve("--config", str(config), "--redis", protected_redis.url, "--workers", "2")
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "credentials" in lines[0], done.stderr
    assert "wrong-pw" not in done.stderr


def test_a_missing_salt_key_file_stops_the_start(tmp_path: Path) -> None:
    done = _serve("--cache-salt-key-file", str(tmp_path / "nope"))
    assert done.returncode == 2 and "cache_salt_key_file" in done.stderr, done
    assert len(done.stderr.strip().splitlines()) == 1
