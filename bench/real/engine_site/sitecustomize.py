"""Run at the start of every Python process of the real tier's vLLM engines (their
``PYTHONPATH`` names this folder): NIXL's UCX progress thread waits for work with a timeout
instead of polling without one.

NIXL's Python agent starts its UCX backend's progress thread with a delay of 0
(``nixl_cu12/_api.py`` in NIXL 1.5: ``agent_config.pthrDelay = 0``), and the thread then calls
``epoll_wait`` in a loop that never blocks: a core per engine for as long as it runs, mostly
in the kernel. On a GPU host that is one core of many; here the tier's two engines, the router
and the tests share two. The thread is woken by UCX's event descriptors when a transfer has
work, so the delay bounds only an idle wait: transfers, handshakes and notifications take the
same path. Measured on this machine (docs/test-suite.md): a pair starts and warms up in 41 s
instead of 62 s, a router beside it starts in 2-3 s instead of 11 s."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

#: NIXL's Python API module, in each of its builds (CUDA 12, CUDA 13, ROCm).
_API = re.compile(r"nixl_(cu\d+|rocm)\._api")
#: The progress thread's longest idle wait (NIXL's unit: microseconds).
IDLE_WAIT = 1000


def _wait_when_idle(api: ModuleType) -> None:
    bindings = api.nixlBind
    make_agent = bindings.nixlAgent

    def agent(name: str, config: Any) -> Any:
        config.pthrDelay = IDLE_WAIT
        return make_agent(name, config)

    bindings.nixlAgent = agent


class _NixlApiFinder(importlib.abc.MetaPathFinder):
    """Finds NIXL's API module as the path finder does, and changes it once it has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not _API.fullmatch(fullname):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.abc.Loader):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _wait_when_idle(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _NixlApiFinder())
