"""``carryover serve`` refuses a configuration it cannot run with one line that names the
setting, and a non-zero exit, before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--decode", "notaurl"], "notaurl"),
        (["--prefill", "https://p.example:443", "--decode", "http://d:1"], "https://"),
        (["--decode", "http://d:1", "--redis", "localhost:6379"], "redis"),
        (["--decode", "http://d:1", "--log-level", "verbose"], "--log-level"),
        (["--decode", "http://d:1", "--host", "0.0.0.0"], "allow_unauthenticated"),
        (["--decode", "http://d:1", "--workers", "2"], "workers"),
        (["--decode", "http://d:1", "--no-such-flag"], "--no-such-flag"),
        # A secret on the command line (readable by every user of the machine) is refused.
        (["--decode", "http://d:1", "--admin-key", "sk-x"], "--admin-key"),
        (["--decode", "notaurl", "--workers", "2", "--redis", "redis://127.0.0.1:9/0"], "notaurl"),
        (["--decode", "http://d:1", "--request-timeout", "soon"], "--request-timeout"),
        (["--decode", "http://d:1", "--decode-kv-low-water", "0.95"], "decode_kv_low_water"),
        (["--decode", "http://d:1", "--config", "/nonexistent.toml"], "/nonexistent.toml"),
    ],
)
def test_a_configuration_that_cannot_run_is_one_line_and_exit_2(
    args: list[str], names: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "carryover", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], done.stderr
    assert lines[0].startswith("carryover: configuration error: ")


def test_version_and_help_run_nothing(tmp_path: Path) -> None:
    for args in (["--version"], ["demo", "--help"], ["serve", "--help"], ["report", "--help"]):
        done = subprocess.run(
            [sys.executable, "-m", "carryover", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert done.returncode == 0 and done.stdout, done
    assert not list(tmp_path.iterdir()), "--help wrote something"
    assert (
        "0.1"
        in subprocess.run(
            [sys.executable, "-m", "carryover", "--version"], capture_output=True, text=True
        ).stdout
    )
