"""deploy/kubernetes against the Kubernetes API schemas (kubernetes-validate, offline), and
against the router it deploys: its config loads, its probes, secrets, grace period and
selectors fit (docs/kubernetes.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from carryover.router.config.load import load_config

DEPLOY = Path(__file__).parents[2] / "deploy" / "kubernetes"
KUBERNETES = "1.30.0"  # the oldest release still supported by its project when written


def documents() -> list[dict[str, Any]]:
    found = [
        doc
        for path in sorted(DEPLOY.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc is not None
    ]
    assert found
    return found


def by_kind(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_follows_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_validator_rejects_a_broken_manifest() -> None:
    broken = json.loads(json.dumps(by_kind("Deployment", "carryover-router")))
    broken["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)
    broken = json.loads(json.dumps(by_kind("Deployment", "carryover-router")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGets"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):  # strict: unknown fields fail
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_the_router_pods_run_the_config_and_secrets_they_are_given(tmp_path: Path) -> None:
    deployment = by_kind("Deployment", "carryover-router")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    secret = by_kind("Secret", "carryover-secrets")
    # The ConfigMap's file, with the secret's files where the pod mounts them.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    root = tmp_path / "etc"
    files = {
        mounts["config"]: by_kind("ConfigMap", "carryover-config")["data"]["carryover.toml"],
        **{
            f"{mounts['secrets']}/{item['path']}": secret["stringData"][item["key"]]
            for volume in pod["volumes"]
            if volume["name"] == "secrets"
            for item in volume["secret"]["items"]
        },
    }
    for path, text in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    toml = (root / mounts["config"].lstrip("/")).read_text()
    password = "/etc/carryover/secrets/redis-password"
    (root / "carryover.toml").write_text(toml.replace(password, str(root / password.lstrip("/"))))
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    for name in ("CARRYOVER_API_KEYS_FILE", "CARRYOVER_ADMIN_KEY_FILE"):
        env[name] = str(root / env[name].lstrip("/"))
    # Every key and password is read from a mounted file: none is in the environment.
    assert not any("valueFrom" in e for e in container["env"])
    args = container["args"]
    assert args[:3] == ["serve", "--config", mounts["config"]]
    config = load_config(["--config", str(root / "carryover.toml")], environ=env)
    assert config.host == "0.0.0.0" and config.port == container["ports"][0]["containerPort"]
    assert config.api_keys == json.loads(secret["stringData"]["api-keys.json"])
    assert config.admin_key == "example-admin-key" and config.redis is not None
    assert config.redis_options.password_file is not None
    # No key or password in the ConfigMap.
    assert "sk-" not in toml and "password =" not in toml
    # Probes: ready when a P and D are, alive while the process answers.
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    # SIGTERM comes after preStop; streams then get shutdown_grace, uvicorn one more second.
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + config.shutdown_grace + 1
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.port)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(container["resources"]["requests"]["cpu"]) == config.workers
    # runAsNonRoot can only be checked against a numeric user: the image's own.
    dockerfile = (DEPLOY.parents[1] / "Dockerfile").read_text()
    assert f"--uid {pod['securityContext']['runAsUser']} " in dockerfile
    # The routers find the engines by their StatefulSets' headless Services: every ready pod
    # of each, on the port its container serves, with its KV events on the ports it publishes.
    for model in config.models:
        for role, instances in (("prefill", model.prefill), ("decode", model.decode)):
            service = by_kind("Service", f"vllm-{role}")
            assert service["spec"]["clusterIP"] == "None"  # headless: a record per pod
            statefulset = by_kind("StatefulSet", f"vllm-{role}")
            assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
            port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
            (instance,) = instances
            assert instance.discovered and instance.url == f"dns://vllm-{role}:{port}"
            engine = " ".join(statefulset["spec"]["template"]["spec"]["containers"][0]["args"])
            assert instance.kv_events == "tcp://{address}:5557" and "tcp://*:5557" in engine


def test_selectors_pick_the_router_pods_and_the_budget_keeps_replicas() -> None:
    labels = by_kind("Deployment", "carryover-router")["spec"]["template"]["metadata"]["labels"]
    service = by_kind("Service", "carryover")
    budget = by_kind("PodDisruptionBudget", "carryover-router")
    assert service["spec"]["selector"].items() <= labels.items()
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    replicas = by_kind("Deployment", "carryover-router")["spec"]["replicas"]
    assert 0 < budget["spec"]["minAvailable"] < replicas


def test_engines_advertise_their_own_pod_for_nixl() -> None:
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        spec = by_kind("StatefulSet", f"vllm-{role}")["spec"]
        assert spec["serviceName"] == by_kind("Service", f"vllm-{role}")["metadata"]["name"]
        (container,) = spec["template"]["spec"]["containers"]
        args = container["args"]
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert config["kv_role"] == kv_role
        assert config["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
        env = {e["name"]: e for e in container["env"]}
        host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert host == "status.podIP"
