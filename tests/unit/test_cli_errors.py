"""``carryover serve`` refuses a configuration it cannot run with one line that names the
setting, and a non-zero exit, before anything starts."""

from __future__ import annotations

import subprocess
import sys

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


def test_version_and_help_run_nothing() -> None:
    for args in (["--version"], ["demo", "--help"], ["serve", "--help"]):
        done = subprocess.run(
            [sys.executable, "-m", "carryover", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and done.stdout, done
    assert (
        "0.1"
        in subprocess.run(
            [sys.executable, "-m", "carryover", "--version"], capture_output=True, text=True
        ).stdout
    )
