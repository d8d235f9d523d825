"""Salts, log ids, limits and what clients are told (router/tenants, router/errors.py)."""

from __future__ import annotations

import msgspec
import pytest

from carryover.router.config import TenantLimits
from carryover.router.config.load import load_config
from carryover.router.errors import (
    BadRequest,
    EngineFailed,
    EngineTimeout,
    EngineUnavailable,
    TooManyRequests,
)
from carryover.router.tenants.limits import TenantGate
from carryover.router.tenants.salt import CacheSalts, check_client_salt
from carryover.state import TenantUsage


def test_salts_differ_by_tenant_and_client_salt_and_no_pair_passes_for_another() -> None:
    salts = CacheSalts(b"k", shared=False)
    seen = {
        salts.of("a", None),
        salts.of("b", None),
        salts.of("a", "x"),
        salts.of("b", "x"),
        salts.of("a", '"b'),  # an encoding that merely joined strings would collide here
        salts.of('a"', "b"),
    }
    assert len(seen) == 6
    assert CacheSalts(b"other", shared=False).of("a", None) != salts.of("a", None)
    assert all(s is not None and len(s) <= 128 for s in seen)
    shared = CacheSalts(b"k", shared=True)
    assert shared.of("a", None) is None and shared.of("a", "x") == "x"
    assert salts.log_id("a", "c1") != salts.log_id("b", "c1")


@pytest.mark.parametrize("bad", ["", 7, "a/b", "a@b", "x" * 129, "nul\0"])
def test_a_client_salt_vllm_would_refuse_is_a_400(bad: object) -> None:
    with pytest.raises(BadRequest):
        check_client_salt(bad)
    assert check_client_salt("user-42") == "user-42"


def _gate(**limits: TenantLimits) -> TenantGate:
    base = load_config(["--prefill", "http://p:1", "--decode", "http://d:1"], environ={})
    return TenantGate(msgspec.structs.replace(base, tenant_limits=limits))


def test_a_tenant_over_its_concurrent_turns_is_refused_and_others_are_not() -> None:
    gate = _gate(alpha=TenantLimits(concurrent_turns=2))
    gate.enter("alpha")
    gate.enter("alpha")
    with pytest.raises(TooManyRequests):
        gate.enter("alpha")
    for _ in range(5):
        gate.enter("beta")
    gate.leave("alpha")
    gate.enter("alpha")
    assert gate.running("alpha") == 2 and gate.running("beta") == 5


def test_priority_is_held_to_the_tenants_range() -> None:
    gate = _gate(vip=TenantLimits(priority_min=-5, priority_max=5))
    body = {"priority": -100}
    gate.clamp_priority("someone", body)
    assert "priority" not in body  # the default range is 0..0
    body = {"priority": -100}
    gate.clamp_priority("vip", body)
    assert body["priority"] == -5
    with pytest.raises(BadRequest):
        gate.clamp_priority("vip", {"priority": "high"})


def test_clients_never_read_an_engines_address_but_read_its_4xx() -> None:
    for error in (
        EngineUnavailable("cannot connect to http://10.0.0.5:8000/v1/chat/completions"),
        EngineTimeout("http://p0.internal:8000/v1/completions did not answer within 5 s"),
        EngineFailed("decode-0.vllm:8000 broke off: it closed"),
    ):
        public = error.public_message
        assert "10.0.0.5" not in public and "8000" not in public, public
        assert "internal" not in public and "vllm:" not in public, public
    assert EngineFailed("max_tokens is too large", status=400).public_message == (
        "max_tokens is too large"
    )


def test_a_tenant_at_a_holdings_limit_may_not_start_another_conversation() -> None:
    gate = _gate(beta=TenantLimits(conversations=2), gamma=TenantLimits(pinned_tokens=10_000))
    assert gate.reads_usage and gate.limited_tenants == ["beta", "gamma"]
    gate.usage = {"beta": TenantUsage(1, 9), "alpha": TenantUsage(50, 10**9)}
    gate.admit_new("beta")
    gate.admit_new("gamma")
    gate.admit_new("alpha")  # no limit of its own, none by default
    gate.usage = {"beta": TenantUsage(2, 9), "gamma": TenantUsage(1, 10_000)}
    for tenant in ("beta", "gamma"):
        with pytest.raises(TooManyRequests):
            gate.admit_new(tenant)
    assert not _gate().reads_usage


def test_a_model_name_the_engines_have_not_confirmed_is_never_a_label() -> None:
    """Before the served name is known, the client's name goes to the engines (they judge
    it) but metrics count under "" and records under one namespace: no label or key per
    name a client makes up."""
    from types import SimpleNamespace
    from typing import cast

    from carryover.router.http.services import Services, conversation_key, resolve_model
    from carryover.router.render.backends import Renderer
    from carryover.router.turn.api import engine_api
    from carryover.router.turn.model import TurnRequest
    from carryover.router.turn.runtime import ModelRuntime, Models

    config = load_config(["--prefill", "http://p:1", "--decode", "http://d:1"], environ={})
    (model,) = config.models
    runtime = ModelRuntime(model, cast(Renderer, None), engine_api(model))
    services = cast(Services, SimpleNamespace(config=config, models=Models([runtime])))
    resolved = resolve_model(services, "attacker-model-17")
    assert (resolved.name, resolved.known) == ("attacker-model-17", False)
    key = conversation_key("t", resolved, "c1")
    assert key.model == "default"
    req = TurnRequest(
        resolved.runtime,
        resolved.name,
        key,
        {},
        True,
        False,
        False,
        "r",
        1,
        model_name_known=resolved.known,
    )
    assert req.model_label == ""
    runtime.name = "served"
    known = resolve_model(services, "served")
    assert known.known and conversation_key("t", known, "c1").model == "served"
