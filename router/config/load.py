"""``carryover serve``'s flags and ``CARRYOVER_*`` variables, built from the keys
(``keys.py``), and the one function that turns them and a TOML file into a RouterConfig.

Precedence: defaults < the file (``--config`` or ``CARRYOVER_CONFIG``) < variables < flags.
Secrets (``api_keys``, ``admin_key``) have no flag, argv being readable by every user of the
machine: a variable or a file (``api_keys_file``, ``admin_key_file``)."""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import msgspec

from carryover.router.config.errors import ConfigError
from carryover.router.config.keys import ENV_PREFIX, Key, Kind, Scope, keys
from carryover.router.config.router import RouterConfig
from carryover.state.redis_url import parse_redis_url

__all__ = ["CONFIG_FILE_ENV", "load_config", "serve_parser"]

CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG"


class _SecretFlag(argparse.Action):
    """A secret given as a flag: refused, without repeating it."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: str | None = None) -> None:
        key: Key = self.default
        raise ConfigError(
            f"{option}: secrets are not taken on the command line (any user of the machine "
            f"can read it): use {key.env} or a file ({key.name}_file)"
        )


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line naming it (``ConfigError``), not the whole usage."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


_GROUPS = {
    Scope.ROUTER: "the router ([router] in the file)",
    Scope.MODEL: "the model (each [[models]] in the file; flags set up one)",
    Scope.INSTANCE: "one instance (INSTANCE=VALUE, INSTANCE its URL or name; repeat)",
}


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value) or "none"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def serve_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="carryover serve",
        allow_abbrev=False,
        usage="carryover serve [--config FILE] [--prefill URL ...] --decode URL ... [OPTIONS]",
        description="Run the router in front of vLLM prefill and decode instances. Every "
        "setting is also a CARRYOVER_* variable and a key of the --config file "
        "(docs/configuration.md).",
    )
    p.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"a TOML file; flags override it [{CONFIG_FILE_ENV}]",
    )
    groups = {scope: p.add_argument_group(title) for scope, title in _GROUPS.items()}
    for key in keys():
        if key.flag is None:  # a secret: a flag of its name only says where it goes instead
            name = "--" + key.name.replace("_", "-")
            p.add_argument(
                name,
                action=_SecretFlag,
                dest=f"secret_{key.name}",
                default=key,
                help=argparse.SUPPRESS,
            )
            continue
        if key.hidden:
            text = argparse.SUPPRESS
        else:
            text = f"{key.about} [default {_shown(key.default)}; {key.env}]"
        options: dict[str, Any] = {"dest": key.dest, "default": argparse.SUPPRESS, "help": text}
        if key.kind is Kind.SWITCH:
            options["action"] = argparse.BooleanOptionalAction
        elif key.kind in (Kind.LIST, Kind.INSTANCES):
            options.update(
                action="append", metavar="URL" if key.kind is Kind.INSTANCES else "VALUE"
            )
        elif key.kind is Kind.PER_INSTANCE:
            options.update(action="append", metavar="INSTANCE=VALUE")
        elif key.choices:
            options["choices"] = key.choices
        else:
            options["metavar"] = {Kind.JSON: "JSON", Kind.FILE: "FILE"}.get(
                key.kind, key.type_name.split(" ")[0].upper()
            )
        groups[key.scope].add_argument(key.flag, **options)
    return p


def _convert(key: Key, raw: Any, source: str) -> Any:
    """A flag's or variable's text as the key's value; an error names where it came from."""
    try:
        if key.kind is Kind.SWITCH:
            return raw if isinstance(raw, bool) else msgspec.convert(raw, bool, strict=False)
        if key.kind in (Kind.LIST, Kind.INSTANCES, Kind.PER_INSTANCE):
            items = raw if isinstance(raw, list) else [raw]
            return [part for item in items for part in item.split(",") if part]
        if key.kind is Kind.JSON:
            return msgspec.json.decode(raw)
        return msgspec.convert(raw, key.type, strict=False)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"{source}: {exc} (want {key.type_name})") from exc


def _chosen(args: argparse.Namespace, env: Mapping[str, str]) -> list[tuple[Key, Any]]:
    """The keys set by a variable or a flag (a flag wins), with their values."""
    chosen: list[tuple[Key, Any]] = []
    given = vars(args)
    for key in keys():
        if key.dest in given:
            chosen.append((key, _convert(key, given[key.dest], key.flag or key.env)))
        elif key.env in env:
            chosen.append((key, _convert(key, env[key.env], key.env)))
    return chosen


