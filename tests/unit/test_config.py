"""Configuration: the example file of docs/operations.md loads as documented; flags beat env beat
file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from carryover.router.config import ConfigError
from carryover.router.config.load import load_config

README = Path(__file__).parents[2] / "docs" / "operations.md"


def readme_toml(secrets: Path) -> str:
    """The documented example, its secret files (``/run/secrets/…``) made under ``secrets``."""
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1
    contents = {
        "api-keys.json": '{"sk-team-a": "team-a"}',
        "admin-key": "sk-admin",
        "salt-key": "salt-key",
    }
    secrets.mkdir(exist_ok=True)
    for name, text in contents.items():
        (secrets / name).write_text(text)
    return blocks[0].replace("/run/secrets/", f"{secrets}/")


def test_the_readme_example_loads_as_documented(tmp_path: Path) -> None:
    path = tmp_path / "carryover.toml"
    path.write_text(readme_toml(tmp_path / "secrets"))
    config = load_config(["--config", str(path)], environ={})
    model = config.models[0]
    assert config.redis == "redis://127.0.0.1:6379/0"
    assert config.api_keys == {"sk-team-a": "team-a"} and config.admin_key == "sk-admin"
    limits = config.default_tenant_limits
    assert (limits.concurrent_turns, limits.conversations) == (64, 10000)
    assert not config.shared_cache
    assert (config.held_interval, config.timeouts.health, config.timeouts.keepalive) == (10, 1, 4)
    assert model.record_ttl == 450  # 480 - 5 - 25, as the comment says
    assert model.when_prefill_down == "decode-alone"


def test_flags_beat_environment_beat_file(tmp_path: Path) -> None:
    path = tmp_path / "carryover.toml"
    path.write_text(readme_toml(tmp_path / "secrets"))
    environ = {"CARRYOVER_HELD_INTERVAL": "3", "CARRYOVER_WHEN_PREFILL_DOWN": "fail"}
    from_env = load_config(["--config", str(path)], environ=environ)
    assert from_env.held_interval == 3 and from_env.models[0].when_prefill_down == "fail"
    flagged = load_config(
        ["--config", str(path), "--held-interval", "7", "--when-prefill-down", "decode-alone"],
        environ=environ,
    )
    assert flagged.held_interval == 7
    assert flagged.models[0].when_prefill_down == "decode-alone"


def test_an_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        load_config(["--decode", "http://d:1"], environ={"CARRYOVER_WHEN_PREFILL_DOWN": "maybe"})


def test_affinity_settings_come_from_flags_env_and_file(tmp_path: Path) -> None:
    path = tmp_path / "carryover.toml"
    path.write_text(readme_toml(tmp_path / "secrets"))
    from_file = load_config(["--config", str(path)], environ={})
    assert (from_file.affinity_slack, from_file.affinity_tokens_per_load) == (4, 256)
    environ = {"CARRYOVER_AFFINITY_TOKENS_PER_LOAD": "64"}
    config = load_config(["--config", str(path), "--affinity-slack", "2"], environ=environ)
    assert (config.affinity_slack, config.affinity_tokens_per_load) == (2, 64)
    with pytest.raises(ConfigError):
        load_config(["--decode", "http://d:1", "--affinity-slack", "-1"], environ={})


def test_decode_kv_marks_come_from_flags_and_env_and_must_be_ordered() -> None:
    config = load_config(["--decode", "http://d:1"], environ={})
    assert (config.decode_kv_high_water, config.decode_kv_low_water) == (0.8, 0.6)
    config = load_config(
        ["--decode", "http://d:1", "--decode-kv-high-water", "0.9"],
        environ={"CARRYOVER_DECODE_KV_LOW_WATER": "0.5"},
    )
    assert (config.decode_kv_high_water, config.decode_kv_low_water) == (0.9, 0.5)
    assert load_config(["--decode", "http://d:1", "--decode-kv-high-water", "2"], environ={})
    for high, low in (("0.5", "0.6"), ("0.9", "0")):
        with pytest.raises(ConfigError):
            load_config(
                [
                    "--decode",
                    "http://d:1",
                    "--decode-kv-high-water",
                    high,
                    "--decode-kv-low-water",
                    low,
                ],
                environ={},
            )


def test_a_tokens_only_model_needs_a_render_server() -> None:
    flags = ["--prefill", "http://p:1", "--decode", "http://d:1", "--engine-api", "tokens"]
    with pytest.raises(ConfigError, match="render server"):
        load_config(flags, environ={})
    config = load_config(
        [*flags, "--render", "http://r:1", "--reasoning-parser", "qwen3", "--stream-tokens", "4"],
        environ={"CARRYOVER_STREAM_INTERVAL": "0.2"},
    )
    model = config.models[0]
    assert model.tokens_only and model.render.url == "http://r:1"
    assert (model.tokens.reasoning_parser, model.tokens.tool_call_parser) == ("qwen3", None)
    assert (model.tokens.stream_tokens, model.tokens.stream_interval) == (4, 0.2)


def test_a_warm_tier_comes_from_flags_or_env_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "carryover.toml"
    path.write_text(
        '[[models]]\nprefill = [{url = "http://p:8000"}]\ndecode = [{url = "http://d:8000"}]\n'
        '[models.warm_tier]\nname = "lmcache"\nchunk_tokens = 512\n'
    )
    from_file = load_config(["--config", str(path)], environ={}).models[0].warm_tier
    assert from_file is not None and (from_file.chunk_tokens, from_file.health) == (512, None)
    health = "http://lmcache:8080/healthcheck"
    flags = ["--config", str(path), "--warm-tier-health", health]
    warm = load_config(flags, environ={"CARRYOVER_WARM_TIER_CHUNK_TOKENS": "256"}).models[0]
    assert warm.warm_tier is not None
    assert (warm.warm_tier.name, warm.warm_tier.health, warm.warm_tier.chunk_tokens) == (
        "lmcache",
        health,
        256,
    )
    assert (
        load_config(["--prefill", "http://p", "--decode", "http://d"]).models[0].warm_tier is None
    )
    with pytest.raises(ConfigError, match=r"warm_tier\.health"):
        load_config(["--prefill", "http://p", "--decode", "http://d", "--warm-tier-health", "x"])


def test_api_keys_come_from_a_secret_file_too(tmp_path: Path) -> None:
    secret = tmp_path / "api-keys.json"
    secret.write_text('{"sk-b": "team-b"}')
    path = tmp_path / "carryover.toml"
    path.write_text(
        f'[router]\napi_keys = {{ "sk-a" = "team-a" }}\napi_keys_file = "{secret}"\n'
        '[[models]]\nprefill = [{url = "http://p:8000"}]\ndecode = [{url = "http://d:8000"}]\n'
    )
    config = load_config(["--config", str(path)], environ={})
    assert config.api_keys == {"sk-a": "team-a", "sk-b": "team-b"}
    flags = ["--prefill", "http://p", "--decode", "http://d"]
    from_env = load_config(flags, environ={"CARRYOVER_API_KEYS_FILE": str(secret)})
    assert from_env.api_keys == {"sk-b": "team-b"}
    secret.write_text('["not", "a", "mapping"]')
    with pytest.raises(ConfigError, match="api_keys_file"):
        load_config(flags, environ={"CARRYOVER_API_KEYS_FILE": str(secret)})


def test_serving_beyond_loopback_needs_keys_or_saying_so(tmp_path: Path) -> None:
    base = ["--prefill", "http://p:1", "--decode", "http://d:1"]
    for host in ("127.0.0.1", "::1", "localhost"):
        assert load_config([*base, "--host", host], environ={}).host == host
    for host in ("0.0.0.0", "::", "10.1.2.3", "router.example"):
        with pytest.raises(ConfigError, match="allow_unauthenticated"):
            load_config([*base, "--host", host], environ={})
    assert load_config([*base, "--host", "0.0.0.0", "--allow-unauthenticated"], environ={})
    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-0123456789": "team"}')
    env = {"CARRYOVER_API_KEYS_FILE": str(keys)}
    assert load_config([*base, "--host", "0.0.0.0"], environ=env).api_keys


def test_the_admin_key_and_the_salt_key_come_from_files(tmp_path: Path) -> None:
    admin = tmp_path / "admin"
    admin.write_text("sk-admin-0123\n")
    base = ["--prefill", "http://p:1", "--decode", "http://d:1"]
    config = load_config([*base, "--admin-key-file", str(admin)], environ={})
    assert config.admin_key == "sk-admin-0123"
    env = {"CARRYOVER_ADMIN_KEY_FILE": str(admin), "CARRYOVER_CACHE_SALT_KEY_FILE": "/k"}
    config = load_config(base, environ=env)
    assert config.admin_key == "sk-admin-0123" and config.cache_salt_key_file == "/k"
    with pytest.raises(ConfigError, match="admin_key_file"):
        load_config([*base, "--admin-key-file", str(tmp_path / "missing")], environ={})


def test_the_pin_limit_comes_from_flags_and_must_be_positive() -> None:
    assert load_config(["--decode", "http://d:1"], environ={}).decode_kv_pin_limit == 0.8
    never = load_config(["--decode", "http://d:1", "--decode-kv-pin-limit", "2"], environ={})
    assert never.decode_kv_pin_limit == 2
    with pytest.raises(ConfigError, match="decode_kv_pin_limit"):
        load_config(["--decode", "http://d:1", "--decode-kv-pin-limit", "0"], environ={})


def test_request_limits_come_from_flags_and_must_be_in_range() -> None:
    loaded = load_config(["--decode", "http://d:1"], environ={})
    assert (loaded.max_tools, loaded.max_nesting_depth) == (1024, 128)
    deep = load_config(["--decode", "http://d:1", "--max-nesting-depth", "32"], environ={})
    assert deep.max_nesting_depth == 32
    for bad in ("0", "257"):
        with pytest.raises(ConfigError, match="max_nesting_depth"):
            load_config(["--decode", "http://d:1", "--max-nesting-depth", bad], environ={})
    with pytest.raises(ConfigError, match="max_tools"):
        load_config(["--decode", "http://d:1", "--max-tools", "0"], environ={})


def test_the_span_cache_bound_comes_from_a_flag_and_reaches_the_renderer() -> None:
    from carryover.router.render.backends import LocalRenderer, local_folder

    loaded = load_config(["--decode", "http://d:1", "--span-cache-chars", "1000"], environ={})
    render = loaded.models[0].render
    assert render.span_cache_chars == 1000
    renderer = LocalRenderer(local_folder(render), render.span_cache_chars)
    assert renderer._template.spans.max_chars == 1000
    with pytest.raises(ConfigError, match="span_cache_chars"):
        load_config(["--decode", "http://d:1", "--span-cache-chars", "-1"], environ={})
