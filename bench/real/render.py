"""Start vLLM's GPU-less render server (``vllm launch render``) for the tiny model, from its
own entry module (``bench/real/process.py`` says why not the ``vllm`` command)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from carryover.bench.ports import free_port
from carryover.bench.real.launch import SERVED_NAME, ensure_model
from carryover.bench.real.process import offline_env, spawn, stop_group, vllm_module, wait_healthy

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
            *vllm_module("vllm.entrypoints.launchers.render.entry"),
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
        self.popen = spawn(args, self.log, offline_env())
        try:
            wait_healthy(
                self.popen,
                self.url,
                self.log,
                deadline=time.monotonic() + timeout,
                what="the render server",
            )
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.popen is not None:
            stop_group(self.popen)
            self.popen = None
