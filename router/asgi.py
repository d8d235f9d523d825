"""The app factory uvicorn calls in each worker: the config arrives serialized in the
environment, written by ``carryover serve`` (``router.cli``), so every worker builds the same app."""

from __future__ import annotations

import os

import msgspec
from litestar import Litestar

from router.app import create_app
from router.config import CONFIG_ENV, RouterConfig
from router.logs import configure_logging

__all__ = ["CONFIG_ENV", "build"]


def build() -> Litestar:
    config = msgspec.json.decode(os.environ[CONFIG_ENV], type=RouterConfig)
    configure_logging(config.log_level)
    return create_app(config)
