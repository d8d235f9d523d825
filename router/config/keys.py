"""Every configuration key, derived from the config Structs: its place in the file, type,
default, meaning, flag and ``CARRYOVER_*`` variable. Flags, variables and the reference
(docs/configuration.md) are all read from here, so a key is declared once, in its Struct.

Names follow one rule: a key's flag is ``--`` and its name with dashes, inside a table the
table's pattern (``timeouts.request`` is ``--request-timeout``, ``render.backend``
``--render-backend``); its variable is ``CARRYOVER_`` and the flag in capitals. A key's
``about(flag=…, env=…)`` overrides the rule where an older or shorter name reads better."""

from __future__ import annotations

from enum import StrEnum
from functools import cache
from typing import Any

import msgspec
import msgspec.inspect as mi

from carryover.router.config.engines import InstanceConfig, ModelConfig
from carryover.router.config.router import RouterConfig

__all__ = ["ENV_PREFIX", "Key", "Kind", "Scope", "keys"]

ENV_PREFIX = "CARRYOVER_"


class Kind(StrEnum):
    """How a key's value is written on the command line and in a variable."""

    VALUE = "value"  # one value
    SWITCH = "switch"  # --x / --no-x; a variable of true/false/1/0
    LIST = "list"  # the flag repeated; a variable of comma-separated values
    JSON = "json"  # a JSON object
    INSTANCES = "instances"  # URLs, repeated or comma-separated
    PER_INSTANCE = "per-instance"  # INSTANCE=VALUE pairs (INSTANCE: its URL or name)
    FILE = "file"  # a file holding a secret key's value


class Scope(StrEnum):
    """Where a key lives in the file: ``[router]``, each ``[[models]]``, each instance."""

    ROUTER = "router"
    MODEL = "model"
    INSTANCE = "instance"


class Key(msgspec.Struct, frozen=True):
    scope: Scope
    path: tuple[str, ...]  # within its scope's table: ("timeouts", "request")
    type: Any  # the Python type its value converts to
    type_name: str
    default: Any
    about: str
    kind: Kind
    flag: str | None  # None: secret, set by a variable or its file only
    env: str
    choices: tuple[Any, ...] | None = None
    hidden: bool = False
    secret_of: str | None = None  # a FILE key: the secret key it holds

    @property
    def name(self) -> str:
        return ".".join(self.path)

    @property
    def dest(self) -> str:
        return "_".join((self.scope, *self.path))


def _unwrap(t: Any) -> tuple[Any, dict[str, Any], str]:
    extra: dict[str, Any] = {}
    description = ""
    if isinstance(t, mi.Metadata):
        extra = dict(t.extra or {})
        description = (t.extra_json_schema or {}).get("description", "")
        t = t.type
    return t, extra, description


def _optional(t: Any) -> Any:
    if isinstance(t, mi.UnionType):
        rest = [u for u in t.types if not isinstance(u, mi.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return t


_NAMES = {mi.IntType: "int", mi.FloatType: "float", mi.StrType: "string", mi.BoolType: "bool"}


def _describe(t: Any) -> str:
    inner = _optional(t)
    optional = inner is not t
    if isinstance(inner, mi.LiteralType):
        name = " | ".join(str(v) for v in inner.values)
    elif isinstance(inner, mi.ListType | mi.VarTupleType):
        name = f"list of {_describe(inner.item_type)}"
    elif isinstance(inner, mi.DictType):
        name = f"table of {_describe(inner.value_type)}"
    elif isinstance(inner, mi.StructType):
        name = inner.cls.__name__
    else:
        name = _NAMES.get(type(inner), "value")  # type: ignore[call-overload]
    return f"{name} (optional)" if optional else name


def _default(field: mi.Field) -> Any:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    if field.default_factory is not msgspec.NODEFAULT:
        return field.default_factory()
    return None


def _flag(pattern: str, name: str) -> str:
    return "--" + pattern.format(name).replace("_", "-")


def _walk(
    cls: type[msgspec.Struct], scope: Scope, prefix: tuple[str, ...], pattern: str
) -> list[Key]:
    found: list[Key] = []
    hints = msgspec.structs.fields(cls)
    python_types = {f.name: f.type for f in hints}
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    for field in info.fields:
        t, extra, description = _unwrap(field.type)
        inner = _optional(t)
        if cls is RouterConfig and field.name == "models":
            found += _walk(ModelConfig, Scope.MODEL, (), "{}")
            continue
        if isinstance(inner, mi.StructType):  # a table: its keys, named by its pattern
            found += _walk(inner.cls, scope, (*prefix, field.name), pattern.format(extra["flags"]))
            continue
        path = (*prefix, field.name)
        flag = extra.get("flag") or _flag(pattern, field.name)
        if isinstance(inner, mi.ListType) and isinstance(inner.item_type, mi.StructType):
            kind = Kind.INSTANCES
        elif isinstance(inner, mi.BoolType):
            kind = Kind.SWITCH
        elif isinstance(inner, mi.ListType | mi.VarTupleType):
            kind = Kind.LIST
        elif isinstance(inner, mi.DictType):
            kind = Kind.JSON
        else:
            kind = Kind.VALUE
        env = extra.get("env") or ENV_PREFIX + flag[2:].upper().replace("-", "_")
        common = {
            "scope": scope,
            "type": python_types[field.name],
            "default": _default(field),
            "about": description,
            "hidden": bool(extra.get("hidden")),
        }
        if extra.get("secret"):  # no flag: a variable, or a file named by its own key
            found.append(
                Key(
                    path=path,
                    type_name=_describe(t),
                    kind=kind,
                    flag=None,
                    env=ENV_PREFIX + field.name.upper(),
                    **common,
                )
            )
            found.append(_file_key(scope, prefix, pattern, extra["file"], field.name))
            continue
        choices = tuple(inner.values) if isinstance(inner, mi.LiteralType) else None
        found.append(
            Key(
                path=path,
                type_name=_describe(t),
                kind=kind,
                flag=flag,
                env=env,
                choices=choices,
                **common,
            )
        )
        if kind is Kind.INSTANCES and field.name == "prefill":
            found += _instance_keys()
    return found


def _file_key(scope: Scope, prefix: tuple[str, ...], pattern: str, name: str, secret: str) -> Key:
    return Key(
        scope=scope,
        path=(*prefix, name),
        type=str | None,
        type_name="path (optional)",
        default=None,
        about=f"A file holding {secret} (a mounted secret).",
        kind=Kind.FILE,
        flag=_flag(pattern, name),
        env=ENV_PREFIX + name.upper(),
        secret_of=secret,
    )


def _instance_keys() -> list[Key]:
    """The settings of one instance beyond its URL, given as INSTANCE=VALUE pairs."""
    keys = []
    for key in _walk(InstanceConfig, Scope.INSTANCE, (), "{}"):
        if key.name == "url":
            continue
        keys.append(msgspec.structs.replace(key, kind=Kind.PER_INSTANCE))
    return keys


@cache
def keys() -> tuple[Key, ...]:
    return tuple(_walk(RouterConfig, Scope.ROUTER, (), "{}"))