def _put(table: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        inner = table.get(part)
        table[part] = inner = dict(inner) if isinstance(inner, dict) else {}
        table = inner
    table[path[-1]] = value


def _has(table: Mapping[str, Any], path: tuple[str, ...]) -> bool:
    for part in path:
        if not isinstance(table, Mapping) or part not in table:
            return False
        table = table[part]
    return True


def _assign_per_instance(models: list[dict[str, Any]], key: Key, pairs: list[str]) -> None:
    """``INSTANCE=VALUE`` settings onto the instances whose URL or name is ``INSTANCE``."""
    for pair in pairs:
        target, sep, value = pair.partition("=")
        if not sep or not target or not value:
            raise ConfigError(f"{key.flag} wants INSTANCE=VALUE, not {pair!r}")
        matched = False
        for model in models:
            for instance in (*model.get("prefill", []), *model.get("decode", [])):
                url = str(instance.get("url", "")).rstrip("/")
                names = (url, instance.get("name") or urlsplit(url).netloc)
                if target.rstrip("/") in names:
                    instance[key.path[-1]] = _convert(
                        msgspec.structs.replace(key, kind=Kind.VALUE), value, key.flag or ""
                    )
                    matched = True
        if not matched:
            raise ConfigError(f"{key.flag} {pair!r}: no instance has the URL or name {target!r}")


def _read_file(key: Key, path: str) -> Any:
    """A secret from a file (a mounted secret): a JSON object of keys, or one line."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{key.name} {path}: {exc.strerror}") from exc
    if key.secret_of == "api_keys":
        try:
            found = msgspec.json.decode(data, type=dict[str, str])
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{key.name} {path}: {exc}") from exc
        if not all(found) or not all(found.values()):
            raise ConfigError(f"{key.name} {path}: empty keys or tenants")
        return found
    value = data.decode(errors="replace").strip()
    if not value:
        raise ConfigError(f"{key.name} {path}: empty")
    return value


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc


def load_config(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> RouterConfig:
    """Defaults < config file < ``CARRYOVER_*`` variables < flags."""
    env = os.environ if environ is None else environ
    args = serve_parser().parse_args(list(argv))
    config_path = getattr(args, "config", None) or (
        Path(env[CONFIG_FILE_ENV]) if env.get(CONFIG_FILE_ENV) else None
    )
    raw = _read_toml(config_path) if config_path is not None else {}
    unknown = set(raw) - {"router", "models"}
    if unknown:
        raise ConfigError(f"config file {config_path}: unknown tables {sorted(unknown)}")
    router: dict[str, Any] = dict(raw.get("router", {}))
    models: list[dict[str, Any]] = [dict(m) for m in raw.get("models", [])]
    chosen = _chosen(args, env)

    instances = {k.name: v for k, v in chosen if k.kind is Kind.INSTANCES}
    if instances:
        if len(models) > 1:
            raise ConfigError("--prefill/--decode apply to a single model; the file has several")
        model = models[0] if models else {}
        for role, urls in instances.items():
            model[role] = [{"url": u} for u in urls]
        model.setdefault("prefill", [])
        models = [model]
    for key, value in chosen:
        if key.scope is Scope.ROUTER and key.kind is not Kind.FILE:
            _put(router, key.path, value)
        elif key.scope is Scope.MODEL and key.kind is not Kind.INSTANCES:
            for model in models:
                _put(model, key.path, value)
    paths = {k.path for k, _ in chosen if k.scope is Scope.MODEL}
    if ("render", "url") in paths and ("render", "backend") not in paths:
        for model in models:
            _put(model, ("render", "backend"), "server")
    for key, value in chosen:
        if key.kind is Kind.PER_INSTANCE:
            _assign_per_instance(models, key, value)
    files = {k.name: v for k, v in chosen if k.kind is Kind.FILE}
    for key in keys():
        if key.kind is not Kind.FILE:
            continue
        path = files.get(key.name, router.get(key.name))
        router.pop(key.name, None)
        if path:
            secret = _read_file(key, path)
            assert key.secret_of is not None
            if key.secret_of == "api_keys":
                router["api_keys"] = {**router.get("api_keys", {}), **secret}
            elif not _has(router, (key.secret_of,)):
                router[key.secret_of] = secret
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
