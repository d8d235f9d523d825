"""Configuration is declared once, in the Structs: every key has a flag (secrets: a file) and
a variable, both set it, and docs/configuration.md is what the code generates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

from carryover.router.config import RouterConfig
from carryover.router.config.keys import Key, Kind, Scope, keys
from carryover.router.config.load import load_config
from carryover.router.config.reference import reference

ROOT = Path(__file__).parents[2]
BASE = ["--prefill", "http://p0:8000", "--decode", "http://d0:8000"]

#: A valid value other than the default, where the type alone does not give one.
SAMPLES: dict[str, Any] = {
    "host": "127.0.0.2",
    "redis": "redis://127.0.0.1:6390/0",
    "decode_kv_low_water": 0.5,
    "render.url": "http://r0:8000",
    "warm_tier.health": "http://lmcache:8080/healthcheck",
    "warm_tier.medium": "DISK",
    "redis_options.shards": 8,
    "kv_events_replay": None,  # needs kv_events: set together below
    "tenant_limits": {"alpha": {"concurrent_turns": 3}},
    "api_keys": {"sk-sample": "alpha"},
    "conversation_headers": ["x-a", "x-b"],
    "decoder_kv_blocks_ttl": 240.0,
    "queue_margin": 10.0,
    "default_tenant_limits.priority_min": -2,
}


#: What a sample value needs beside it to be a configuration that can work.
NEEDS: dict[str, dict[str, str]] = {
    "host": {"CARRYOVER_API_KEYS": '{"sk-a": "a"}'},
    "engine_api": {"CARRYOVER_RENDER": "http://r0:8000"},
    "workers": {"CARRYOVER_REDIS": "redis://127.0.0.1:6390/0"},
}


def _sample(key: Key) -> Any:
    if key.name in SAMPLES:
        return SAMPLES[key.name]
    if key.choices:
        return next(c for c in key.choices if c != key.default and c is not None)
    if key.kind is Kind.SWITCH:
        return not key.default
    base = msgspec.convert(key.default, key.type) if key.default is not None else None
    text = key.type_name.split(" ")[0]
    if text == "int":
        return (base or 0) + 7
    if text == "float":
        return (base or 0.5) * 2 + 0.25
    return f"sample-{key.path[-1]}"


def _text(key: Key, value: Any) -> str:
    if isinstance(value, dict):
        return msgspec.json.encode(value).decode()
    if isinstance(value, list):
        return ",".join(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _read(config: RouterConfig, key: Key) -> Any:
    where: Any = config if key.scope is Scope.ROUTER else config.models[0]
    if key.scope is Scope.INSTANCE:
        where = config.models[0].prefill[0]
    for part in key.path:
        where = getattr(where, part)
    return _plain(where)


def _plain(value: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


SETTABLE = [
    k for k in keys() if k.kind not in (Kind.INSTANCES, Kind.FILE) and k.name != "kv_events_replay"
]


@pytest.mark.parametrize("key", SETTABLE, ids=lambda k: k.name)
def test_every_key_is_set_by_its_flag_and_by_its_variable(key: Key) -> None:
    value = _sample(key)
    text = _text(key, value)
    if key.scope is Scope.INSTANCE:
        text = f"http://p0:8000={text if key.name != 'kv_events' else 'tcp://p0:5557'}"
        value = "tcp://p0:5557" if key.name == "kv_events" else value
    environ = dict(NEEDS.get(key.name, {}))
    expected = _plain(msgspec.convert(value, key.type)) if value is not None else None
    by_env = load_config(BASE, environ={**environ, key.env: text})
    assert _read(by_env, key) == expected, key.env
    if key.flag is None:  # a secret: no flag, and its file sets it too (below)
        return
    if key.kind is Kind.SWITCH:
        flags = [key.flag if value else f"--no-{key.flag[2:]}"]
    elif key.kind is Kind.LIST:
        flags = [part for item in value for part in (key.flag, item)]
    else:
        flags = [key.flag, text]
    by_flag = load_config([*BASE, *flags], environ=environ)
    assert _read(by_flag, key) == expected, key.flag
    # A flag wins over its variable.
    assert (
        _read(load_config([*BASE, *flags], environ={**environ, key.env: "junk"}), key) == (expected)
        or key.kind is Kind.SWITCH
    )


def test_secrets_come_from_their_files(tmp_path: Path) -> None:
    (tmp_path / "keys.json").write_text('{"sk-1": "alpha"}')
    (tmp_path / "admin").write_text("sk-admin\n")
    by_flag = load_config(
        [
            *BASE,
            "--api-keys-file",
            str(tmp_path / "keys.json"),
            "--admin-key-file",
            str(tmp_path / "admin"),
        ],
        environ={},
    )
    by_env = load_config(
        BASE,
        environ={
            "CARRYOVER_API_KEYS_FILE": str(tmp_path / "keys.json"),
            "CARRYOVER_ADMIN_KEY_FILE": str(tmp_path / "admin"),
        },
    )
    for config in (by_flag, by_env):
        assert config.api_keys == {"sk-1": "alpha"} and config.admin_key == "sk-admin"
    secret_flags = [k for k in keys() if k.kind is Kind.FILE]
    assert {k.secret_of for k in secret_flags} == {"api_keys", "admin_key"}
    assert not [k for k in keys() if k.name in ("api_keys", "admin_key") and k.flag]


def _fields(cls: type, seen: set[str], prefix: str = "") -> None:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    for field in info.fields:
        inner = field.type.type if isinstance(field.type, mi.Metadata) else field.type
        options = inner.types if isinstance(inner, mi.UnionType) else (inner,)
        struct = next((o for o in options if isinstance(o, mi.StructType)), None)
        items = getattr(inner, "item_type", None)
        if isinstance(items, mi.StructType) and field.name == "models":
            _fields(items.cls, seen)
        elif struct is not None:
            _fields(struct.cls, seen, f"{prefix}{field.name}.")
        else:
            seen.add(prefix + field.name)
        if isinstance(items, mi.StructType) and field.name == "prefill":
            _fields(items.cls, seen)


def test_every_field_of_every_struct_is_a_key_with_a_meaning_a_flag_and_a_variable() -> None:
    fields: set[str] = set()
    _fields(RouterConfig, fields)
    named = {k.name for k in keys()}
    assert fields - {"url"} <= named, fields - named
    flags = [k.flag for k in keys() if k.flag]
    envs = [k.env for k in keys()]
    assert len(flags) == len(set(flags)) and len(envs) == len(set(envs))
    for key in keys():
        assert key.env.startswith("CARRYOVER_")
        assert key.hidden or key.about, key.name
        assert key.flag or key.name in ("api_keys", "admin_key"), key.name


def test_the_reference_is_generated_from_the_code() -> None:
    written = (ROOT / "docs/configuration.md").read_text()
    assert written == reference(), (
        "docs/configuration.md is stale: "
        "python -m carryover.router.config.reference > docs/configuration.md"
    )
    for key in keys():
        assert key.hidden or f"`{key.env}`" in written


def test_help_shows_every_flag_with_its_default_and_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        load_config(["--help"], environ={})
    assert done.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for key in keys():
        if key.flag and not key.hidden:
            assert key.flag in shown and key.env in shown, key.name
