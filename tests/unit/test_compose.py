"""compose.yaml against the Compose specification, and its command lines against the real CLI.

There is no Docker engine here: the file is checked against the Compose spec schema that
check-jsonschema vendors, and every carryover command in it is parsed by carryover's parsers.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from carryover.bench.sim.config import parse_sim_args
from carryover.router.config.load import load_config
from carryover.state.redis_url import Topology, parse_redis_url

COMPOSE = Path(__file__).parents[2] / "compose.yaml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def test_compose_file_follows_the_compose_spec(compose: dict[str, Any]) -> None:
    schema = json.loads(
        (files("check_jsonschema") / "builtin_schemas/vendor/compose-spec.json").read_text()
    )
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(validator.iter_errors(compose), key=str)
    assert not errors, "\n".join(str(e.message) for e in errors)
    # The checker itself rejects a broken file (so the check above can fail).
    broken = {**compose, "services": {"x": {"image": 5, "ports": "nope"}}}
    assert list(validator.iter_errors(broken))


def _env(service: dict[str, Any]) -> dict[str, str]:
    """The service's environment, with its secrets' paths (``/run/secrets/NAME``) pointing at
    the files Compose mounts there."""
    env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
    compose = yaml.safe_load(COMPOSE.read_text())
    for name, value in env.items():
        if value.startswith("/run/secrets/"):
            source = compose["secrets"][value.removeprefix("/run/secrets/")]["file"]
            env[name] = str(COMPOSE.parent / source.split(":-", 1)[1].rstrip("}"))
    return env


def test_every_carryover_command_parses(compose: dict[str, Any]) -> None:
    parsed = 0
    for name, service in compose["services"].items():
        if service.get("image") not in ("carryover:latest", "carryover-sim:latest"):
            continue
        command = service["command"]
        if command[0] == "serve":
            config = load_config(command[1:], environ=_env(service))
            assert config.models[0].decode and config.redis
            assert config.api_keys and config.admin_key, name  # served beyond loopback
            if "prefill" in name or "decode" in name:
                raise AssertionError(f"{name} runs the router")
        elif command[0] == "sim":
            assert service["build"]["args"]["EXTRAS"] == "bench", name  # the simulator's extra
            sim = parse_sim_args(command[1:], environ=_env(service))
            assert sim.kv_transfer is not None and sim.bidirectional
            assert sim.side_channel_host == name  # NIXL address = the service's own name
        else:
            raise AssertionError(f"unknown carryover command in {name}: {command}")
        parsed += 1
    assert parsed == 7  # five routers (gpu, tokens-only, warm-tier, sim, sentinel), two sim engines


def test_engines_are_set_up_for_bidirectional_pd(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, role in (
        ("prefill", "kv_producer"),
        ("decode", "kv_consumer"),
        ("prefill-sim", "kv_producer"),
        ("decode-sim", "kv_consumer"),
        ("prefill-tokens", "kv_producer"),
        ("decode-tokens", "kv_consumer"),
    ):
        command = services[name]["command"]
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "NixlConnector" and config["kv_role"] == role
        assert config["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
        if role == "kv_producer":
            assert config["kv_load_failure_policy"] == "fail"
        assert services[name]["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == name
    for name in ("prefill", "decode", "prefill-tokens", "decode-tokens"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["count"] == 1 and devices[0]["capabilities"] == ["gpu"]
        assert "vllm-openai:v0.33" in services[name]["image"]


def test_the_tokens_only_profile_runs_the_four_stages(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("prefill-tokens", "decode-tokens"):
        assert "--tokens-only" in services[name]["command"]
        assert services[name]["profiles"] == ["tokens-only"]
    render = services["render-tokens"]
    assert render["entrypoint"] == ["vllm", "launch", "render"]
    router = services["router-tokens"]
    model = load_config(router["command"][1:], environ=_env(router)).models[0]
    assert model.tokens_only and model.render.url == "http://render-tokens:8000"
    assert [i.url for i in model.prefill] == ["http://prefill-tokens:8000"]
    # The router is told the parsers the render server runs (it checks them at startup).
    assert f"--reasoning-parser={model.tokens.reasoning_parser}" in render["command"]
    assert f"--tool-call-parser={model.tokens.tool_call_parser}" in render["command"]
    assert "redis" in router["depends_on"] and "tokens-only" in services["redis"]["profiles"]


def test_the_warm_tier_profile_composes_nixl_first_with_lmcache_on_both_engines(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    server = services["lmcache"]
    flags = dict(f.removeprefix("--").split("=", 1) for f in server["command"])
    for name, role in (("prefill-warm", "kv_producer"), ("decode-warm", "kv_consumer")):
        service = services[name]
        command = service["command"]
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "MultiConnector"
        nixl, lmcache = config["kv_connector_extra_config"]["connectors"]
        # NIXL first: MultiConnector gives a request to the first connector with tokens, so a
        # handle's pull wins and LMCache serves only turns without one.
        assert nixl["kv_connector"] == "NixlConnector" and nixl["kv_role"] == role
        assert nixl["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
        if role == "kv_producer":
            assert config["kv_load_failure_policy"] == "fail"
        extra = lmcache["kv_connector_extra_config"]
        assert lmcache["kv_connector"] == "LMCacheMPConnector"
        assert extra["lmcache.mp.host"] == "tcp://lmcache"
        assert str(extra["lmcache.mp.port"]) == flags["port"]
        assert service["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == name
        assert service["profiles"] == ["warm-tier"] and "lmcache" in service["depends_on"]
    router = services["router-warm"]
    model = load_config(router["command"][1:], environ=_env(router)).models[0]
    assert model.warm_tier is not None
    assert model.warm_tier.health == f"http://lmcache:{flags['http-port']}/healthcheck"
    assert model.warm_tier.chunk_tokens == int(flags["chunk-size"])
    assert [i.url for i in model.prefill] == ["http://prefill-warm:8000"]
    assert "warm-tier" in services["redis"]["profiles"]


def test_the_sentinel_profile_watches_a_primary_and_replica_with_three_sentinels(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    profile = {name for name, service in services.items() if "sentinel" in service["profiles"]}
    sentinels = {name for name in profile if name.startswith("sentinel-")}
    assert len(sentinels) == 3
    assert {
        "redis-primary",
        "redis-replica",
        "router-sentinel",
        "prefill-sim",
        "decode-sim",
    } <= profile
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1 :] == ["redis-primary", "6379"]
    script = services["sentinel-1"]["command"][0]
    assert "'sentinel monitor carryover redis-primary 6379 2'" in script  # quorum of 2 of 3
    router = services["router-sentinel"]
    config = load_config(router["command"][1:], environ=_env(router))
    assert config.redis is not None
    target = parse_redis_url(config.redis)
    assert target.topology is Topology.SENTINEL and target.master_name == "carryover"
    assert {host for host, _ in target.seeds} == sentinels
    assert router["deploy"]["replicas"] == 2  # two routers share it


def test_only_routers_and_grafana_are_published(compose: dict[str, Any]) -> None:
    assert compose["networks"]["engines"]["internal"] is True
    for name, service in compose["services"].items():
        if name.startswith("router"):
            assert service["ports"] == ["8000-8001:8000"] and service["deploy"]["replicas"] == 2
        elif name == "grafana":
            assert service["ports"] == ["3000:3000"]
        else:
            assert "ports" not in service, f"{name} publishes a port"
            # On the engines' network; those that download a model also on egress.
            downloads = "HF_TOKEN" in (service.get("environment") or {})
            assert service["networks"] == (["engines", "egress"] if downloads else ["engines"])


def test_the_observability_profile_scrapes_every_router_and_engine_and_shows_the_dashboard(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    root = COMPOSE.parent
    mounts = {
        name: dict(v.rsplit(":", 1)[0].split(":", 1) for v in services[name]["volumes"])
        for name in ("prometheus", "grafana")
    }
    for name, volumes in mounts.items():
        assert services[name]["profiles"] == ["observability"]
        for source in volumes:
            assert (root / source).exists(), source
    prometheus = yaml.safe_load((root / "deploy/prometheus/prometheus.yml").read_text())
    scraped = {
        job["job_name"]: {n for sd in job["dns_sd_configs"] for n in sd["names"]}
        for job in prometheus["scrape_configs"]
    }
    routers = {n for n, s in services.items() if s.get("command", [None])[0] == "serve"}
    engines = {
        n
        for n, s in services.items()
        if "--kv-transfer-config" in s.get("command", []) or (s.get("command", [None])[0] == "sim")
    }
    assert scraped["carryover"] == routers and scraped["vllm"] == engines
    # The routers have api keys: their /metrics answers the admin key, which Prometheus sends.
    (job,) = (j for j in prometheus["scrape_configs"] if j["job_name"] == "carryover")
    key_file = job["authorization"]["credentials_file"]
    assert key_file == "/run/secrets/admin_key" and "admin_key" in services["prometheus"]["secrets"]
    assert all("admin_key" in services[name].get("secrets", []) for name in routers)
    datasource = yaml.safe_load(
        (root / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and datasource["type"] == "prometheus"
    provider = yaml.safe_load(
        (root / "deploy/grafana/provisioning/dashboards/carryover.yml").read_text()
    )["providers"][0]
    dashboard = mounts["grafana"]["./deploy/grafana/carryover.json"]
    assert Path(dashboard).parent == Path(provider["options"]["path"])


def test_dockerfile_runs_locked_and_unprivileged() -> None:
    dockerfile = (COMPOSE.parent / "Dockerfile").read_text()
    assert "uv sync --frozen --no-dev" in dockerfile
    assert "USER carryover" in dockerfile and 'ENTRYPOINT ["carryover"]' in dockerfile


def test_every_service_that_downloads_a_model_can_reach_the_internet(
    compose: dict[str, Any],
) -> None:
    """A service given HF_TOKEN downloads its model at the first start: it needs a network
    that is not internal (an engines-only service could not), and publishes no port there."""
    internal = {name for name, net in compose["networks"].items() if (net or {}).get("internal")}
    downloading = [
        (name, service)
        for name, service in compose["services"].items()
        if "HF_TOKEN" in (service.get("environment") or {})
    ]
    assert downloading
    for name, service in downloading:
        assert set(service["networks"]) - internal, name
        assert not service.get("ports"), name
