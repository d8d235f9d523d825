"""API keys, tenant namespaces and the admin surface."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.support.metrics import OPERATOR_KEY
from tests.support.secrets import admin_key_flags, register
from tests.support.stack import chat_turn, reference_chat, stack

KEYS = {"sk-alpha-0123456789": "alpha", "sk-beta-9876543210": "beta"}
TEXT = "Tell me about rivers and stones in an old garden and the gardener who minds them all year. "


def config_file(tmp_path: Path) -> Path:
    register(*KEYS, OPERATOR_KEY)
    path = tmp_path / "carryover.toml"
    keys = ", ".join(f'"{k}" = "{v}"' for k, v in KEYS.items())
    path.write_text(f'[router]\napi_keys = {{ {keys} }}\nadmin_key = "{OPERATOR_KEY}"\n')
    return path


async def test_tenants_cannot_reach_each_others_state(tmp_path: Path) -> None:
    flags = ("--config", str(config_file(tmp_path)))
    async with stack(tmp_path, router_flags=flags, sim={"threshold": 16}) as s:
        alpha = {"Authorization": "Bearer sk-alpha-0123456789"}
        beta = {"Authorization": "Bearer sk-beta-9876543210"}
        url = s.router.url + "/v1/chat/completions"
        body = {"model": "sim-qwen3", "max_tokens": 20, "conversation_id": "shared-id"}
        a_msgs = [{"role": "user", "content": TEXT * 2}]
        a1 = await s.client.post(url, json={**body, "messages": a_msgs}, headers=alpha)
        assert a1.headers["x-carryover-path"] == "cold-miss"
        # Tenant beta uses the same conversation id: its own namespace, a plain miss.
        b_msgs = [{"role": "user", "content": "beta " + TEXT * 2}]
        b1 = await s.client.post(url, json={**body, "messages": b_msgs}, headers=beta)
        assert b1.headers["x-carryover-path"] == "cold-miss"
        # Alpha's record is intact: its next turn reuses.
        a_msgs += [
            {"role": "assistant", "content": a1.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": TEXT},
        ]
        a2 = await s.client.post(url, json={**body, "messages": a_msgs}, headers=alpha)
        assert a2.headers["x-carryover-path"] == "reuse"
        assert (
            a2.json()["choices"][0]["message"]["content"]
            == (await reference_chat(s, a_msgs, max_tokens=20)).content
        )

        admin = {"Authorization": f"Bearer {OPERATOR_KEY}"}
        summary = await s.client.get(
            s.router.url + "/admin/conversations/shared-id?tenant=alpha", headers=admin
        )
        assert summary.status_code == 200
        data = summary.json()
        assert data["tenant"] == "alpha" and data["turn"] == 2 and data["tokens"] > 0
        assert "remote_block_ids" not in summary.text and "engine" not in summary.text
        for headers in ({}, alpha, {"Authorization": "Bearer wrong"}):
            denied = await s.client.get(
                s.router.url + "/admin/conversations/shared-id?tenant=alpha", headers=headers
            )
            assert denied.status_code == 401 and denied.json()["error"]["code"] == 401
        missing = await s.client.get(
            s.router.url + "/admin/conversations/nope?tenant=alpha", headers=admin
        )
        assert missing.status_code == 404

        # A client ends its conversation: gone for alpha only.
        gone = await s.client.delete(s.router.url + "/v1/conversations/shared-id", headers=beta)
        assert gone.json()["deleted"] is True
        still = await s.client.get(
            s.router.url + "/admin/conversations/shared-id?tenant=alpha", headers=admin
        )
        assert still.status_code == 200


@pytest.mark.parametrize(
    "authorization", [None, "Bearer nope", "Basic sk-alpha-0123456789", "Bearer"]
)
async def test_requests_without_a_valid_key_are_refused(
    tmp_path: Path, authorization: str | None
) -> None:
    flags = ("--config", str(config_file(tmp_path)))
    async with stack(tmp_path, router_flags=flags) as s:
        headers = {"Authorization": authorization} if authorization else {}
        r = await s.client.post(
            s.router.url + "/v1/chat/completions",
            headers=headers,
            json={"model": "sim-qwen3", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        models = await s.client.get(s.router.url + "/v1/models", headers=headers)
        assert models.status_code == 401
        # Keys, right or wrong, never reach the logs.
        await asyncio.to_thread(s.router.stop)
        log = s.router.log()
        assert "sk-alpha" not in log and "nope" not in log


async def test_drain_takes_an_instance_out_of_rotation(tmp_path: Path) -> None:
    flags = admin_key_flags(tmp_path, OPERATOR_KEY)
    async with stack(tmp_path, decodes=2, router_flags=flags) as s:
        name = s.decode[0].url.removeprefix("http://")
        admin = {"Authorization": f"Bearer {OPERATOR_KEY}"}
        r = await s.client.post(f"{s.router.url}/admin/instances/{name}/drain", headers=admin)
        assert r.json()["draining"] is True
        for i in range(6):
            got = await chat_turn(
                s.client, s.router.url, [{"role": "user", "content": f"{i} {TEXT}"}]
            )
            assert got.status == 200
        served = (await s.client.get(s.decode[0].url + "/metrics")).text
        assert 'vllm:request_success_total{engine="0",finished_reason="stop"' not in served
        unknown = await s.client.post(f"{s.router.url}/admin/instances/nope/drain", headers=admin)
        assert unknown.status_code == 404


async def test_a_conversation_id_with_slashes_can_be_inspected_and_ended(tmp_path: Path) -> None:
    flags = ("--config", str(config_file(tmp_path)))
    async with stack(tmp_path, router_flags=flags) as s:
        alpha = {"Authorization": "Bearer sk-alpha-0123456789"}
        admin = {"Authorization": f"Bearer {OPERATOR_KEY}"}
        body = {
            "model": "sim-qwen3",
            "max_tokens": 8,
            "conversation_id": "team/42/x",
            "messages": [{"role": "user", "content": TEXT}],
        }
        first = await s.client.post(s.router.url + "/v1/chat/completions", json=body, headers=alpha)
        assert first.status_code == 200
        url = "/admin/conversations/team/42/x?tenant=alpha"
        seen = await s.client.get(s.router.url + url, headers=admin)
        assert seen.status_code == 200 and seen.json()["id"] == "team/42/x"
        gone = await s.client.delete(s.router.url + "/v1/conversations/team/42/x", headers=alpha)
        assert gone.status_code == 200 and gone.json() == {
            "id": "team/42/x",
            "deleted": True,
            "released": True,
        }
        assert (await s.client.get(s.router.url + url, headers=admin)).status_code == 404
        # The one line a start logs says what this process serves.
        serving = [json.loads(x) for x in s.router.log().splitlines() if '"msg": "serving"' in x]
        assert len(serving) == 1 and serving[0]["tenants"] == 2, serving
        assert serving[0]["store"] == "in-process" and serving[0]["models"][0]["decode"]
