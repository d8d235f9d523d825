"""Two tenants on one fleet (simulated engines, a password-protected Redis, two workers): one
cannot hit or time the other's cached prompts, make the other's requests fail, or take its
share of the router; and no key or password reaches a process's environment, a log or an
error body (tests/support/secrets.py scans them)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from carryover.bench.redis_server import RedisServer
from tests.support.metrics import OPERATOR_KEY, ascrape
from tests.support.secrets import REDIS_PASSWORD as PASSWORD
from tests.support.secrets import register
from tests.support.stack import Stack, chat_turn, stack
from tests.support.waiting import eventually

ALPHA, BETA, ADMIN = "sk-alpha-4f1c9a7d2b", "sk-beta-8e3d6b0a51", OPERATOR_KEY
PROMPT = "Summarize the quarterly report on river gardens and their stones, page by page. " * 6
POISON = "POISON-PILL-7c1e"


def _config(tmp_path: Path, redis: RedisServer) -> Path:
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "keys.json").write_text(json.dumps({ALPHA: "alpha", BETA: "beta"}))
    (secrets / "admin").write_text(ADMIN)
    (secrets / "redis").write_text(PASSWORD)
    path = tmp_path / "carryover.toml"
    path.write_text(
        "[router]\n"
        f'api_keys_file = "{secrets / "keys.json"}"\n'
        f'admin_key_file = "{secrets / "admin"}"\n'
        f'redis = "{redis.url}"\n'
        "workers = 2\n"
        "held_interval = 0.2\n"
        "[router.redis_options]\n"
        f'password_file = "{secrets / "redis"}"\n'
        "[router.tenant_limits.alpha]\n"
        "concurrent_turns = 1\n"
        "[router.tenant_limits.beta]\n"
        "conversations = 2\n"
    )
    return path


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _chat(s: Stack, key: str, content: str, **extra: Any) -> Any:
    body = {"model": "sim-qwen3", "messages": [{"role": "user", "content": content}], **extra}
    return await s.client.post(
        s.router.url + "/v1/chat/completions", json={"max_tokens": 8, **body}, headers=_as(key)
    )


def _cached(answer: Any) -> int:
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_two_tenants_share_no_cache_no_failures_and_no_quota(
    tmp_path: Path, protected_redis: RedisServer
) -> None:
    register(ALPHA, BETA, ADMIN)
    flags = ("--config", str(_config(tmp_path, protected_redis)))
    async with stack(tmp_path, decodes=2, router_flags=flags) as s:
        # 1. The same prompt: alpha's second send hits alpha's cache; beta's first does not.
        first = await _chat(s, ALPHA, PROMPT)
        assert first.status_code == 200 and _cached(first) == 0
        again = await _chat(s, ALPHA, PROMPT)
        assert _cached(again) > 0  # the cache works within a tenant
        other = await _chat(s, BETA, PROMPT)
        assert other.status_code == 200 and _cached(other) == 0
        # A client salt separates users inside a tenant, and cannot reach another tenant.
        salted = await _chat(s, BETA, PROMPT, cache_salt="user-1")
        assert _cached(salted) == 0
        salts: set[str] = set()
        for engine in (*s.prefill, *s.decode):
            salts |= set((await s.client.get(engine.url + "/sim/state")).json()["cache_salts"])
        assert len(salts) == 3 and not any("alpha" in x or "beta" in x for x in salts)

        # 2. Alpha's requests that make the engines answer 500 fail alpha's requests alone.
        for engine in (*s.prefill, *s.decode):
            await s.client.post(engine.url + "/sim/faults", json={"poison": POISON})
        for _ in range(6):
            failed = await _chat(s, ALPHA, f"{POISON} {PROMPT}")
            assert failed.status_code == 502, failed.text
            assert "127.0.0.1" not in failed.text  # no engine address in an error body
        served = await _chat(s, BETA, "And now something else entirely.")
        assert served.status_code == 200, served.text
        values = await ascrape(s.client, s.router.url)
        assert not any(v for k, v in values.items() if k.startswith("carryover_breaker_open{"))

        # 3. Alpha runs one turn at a time per worker: of three at once, two workers take at
        # most two; beta is served meanwhile.
        alpha_turns = [
            asyncio.create_task(
                chat_turn(
                    s.client,
                    s.router.url,
                    [{"role": "user", "content": f"{n} {PROMPT}"}],
                    api_key=ALPHA,
                    stream=True,
                    max_tokens=300,
                    ignore_eos=True,
                )
            )
            for n in range(3)
        ]
        beta = await _chat(s, BETA, "Meanwhile, a short one.")
        statuses = sorted(t.status for t in await asyncio.gather(*alpha_turns))
        assert beta.status_code == 200
        assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
        values = await ascrape(s.client, s.router.url)
        limited = "carryover_tenant_limited_total{{limit={},tenant={}}}"
        assert values.get(limited.format("concurrent_turns", "alpha"), 0) >= 1
        assert limited.format("concurrent_turns", "beta") not in values

        # 4. Beta may hold two live conversations: a third is refused, the two go on, and
        # alpha (no such limit) starts as many as it likes.
        for n in range(2):
            kept = await _chat(s, BETA, f"Conversation {n}.", conversation_id=f"beta-{n}")
            assert kept.status_code == 200
        await eventually(  # the least of the two workers' views: both have seen them
            lambda: ascrape(s.client, s.router.url),
            lambda m: m.get("carryover_tenant_conversations{tenant=beta}") == 2,
            what="every worker counting beta's two conversations",
        )
        refused = await _chat(s, BETA, "A third one.", conversation_id="beta-2")
        assert refused.json()["error"]["type"] == "RateLimitError"
        history = [
            {"role": "user", "content": "Conversation 0."},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "More."},
        ]
        going_on = await s.client.post(
            s.router.url + "/v1/chat/completions",
            json={
                "model": "sim-qwen3",
                "max_tokens": 8,
                "messages": history,
                "conversation_id": "beta-0",
            },
            headers=_as(BETA),
        )
        assert going_on.status_code == 200, going_on.text
        for n in range(3):
            started = await _chat(s, ALPHA, f"Alpha {n}.", conversation_id=f"alpha-{n}")
            assert started.status_code == 200
