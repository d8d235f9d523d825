"""The conversation store a router is configured with, and the check it passes at startup."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from carryover.router.config import ConfigError, RouterConfig
from carryover.state import MemoryStore, RedisStore, Store, StoreUnavailable
from carryover.state.redis_store import Durability
from carryover.state.resp import ReplyError, RespTlsError, Tls

__all__ = ["PASSWORD_ENV", "check_store", "open_store"]

log = logging.getLogger("carryover.router")

#: The Redis password from the environment, when neither the URL nor a file gives one.
PASSWORD_ENV = "CARRYOVER_REDIS_PASSWORD"

_REFUSED_LOGIN = ("WRONGPASS", "NOAUTH", "NOPERM")


def _password(config: RouterConfig) -> str | None:
    path = config.redis_options.password_file
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the Redis password file {path}: {exc}") from exc
    return os.environ.get(PASSWORD_ENV) or None


def open_store(config: RouterConfig, *, clock: Callable[[], float] = time.time) -> Store:
    """Redis when ``config.redis`` names it, else the in-process store."""
    if not config.redis:
        return MemoryStore(clock=clock)
    options = config.redis_options
    try:
        return RedisStore.from_url(
            config.redis,
            timeout=config.store_timeout,
            tls=Tls(options.ca_file, options.cert_file, options.key_file),
            password=_password(config),
            shards=options.shards,
            durability=Durability(options.durability) if options.durability else None,
            wait_replicas=options.wait_replicas,
            wait_timeout=options.wait_timeout,
        )
    except ValueError as exc:  # a URL or TLS file the store cannot use
        raise ConfigError(str(exc)) from exc


async def check_store(store: Store, config: RouterConfig | None = None) -> None:
    """One ping before serving. Unreachable is served cold (the store may come back); a TLS
    handshake that fails or credentials Redis refuses are configuration errors and stop the
    router. A plain URL whose server has replicas (a managed primary endpoint, a Service in
    front of Sentinel) gets ``replica`` durability unless the configuration says otherwise:
    a failover there could undo a claim as on Sentinel (docs/redis.md)."""
    try:
        await store.ping()
        if (
            isinstance(store, RedisStore)
            and config is not None
            and config.redis_options.durability is None
            and store.durability is Durability.NONE
            and (await store.replicas() or 0) > 0
        ):
            store.wait_for_replicas()
            log.info("the Redis server has replicas: writes wait for one (durability replica)")
    except StoreUnavailable as exc:
        cause = exc.__cause__
        if isinstance(cause, RespTlsError):
            raise ConfigError(f"Redis TLS handshake failed: {cause}") from None
        if isinstance(cause, ReplyError) and str(cause).startswith(_REFUSED_LOGIN):
            raise ConfigError(f"Redis refused the credentials: {cause}") from None
        log.warning("store unavailable at startup, turns are served cold until it answers: %s", exc)
