"""``carryover``: serve the router, run a simulated engine, benchmark, or the demo.

This module is the only one that reads argv, the environment and config files.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import tempfile
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import msgspec

from carryover.router.config import CONFIG_ENV, LOG_LEVELS, ConfigError, RouterConfig
from carryover.router.metrics import MULTIPROC_ENV
from carryover.state.redis_url import parse_redis_url

__all__ = ["load_config", "main"]

_ENV_PREFIX = "CARRYOVER_"


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line naming it (``ConfigError``), not the whole usage."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _serve_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="carryover serve", description="Run the router.")
    p.add_argument("--config", type=Path, help="TOML file (flags override it)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--workers", type=int)
    p.add_argument("--prefill", action="append", metavar="URL", help="a prefill instance (repeat)")
    p.add_argument("--decode", action="append", metavar="URL", help="a decode instance (repeat)")
    p.add_argument(
        "--kv-events",
        action="append",
        metavar="INSTANCE=ENDPOINT",
        help="an instance's KV-event endpoint (INSTANCE: its URL or name; repeat)",
    )
    p.add_argument(
        "--kv-events-replay",
        action="append",
        metavar="INSTANCE=ENDPOINT",
        help="an instance's KV-event replay endpoint (repeat)",
    )
    p.add_argument(
        "--warm-tier",
        metavar="NAME",
        help="the engines share a warm KV tier (LMCache) whose blocks their KV events report",
    )
    p.add_argument("--warm-tier-health", metavar="URL", help="the warm tier's health URL")
    p.add_argument("--warm-tier-chunk-tokens", type=int, help="its chunk size (default 256)")
    p.add_argument("--model", help="served model name (default: asked from the engines)")
    p.add_argument(
        "--render-backend",
        choices=("auto", "engine", "server", "local"),
        help="how prompts become ids (default auto: in process once checked against P)",
    )
    p.add_argument("--render", metavar="URL", help="a vLLM render server (backend server)")
    p.add_argument(
        "--render-local", metavar="DIR", nargs="?", const="", help="render in process, unchecked"
    )
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer and chat template files")
    p.add_argument("--render-timeout", type=float, help="one render or derender call (default 5)")
    p.add_argument(
        "--engine-api",
        choices=("openai", "tokens"),
        help="openai (default) or tokens: --tokens-only engines behind a render server (--render)",
    )
    p.add_argument("--reasoning-parser", help="the render server's --reasoning-parser (tokens)")
    p.add_argument("--tool-call-parser", help="the render server's --tool-call-parser (tokens)")
    p.add_argument(
        "--stream-tokens", type=int, help="tokens: derender a stream this many tokens at a time"
    )
    p.add_argument(
        "--stream-interval", type=float, help="tokens: and at least every this many seconds"
    )
    p.add_argument(
        "--no-capture-streamed-handles",
        action="store_true",
        help="tokens: leave streamed turns without a handle (no one-token capture on D)",
    )
    p.add_argument("--redis", metavar="URL", help="shared state (default: in-process)")
    p.add_argument(
        "--redis-durability",
        choices=("none", "replica"),
        help="when a Redis write counts as done: at the primary (none) or once a replica "
        "acknowledged it (replica); default: replica on Sentinel, Cluster and on a server "
        "that reports replicas, none otherwise (docs/redis.md)",
    )
    p.add_argument("--block-size", type=int)
    p.add_argument("--decoder-kv-blocks-ttl", type=float)
    p.add_argument("--queue-margin", type=float)
    p.add_argument("--kv-recompute-threshold", type=int)
    p.add_argument(
        "--decode-local-max-tokens",
        type=int,
        help="run a turn on D alone when D holds all but at most this many prompt tokens",
    )
    p.add_argument(
        "--affinity-slack",
        type=int,
        help="requests busier than the least loaded a KV holder may be (default 4)",
    )
    p.add_argument(
        "--affinity-tokens-per-load",
        type=int,
        help="prompt tokens a KV holder must save per request of extra load (default 256)",
    )
    p.add_argument("--no-partial-reuse", action="store_true")
    p.add_argument("--no-reuse", action="store_true", help="plain P/D, no conversation state")
    p.add_argument(
        "--when-prefill-down",
        choices=["decode-alone", "fail"],
        help="no prefill can serve: D computes alone (default) or 503 at once",
    )
    p.add_argument("--planner", help=argparse.SUPPRESS)  # module:function (measurement only)
    p.add_argument("--expose-path-header", action="store_true")
    p.add_argument(
        "--conversation-header",
        action="append",
        metavar="NAME",
        help="a header carrying the conversation id (repeat; default X-Conversation-ID, "
        "X-Session-ID)",
    )
    p.add_argument("--prefill-timeout", type=float)
    p.add_argument("--first-byte-timeout", type=float)
    p.add_argument("--store-timeout", type=float)
    p.add_argument("--health-timeout", type=float, help="one health or metrics probe (default 1 s)")
    p.add_argument("--connect-timeout", type=float, help="TCP connect to an engine (default 2 s)")
    p.add_argument("--health-interval", type=float)
    p.add_argument("--held-interval", type=float, help="reads of handles held per decode (10 s)")
    p.add_argument(
        "--decode-kv-high-water",
        type=float,
        help="KV cache use of a decode instance (0-1) at which its oldest handles are given "
        "back; above 1 never",
    )
    p.add_argument("--decode-kv-low-water", type=float, help="what giving back aims for (0-1)")
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--max-messages", type=int)
    p.add_argument(
        "--admin-key", help="bearer key for /admin/* (prefer --admin-key-file: argv is public)"
    )
    p.add_argument("--admin-key-file", metavar="FILE", help="a file holding the admin key")
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a non-loopback --host without API keys (everyone is tenant 'default')",
    )
    p.add_argument(
        "--shared-cache",
        action="store_true",
        help="tenants share the engines' prefix caches (off: a cache salt per tenant)",
    )
    p.add_argument("--cache-salt-key-file", metavar="FILE", help="the key of the tenants' salts")
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, help="default info")
    return p


def _env_list(value: str | None) -> list[str] | None:
    return [v for v in value.split(",") if v] if value else None


def _assign_per_instance(models: list[dict[str, Any]], field_name: str, pairs: list[str]) -> None:
    """``INSTANCE=VALUE`` settings onto the instances whose URL or name is ``INSTANCE``."""
    for pair in pairs:
        target, sep, value = pair.partition("=")
        if not sep or not target or not value:
            raise ConfigError(
                f"--{field_name.replace('_', '-')} wants INSTANCE=ENDPOINT, not {pair!r}"
            )
        matched = False
        for model in models:
            for instance in (*model.get("prefill", []), *model.get("decode", [])):
                url = str(instance.get("url", "")).rstrip("/")
                names = (url, instance.get("name") or urlsplit(url).netloc)
                if target.rstrip("/") in names:
                    instance[field_name] = value
                    matched = True
        if not matched:
            raise ConfigError(f"{pair!r}: no configured instance has the URL or name {target!r}")


def _read_api_keys(path: Path) -> dict[str, str]:
    """``{"bearer key": "tenant", …}`` from a file (a mounted secret), so that keys need not
    sit in the config file or a ConfigMap."""
    try:
        keys = msgspec.json.decode(path.read_bytes(), type=dict[str, str])
    except (OSError, msgspec.DecodeError) as exc:
        raise ConfigError(f"api_keys_file {path}: {exc}") from exc
    if not all(keys) or not all(keys.values()):
        raise ConfigError(f"api_keys_file {path}: empty keys or tenants")
    return keys


def _read_secret(path: Path, setting: str) -> str:
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{setting} {path}: {exc.strerror}") from exc
    if not value:
        raise ConfigError(f"{setting} {path}: empty")
    return value


def load_config(argv: Sequence[str], environ: dict[str, str] | None = None) -> RouterConfig:
    """Defaults < config file < ``CARRYOVER_*`` environment < flags."""
    env = dict(os.environ if environ is None else environ)
    args = _serve_parser().parse_args(list(argv))
    config_path = args.config or (
        Path(env[_ENV_PREFIX + "CONFIG"]) if env.get(_ENV_PREFIX + "CONFIG") else None
    )
    raw: dict[str, Any] = {}
    if config_path is not None:
        try:
            raw = tomllib.loads(config_path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read {config_path}: {exc}") from exc
    router: dict[str, Any] = dict(raw.get("router", {}))
    models: list[dict[str, Any]] = [dict(m) for m in raw.get("models", [])]

    def pick(flag: Any, env_name: str, convert: Any = str) -> Any:
        if flag is not None:
            return flag
        value = env.get(_ENV_PREFIX + env_name)
        return convert(value) if value is not None else None

    for key, flag, env_name, convert in (
        ("host", args.host, "HOST", str),
        ("port", args.port, "PORT", int),
        ("workers", args.workers, "WORKERS", int),
        ("redis", args.redis, "REDIS", str),
        ("store_timeout", args.store_timeout, "STORE_TIMEOUT", float),
        ("health_interval", args.health_interval, "HEALTH_INTERVAL", float),
        ("held_interval", args.held_interval, "HELD_INTERVAL", float),
        ("decode_kv_high_water", args.decode_kv_high_water, "DECODE_KV_HIGH_WATER", float),
        ("decode_kv_low_water", args.decode_kv_low_water, "DECODE_KV_LOW_WATER", float),
        ("max_body_bytes", args.max_body_bytes, "MAX_BODY_BYTES", int),
        ("max_messages", args.max_messages, "MAX_MESSAGES", int),
        ("affinity_slack", args.affinity_slack, "AFFINITY_SLACK", int),
        (
            "affinity_tokens_per_load",
            args.affinity_tokens_per_load,
            "AFFINITY_TOKENS_PER_LOAD",
            int,
        ),
        ("admin_key", args.admin_key, "ADMIN_KEY", str),
        ("log_level", args.log_level, "LOG_LEVEL", str),
    ):
        value = pick(flag, env_name, convert)
        if value is not None:
            router[key] = value
    admin_file = pick(args.admin_key_file, "ADMIN_KEY_FILE") or router.pop("admin_key_file", None)
    router.pop("admin_key_file", None)
    if admin_file and "admin_key" not in router:
        router["admin_key"] = _read_secret(Path(admin_file), "admin_key_file")
    salt_file = pick(args.cache_salt_key_file, "CACHE_SALT_KEY_FILE")
    if salt_file:
        router["cache_salt_key_file"] = salt_file
    for key, flag, env_name in (
        ("allow_unauthenticated", args.allow_unauthenticated, "ALLOW_UNAUTHENTICATED"),
        ("shared_cache", args.shared_cache, "SHARED_CACHE"),
    ):
        if flag or env.get(_ENV_PREFIX + env_name) == "1":
            router[key] = True
    keys_file = pick(None, "API_KEYS_FILE") or router.pop("api_keys_file", None)
    router.pop("api_keys_file", None)
    if keys_file:
        router["api_keys"] = {**router.get("api_keys", {}), **_read_api_keys(Path(keys_file))}
    if args.expose_path_header or env.get(_ENV_PREFIX + "EXPOSE_PATH_HEADER") == "1":
        router["expose_path_header"] = True
    headers = args.conversation_header or _env_list(env.get(_ENV_PREFIX + "CONVERSATION_HEADERS"))
    if headers:
        router["conversation_headers"] = headers
    if args.planner:
        router["planner"] = args.planner
    durability = pick(args.redis_durability, "REDIS_DURABILITY")
    if durability is not None:
        router["redis_options"] = {**router.get("redis_options", {}), "durability": durability}
    timeouts = dict(router.get("timeouts", {}))
    for key, value in (
        ("prefill", args.prefill_timeout),
        ("first_byte", args.first_byte_timeout),
        ("health", args.health_timeout),
        ("connect", args.connect_timeout),
    ):
        if value is not None:
            timeouts[key] = value
    router["timeouts"] = timeouts

    prefill = args.prefill or _env_list(env.get(_ENV_PREFIX + "PREFILL"))
    decode = args.decode or _env_list(env.get(_ENV_PREFIX + "DECODE"))
    if prefill is not None or decode is not None:
        if len(models) > 1:
            raise ConfigError("--prefill/--decode apply to a single model; the file has several")
        model = models[0] if models else {}
        if prefill is not None:
            model["prefill"] = [{"url": u} for u in prefill]
        if decode is not None:
            model["decode"] = [{"url": u} for u in decode]
        model.setdefault("prefill", [])
        models = [model]
    for model in models:
        overrides = {
            "name": pick(args.model, "MODEL"),
            "block_size": pick(args.block_size, "BLOCK_SIZE", int),
            "decoder_kv_blocks_ttl": pick(
                args.decoder_kv_blocks_ttl, "DECODER_KV_BLOCKS_TTL", float
            ),
            "queue_margin": pick(args.queue_margin, "QUEUE_MARGIN", float),
            "kv_recompute_threshold": pick(
                args.kv_recompute_threshold, "KV_RECOMPUTE_THRESHOLD", int
            ),
            "when_prefill_down": pick(args.when_prefill_down, "WHEN_PREFILL_DOWN"),
            "decode_local_max_tokens": pick(
                args.decode_local_max_tokens, "DECODE_LOCAL_MAX_TOKENS", int
            ),
            "engine_api": pick(args.engine_api, "ENGINE_API"),
        }
        model.update({k: v for k, v in overrides.items() if v is not None})
        tokens = dict(model.get("tokens", {}))
        for key, value in (
            ("reasoning_parser", pick(args.reasoning_parser, "REASONING_PARSER")),
            ("tool_call_parser", pick(args.tool_call_parser, "TOOL_CALL_PARSER")),
            ("stream_tokens", pick(args.stream_tokens, "STREAM_TOKENS", int)),
            ("stream_interval", pick(args.stream_interval, "STREAM_INTERVAL", float)),
            ("capture_streamed_handles", False if args.no_capture_streamed_handles else None),
        ):
            if value is not None:
                tokens[key] = value
        if tokens:
            model["tokens"] = tokens
        render = dict(model.get("render", {}))
        render_url = pick(args.render, "RENDER")
        backend = pick(args.render_backend, "RENDER_BACKEND")
        tokenizer = pick(args.tokenizer, "TOKENIZER")
        if render_url is not None:
            render.update(backend="server", url=render_url)
        elif args.render_local is not None:
            render.update(backend="local", path=args.render_local or None)
        if backend is not None:
            render["backend"] = backend
        if tokenizer is not None:
            render["path"] = tokenizer
        render_timeout = pick(args.render_timeout, "RENDER_TIMEOUT", float)
        if render_timeout is not None:
            render["timeout"] = render_timeout
        if render:
            model["render"] = render
        if args.no_partial_reuse:
            model["partial_reuse"] = False
        if args.no_reuse:
            model["reuse"] = False
        warm_settings = {
            "name": pick(args.warm_tier, "WARM_TIER"),
            "health": pick(args.warm_tier_health, "WARM_TIER_HEALTH"),
            "chunk_tokens": pick(args.warm_tier_chunk_tokens, "WARM_TIER_CHUNK_TOKENS", int),
        }
        if any(v is not None for v in warm_settings.values()):
            warm = dict(model.get("warm_tier") or {})
            warm.update({k: v for k, v in warm_settings.items() if v is not None})
            model["warm_tier"] = warm
    for field_name, flag, env_name in (
        ("kv_events", args.kv_events, "KV_EVENTS"),
        ("kv_events_replay", args.kv_events_replay, "KV_EVENTS_REPLAY"),
    ):
        pairs = flag or _env_list(env.get(_ENV_PREFIX + env_name))
        if pairs:
            _assign_per_instance(models, field_name, pairs)
    router["models"] = models
    try:
        config = msgspec.convert(router, RouterConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from exc
    if config.redis is not None:
        try:
            parse_redis_url(config.redis)
        except ValueError as exc:
            raise ConfigError(f"redis: {exc}") from exc
    return config


def _serve(argv: Sequence[str]) -> None:
    # uvicorn (httptools, uvloop) rather than granian: one thread per worker, no handoff
    # between a server thread and the event loop; a turn costs 15-40% less CPU at concurrency 1
    # (bench/RESULTS.md, "Router overhead"). With several workers this process only
    # supervises: each worker is spawned and builds the app itself (router.http.asgi).
    import uvicorn

    config = load_config(argv)
    _preflight(config)
    for name in _SECRET_ENV:  # read: the workers must not inherit them
        os.environ.pop(_ENV_PREFIX + name, None)
    with _private_config(config), _worker_metrics(config.workers or 1):
        _run_uvicorn(uvicorn, config)


def _preflight(config: RouterConfig) -> None:
    """What would stop every worker as it starts, checked once here first: a failure is one
    line and exit 2 however many workers there are (uvicorn's supervisor of several workers
    exits 0 when they fail). An unreachable store is not one: turns are served cold."""
    from carryover.router.store import check_store, open_store
    from carryover.router.tenants.salt import salts_of

    salts_of(config)
    if config.redis is None:
        return

    async def check() -> None:
        store = open_store(config)
        try:
            await check_store(store, config)
        finally:
            await store.close()

    asyncio.run(check())


#: Variables that may hold a key or a password (files are the recommended way).
_SECRET_ENV = ("ADMIN_KEY", "REDIS")


@contextlib.contextmanager
def _private_config(config: RouterConfig) -> Iterator[None]:
    """The config for the workers, in a file only this user can read, removed at exit."""
    with tempfile.TemporaryDirectory(prefix="carryover-serve-") as folder:  # mode 0700
        path = Path(folder) / "config.json"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(msgspec.json.encode(config))
        os.environ[CONFIG_ENV] = str(path)
        try:
            yield
        finally:
            del os.environ[CONFIG_ENV]


@contextlib.contextmanager
def _worker_metrics(workers: int) -> Iterator[None]:
    """Several workers share one view of the metrics (router/metrics.py): their samples go to
    files in ``PROMETHEUS_MULTIPROC_DIR``, the operator's folder if set (emptied now: samples
    of an earlier run would add up with these), else a temporary one removed at exit."""
    if workers <= 1:
        yield
        return
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        folder = Path(given)
        if not folder.is_dir():
            raise ConfigError(f"{MULTIPROC_ENV}={given} is not a directory")
        for stale in folder.glob("*.db"):
            stale.unlink()
        yield
        return
    with tempfile.TemporaryDirectory(prefix="carryover-metrics-") as made:
        os.environ[MULTIPROC_ENV] = made
        try:
            yield
        finally:
            del os.environ[MULTIPROC_ENV]


def _run_uvicorn(uvicorn: Any, config: RouterConfig) -> None:
    uvicorn.run(
        "carryover.router.http.asgi:build",
        factory=True,
        host=config.host,
        port=config.port,
        workers=config.workers,
        loop="uvloop",
        http="httptools",
        ws="none",
        lifespan="on",
        log_config=None,  # router.logs configures logging in each worker
        log_level=config.log_level,
        access_log=False,
        proxy_headers=False,  # clients' addresses are not read
        server_header=False,
        timeout_graceful_shutdown=math.ceil(config.shutdown_grace),
        timeout_keep_alive=math.ceil(config.timeouts.client_keepalive),
    )


_USAGE = """usage: carryover serve [ARGS]

  serve   run the router in front of vLLM prefill/decode instances
"""


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return
    command, rest = args[0], args[1:]
    try:
        if command == "serve":
            _serve(rest)
        else:
            print(_USAGE, file=sys.stderr)
            raise SystemExit(2)
    except ConfigError as exc:
        print(f"carryover: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
