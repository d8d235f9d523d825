"""The app factory uvicorn calls in each worker: the config arrives serialized in a private
file written by ``carryover serve`` (``carryover.router.cli``), so every worker builds the same app."""

from __future__ import annotations

import os

import msgspec
from litestar import Litestar

from carryover.router.config import CONFIG_ENV, RouterConfig
from carryover.router.http.app import create_app
from carryover.router.logs import configure_logging
from carryover.router.memory import settle_heap, tune_malloc

__all__ = ["CONFIG_ENV", "build"]


def build() -> Litestar:
    tune_malloc()  # before the worker's first thread
    with open(os.environ[CONFIG_ENV], "rb") as file:
        config = msgspec.json.decode(file.read(), type=RouterConfig)
    configure_logging(config.log_level)
    app = create_app(config)
    app.on_startup.append(settle_heap)  # after the lifespan has built everything
    return app
