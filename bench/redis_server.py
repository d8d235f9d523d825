"""A real redis-server on a free loopback port that tests can kill, pause and restart."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from carryover.bench.ports import free_port

#: Redis rewrites its process title over the memory that /proc/PID/environ shows, which hides
#: the environment it was started with; a test run's watchdog finds its processes by a mark
#: in that environment (tests/support/reaper.py). With the title left alone, it finds them.
KEEP_ENVIRONMENT = ("set-proc-title", "no")


class RedisServer:
    """Args:
    workdir: its directory (log, cluster config).
    port: a free one when not given.
    extra: more ``redis-server`` options (``--replicaof``, ``--cluster-enabled``, TLS).
    sentinel: run as a Sentinel: ``extra`` then goes into its config file (Sentinel rewrites
        it), one directive per item.
    """

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *,
        extra: list[str] | None = None,
        sentinel: bool = False,
        plain_port: bool = True,
        auth: tuple[str, str] | None = None,
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.workdir = workdir
        self.port = port or free_port()
        self.extra = extra or []
        self.sentinel = sentinel
        self.plain_port = plain_port  # False: TLS only (the port is tls-port)
        self.auth = auth  # (user, password) the start probe logs in with
        self.paused = False
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        port_option = ["--port", str(self.port)]
        if not self.plain_port:
            port_option = ["--port", "0", "--tls-port", str(self.port)]
        if self.sentinel:
            config = self.workdir / "sentinel.conf"
            if not config.exists():  # a restart keeps what the Sentinel learned
                lines = [
                    f"port {self.port}",
                    "bind 127.0.0.1",
                    f"dir {self.workdir}",
                    " ".join(KEEP_ENVIRONMENT),
                    *self.extra,
                ]
                config.write_text("\n".join(lines) + "\n")
            command = [self.binary, str(config), "--sentinel"]
        else:
            command = [
                self.binary,
                *port_option,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                f"--{KEEP_ENVIRONMENT[0]}",
                KEEP_ENVIRONMENT[1],
                *self.extra,
            ]
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60  # a failure bound: a loaded machine starts it late
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            if not self.plain_port:
                try:  # TLS only: a connect is all a plain probe can check
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                    return
                except OSError:
                    time.sleep(0.02)
                    continue
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    login = f"AUTH {self.auth[0]} {self.auth[1]}\r\n" if self.auth else ""
                    conn.sendall(login.encode() + b"PING\r\n")
                    if conn.recv(64).endswith(b"+PONG\r\n"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(
            f"redis-server did not start on port {self.port}: see {self.workdir / 'redis.log'}"
        )

    @property
    def answering(self) -> bool:
        """Running and not frozen."""
        return self.process is not None and not self.paused

    def cli(self, *args: str) -> str:
        """``redis-cli`` against this server; its output."""
        result = subprocess.run(
            ["redis-cli", "-p", str(self.port), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return result.stdout

    def kill(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None
        self.paused = False

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)
        self.paused = False

    def restart(self) -> None:
        self.kill()
        self.start()
