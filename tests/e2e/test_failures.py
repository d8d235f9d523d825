"""The router under engine, store and input failures: slower, never wrong, never a traceback."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from carryover.bench.redis_server import RedisServer
from tests.support.metrics import ascrape, turns_by_path
from tests.support.secrets import admin_key_flags
from tests.support.stack import Stack, chat_turn, reference_chat, stack
from tests.support.waiting import eventually

TEXT = (
    "Turn {i}: tell me about rivers, stones and the patient gardener in every season of the year. "
)


class Chat:
    """A conversation that checks every answer against the reference engine."""

    def __init__(self, s: Stack, conversation: str | None = None, url: str | None = None) -> None:
        self.s = s
        self.id = conversation or uuid.uuid4().hex
        self.url = url or s.router.url
        self.messages: list[dict[str, Any]] = []

    async def turn(self, *, stream: bool = False, url: str | None = None) -> str | None:
        self.messages.append({"role": "user", "content": TEXT.format(i=len(self.messages)) * 2})
        got = await chat_turn(
            self.s.client, url or self.url, self.messages, stream=stream, conversation_id=self.id
        )
        assert got.status == 200, got.raw
        want = await reference_chat(self.s, self.messages)
        assert got.content == want.content
        self.messages.append({"role": "assistant", "content": got.content})
        return got.path


async def router_counter(s: Stack, name: str) -> float:
    return (await ascrape(s.client, s.router.url)).get(name, 0.0)


def netloc(url: str) -> str:
    return url.removeprefix("http://")


async def until_router_sees(s: Stack, metric: str, value: float, what: str) -> None:
    """Wait until the router reports ``metric == value`` (its health loop noticed a change)."""
    await eventually(lambda: router_counter(s, metric), lambda v: v == value, what=what)


async def until_instance_up(s: Stack, url: str, role: str, up: bool) -> None:
    metric = f"carryover_instance_up{{role={role},server={netloc(url)}}}"
    await until_router_sees(s, metric, 1.0 if up else 0.0, f"{role} {url} up={up}")


async def test_redis_down_serves_cold_then_recovers(tmp_path: Path, own_redis: RedisServer) -> None:
    # A killed Redis refuses connections at once: no store deadline is raced here (a tight one
    # would turn slow calls on a loaded machine into cold turns).
    flags = ("--redis", own_redis.url, "--store-timeout", "5")
    async with stack(tmp_path, router_flags=flags, sim={"threshold": 16}) as s:
        chat = Chat(s)
        assert [await chat.turn(), await chat.turn()] == ["cold-miss", "reuse"]
        own_redis.kill()
        assert await chat.turn() == "cold-error"
        assert await chat.turn(stream=True) == "cold-error"
        assert await router_counter(s, "carryover_store_errors_total{op=claim}") >= 2
        own_redis.start()
        assert await chat.turn() == "cold-miss"  # a fresh, empty Redis
        assert await chat.turn() == "reuse"


async def test_prefill_500_with_a_handle_is_retried_cold(tmp_path: Path) -> None:
    # D's clock jumps past the pin's TTL while the router's record is still live: P declines
    # the read with a 500, as vLLM does for an expired handle.
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        chat = Chat(s)
        assert await chat.turn() == "cold-miss"
        await s.client.post(s.decode[0].url + "/sim/faults", json={"advance_clock": 480})
        before = await turns_by_path(s.client, s.router.url)
        assert await chat.turn() == "cold-error"
        assert (
            await router_counter(s, "carryover_retries_total{cause=prefill_handle_rejected}") == 1
        )
        # Counted once, by the path the client was told: not as the reuse it was planned as.
        assert await turns_by_path(s.client, s.router.url) - before == {"cold-error": 1}
        assert await chat.turn() == "reuse"
        assert await turns_by_path(s.client, s.router.url) == {
            "cold-miss": 1,
            "cold-error": 1,
            "reuse": 1,
        }


async def test_decode_killed_before_first_byte_is_retried(tmp_path: Path) -> None:
    # The router still believes D0 is healthy (slow health checks): requests sent there fail
    # to connect and run again on D1 with a fresh cold P leg.
    async with stack(tmp_path, decodes=2, router_flags=("--health-interval", "60")) as s:
        await s.decode[0].stop()
        for i in range(20):
            chat = Chat(s, f"kill-{i}")
            await chat.turn(stream=bool(i % 2))
        assert await router_counter(s, "carryover_retries_total{cause=decode_failed}") >= 1


async def test_decode_breaking_mid_stream_gives_an_error_event(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        await s.client.post(s.decode[0].url + "/sim/faults", json={"drop_stream_after": 3})
        got = await chat_turn(
            s.client,
            s.router.url,
            [{"role": "user", "content": TEXT}],
            stream=True,
            conversation_id="cut",
        )
        assert got.status == 200
        # The three events D sent before the break reach the client, then the error, [DONE].
        assert len(got.chunks) == 3 + 2, got.chunks
        assert got.chunks[-1] == "[DONE]"
        assert "error" in got.chunks[-2]


async def test_expired_record_is_cold(tmp_path: Path) -> None:
    # Records live 6 - 5 - 0.5 = 0.5 s. Reuse after a miss is shown elsewhere: here it would
    # race the half-second lifetime.
    flags = ("--decoder-kv-blocks-ttl", "6", "--queue-margin", "0.5")
    flags += admin_key_flags(tmp_path, "adm")
    async with stack(tmp_path, router_flags=flags, sim={"threshold": 16}) as s:
        chat = Chat(s)
        await chat.turn()
        record = f"{s.router.url}/admin/conversations/{chat.id}"
        await eventually(
            lambda: s.client.get(record, headers={"Authorization": "Bearer adm"}),
            lambda r: r.status_code == 404,
            what="the store drops the record at its expiry",
        )
        # The turn is a plain miss and the stale handle never reaches P.
        assert await chat.turn() == "cold-miss"
        assert (await ascrape(s.client, s.prefill[0].url))[
            "vllm:nixl_num_failed_transfers_total"
        ] == 0


async def test_restarted_decode_makes_records_stale(tmp_path: Path) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        chat = Chat(s)
        await chat.turn()
        await s.client.post(s.decode[0].url + "/sim/faults", json={"restart": True})
        restarts = (
            f"carryover_instance_restarts_total{{role=decode,server={netloc(s.decode[0].url)}}}"
        )
        await until_router_sees(s, restarts, 1, "the router notices D's restart")
        assert await chat.turn() == "cold-expired"
        assert await chat.turn() == "reuse"


async def test_no_prefill_decode_serves_alone_and_keeps_reuse(tmp_path: Path) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        chat = Chat(s)
        await chat.turn()
        await s.prefill[0].stop()
        await until_instance_up(s, s.prefill[0].url, "prefill", False)
        await chat.turn()  # served by D alone; D still returns a handle
        await s.prefill[0].start()
        await until_instance_up(s, s.prefill[0].url, "prefill", True)
        assert await chat.turn() == "reuse"


async def test_no_prefill_with_fail_policy_is_503_and_keeps_the_record(tmp_path: Path) -> None:
    # Rendering in process, so the record is claimed and checked before P is found missing;
    # the handle was never sent, so it goes back and the retried turn still reuses.
    flags = ("--when-prefill-down", "fail", "--render-backend", "local")
    async with stack(tmp_path, sim={"threshold": 16}, router_flags=flags) as s:
        chat = Chat(s)
        await chat.turn()
        await s.prefill[0].stop()
        await until_instance_up(s, s.prefill[0].url, "prefill", False)
        chat.messages.append({"role": "user", "content": TEXT.format(i=9) * 2})
        refused = await chat_turn(s.client, s.router.url, chat.messages, conversation_id=chat.id)
        assert refused.status == 503, refused.raw
        assert "prefill" in refused.body["error"]["message"]
        chat.messages.pop()
        await s.prefill[0].start()
        await until_instance_up(s, s.prefill[0].url, "prefill", True)
        assert await chat.turn() == "reuse"


async def test_slow_probes_take_a_decode_out_only_if_another_is_left(tmp_path: Path) -> None:
    # A busy engine can miss health probes (vLLM on CPU does). With two Ds the slow one leaves
    # rotation; the last one stays, since dropping it would turn every request into a 503.
    flags = ("--health-timeout", "0.5")
    async with stack(tmp_path, decodes=2, router_flags=flags) as s:
        slow, other = s.decode
        await s.client.post(slow.url + "/sim/faults", json={"slow_probes": 5.0})
        await until_instance_up(s, slow.url, "decode", False)
        await s.client.post(other.url + "/sim/faults", json={"slow_probes": 5.0})
        # The router says so once the last D has missed the probes that would take it out.
        await eventually(
            lambda: asyncio.to_thread(s.router.log),
            lambda log: f"instance {netloc(other.url)} misses health probes; kept" in log,
            what="the router keeps the last decode instance despite slow probes",
        )
        up = await ascrape(s.client, s.router.url)
        assert up[f"carryover_instance_up{{role=decode,server={netloc(other.url)}}}"] == 1
        assert (await s.client.get(s.router.url + "/ready")).status_code == 200
        got = await chat_turn(s.client, s.router.url, [{"role": "user", "content": "hi there"}])
        assert got.status == 200, got.raw


async def test_a_client_that_leaves_cancels_its_engine_calls(tmp_path: Path) -> None:
    # D never answers; the client gives up. Only the router dropping the turn (instead of
    # holding a D slot for an answer nobody reads) brings its in-flight count back to 0.
    async with stack(tmp_path) as s:
        await s.client.post(s.decode[0].url + "/sim/faults", json={"hang": True})
        body = {"model": "sim-qwen3", "messages": [{"role": "user", "content": "hello"}]}
        with pytest.raises(httpx.ReadTimeout):
            await s.client.post(s.router.url + "/v1/chat/completions", json=body, timeout=1.0)
        await until_router_sees(s, "carryover_in_flight", 0, "the router drops the turn")
        # Turns that stay get their answers as before.
        await s.client.post(s.decode[0].url + "/sim/faults", json={"hang": False})
        got = await chat_turn(s.client, s.router.url, [{"role": "user", "content": "hello"}])
        assert got.status == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_one_failure_of_the_only_decode_is_retried_on_it(
    tmp_path: Path, stream: bool
) -> None:
    async with stack(tmp_path, sim={"threshold": 16}) as s:
        chat = Chat(s)
        await chat.turn(stream=stream)
        await s.client.post(s.decode[0].url + "/sim/faults", json={"fail_next": 1})
        assert await chat.turn(stream=stream) == "cold-error"  # right answer, on the retry
        assert await router_counter(s, "carryover_retries_total{cause=decode_failed}") == 1
        assert await chat.turn(stream=stream) == "reuse"


async def test_no_decode_is_a_clean_503(tmp_path: Path) -> None:
    async with stack(tmp_path) as s:
        await s.decode[0].stop()
        await until_instance_up(s, s.decode[0].url, "decode", False)
        for stream in (False, True):
            got = await chat_turn(
                s.client, s.router.url, [{"role": "user", "content": "hi"}], stream=stream
            )
            assert got.status == 503 and got.body["error"]["code"] == 503
        assert (await s.client.get(s.router.url + "/ready")).status_code == 503
