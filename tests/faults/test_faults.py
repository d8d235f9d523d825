"""Faults under a steady multi-turn load through two router processes sharing Redis.

Every case checks: each request either succeeded or got a clean OpenAI-style error (no hang,
no stream cut without an error event); no answer differs from the no-reuse reference; no
handle was read from D twice; every handle the live routers held reached one final state
(router/handles/ledger.py); reuse comes back once the fault clears. The table of all cases
is written to ``results/faults/`` (``bench/faults_report.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from carryover.bench.faults_report import FaultRow, write_faults_report
from tests.faults.harness import Harness, Outcome, harness, steady_load
from tests.support.waiting import eventually

T = TypeVar("T")
RESULTS = Path(__file__).parents[2] / "results" / "faults"
_rows: list[FaultRow] = []


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    if _rows:
        write_faults_report(_rows, RESULTS)


async def run_case(
    h: Harness,
    name: str,
    inject: Callable[[], Awaitable[None]],
    clear: Callable[[], Awaitable[None]],
    *,
    fault_seconds: float = 1.5,
    unclean_allowed: int = 0,
    note: str = "",
) -> Outcome:
    async with steady_load(h) as outcome:
        await eventually(
            _now(outcome.paths), lambda paths: paths["reuse"] > 0, what="reuse before the fault"
        )
        await inject()
        # The fault lasts this long under load, and at least until turns have met it.
        sent = outcome.sent
        await asyncio.sleep(fault_seconds)
        await eventually(_now(outcome), lambda o: o.sent >= sent + 4, what="turns during the fault")
        await clear()
        cleared = time.monotonic()
        await eventually(
            _now(outcome),
            lambda o: o.first_reuse_after(cleared) is not None,
            what="reuse after the fault cleared",
        )
    recovery = outcome.first_reuse_after(cleared)
    double = await h.double_reads()
    unsettled = await h.unsettled()
    _rows.append(
        FaultRow(
            name,
            outcome.sent,
            outcome.failed,
            outcome.unclean,
            outcome.wrong,
            double,
            recovery,
            dict(outcome.paths),
            note,
            unsettled,
        )
    )
    assert outcome.unclean <= unclean_allowed, outcome.errors
    assert outcome.wrong == 0, outcome.errors
    assert double == 0
    assert unsettled == 0, "handles without a final state (router/handles/ledger.py)"
    assert recovery is not None, "reuse did not come back after the fault cleared"
    return outcome


def _now(value: T) -> Callable[[], Awaitable[T]]:
    """A probe for :func:`eventually` that reads a value the load tasks keep updating."""

    async def probe() -> T:
        return value

    return probe


async def test_redis_killed_and_restarted(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:

        async def kill() -> None:
            h.redis.kill()

        async def start() -> None:
            h.redis.start()

        outcome = await run_case(h, "redis killed, restarted", kill, start)
        assert outcome.paths["cold-error"] > 0 and outcome.failed == 0


async def test_redis_slow(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:

        async def freeze() -> None:
            h.redis.pause()  # every call now exceeds the 0.5 s store timeout

        async def thaw() -> None:
            h.redis.resume()

        outcome = await run_case(h, "redis slow (frozen)", freeze, thaw)
        assert outcome.paths["cold-error"] > 0 and outcome.failed == 0


async def test_decode_killed_mid_stream_and_restarted(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:

        async def kill() -> None:
            await h.decode[0].stop()

        async def restart() -> None:
            await h.replace(h.decode, 0)  # same port, new engine id

        await run_case(
            h,
            "decode killed mid-stream, restarted with a new engine id",
            kill,
            restart,
            note="streams cut by the kill end with an SSE error event; stored handles of the old engine are stale",
        )


async def test_prefill_returning_500s(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:

        async def fail() -> None:
            await h.client.post(h.prefill[0].url + "/sim/faults", json={"error_rate": 1.0})

        async def heal() -> None:
            await h.client.post(h.prefill[0].url + "/sim/faults", json={"error_rate": 0.0})

        outcome = await run_case(h, "one prefill answering 500", fail, heal)
        assert outcome.failed == 0


async def test_prefill_hanging(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:

        async def hang() -> None:
            await h.client.post(h.prefill[0].url + "/sim/faults", json={"hang": True})

        async def heal() -> None:
            await h.client.post(h.prefill[0].url + "/sim/faults", json={"hang": False})

        outcome = await run_case(h, "one prefill hanging", hang, heal, fault_seconds=3)
        assert outcome.failed == 0


@pytest.mark.parametrize("policy", ["decode-alone", "fail"])
async def test_all_prefills_down(tmp_path: Path, policy: str) -> None:
    # "decode-alone": D serves alone, nothing fails. "fail": 503 at once instead, well inside
    # the P leg's deadline, which is long here on purpose.
    flags = ("--when-prefill-down", policy, "--prefill-timeout", "20")
    # Every turn D serves alone pins a handle that no P can release until P is back (left to
    # expire), so the outage's pins must fit in D however many turns the router serves in it
    # (a faster router fits more: the default 4,096 blocks filled up once engine calls got
    # cheaper).
    d_sim = {"num_blocks": 65_536}
    async with harness(tmp_path, router_flags=flags, d_sim=d_sim) as h:

        async def down() -> None:
            for p in h.prefill:
                await p.stop()

        async def up() -> None:
            for i in range(len(h.prefill)):
                await h.replace(h.prefill, i)

        outcome = await run_case(
            h,
            f"all prefills down (--when-prefill-down {policy})",
            down,
            up,
            note=(
                "served by decode alone (do_remote_prefill: false), which still returns handles"
                if policy == "decode-alone"
                else "refused with 503 at once; reuse resumes when P is back"
            ),
        )
        if policy == "decode-alone":
            assert outcome.failed == 0
        else:
            assert outcome.failed > 0
            assert {status for status, _ in outcome.refusals} == {503}, outcome.refusals
            # Refused without waiting for the P leg's deadline (20 s).
            assert max(seconds for _, seconds in outcome.refusals) < 10.0


async def test_handle_expiring_while_queued(tmp_path: Path) -> None:
    # P turns slow and D's clock jumps past the pins' TTL: every handle stored before the
    # fault expires while its turn waits at P. The router believes the handles are live and
    # learns otherwise from P's fast 500. (A short real TTL would also expire handles between
    # the turns of a loaded machine, after the fault.)
    async with harness(tmp_path) as h:

        async def slow() -> None:
            for p in h.prefill:
                await h.client.post(p.url + "/sim/faults", json={"slow": 1.2})
            for d in h.decode:
                await h.client.post(d.url + "/sim/faults", json={"advance_clock": 480})

        async def fast() -> None:
            for p in h.prefill:
                await h.client.post(p.url + "/sim/faults", json={"slow": 0.0})

        outcome = await run_case(h, "handle expiring while queued", slow, fast, fault_seconds=4)
        assert outcome.failed == 0


async def test_render_backend_down(tmp_path: Path) -> None:
    async with harness(tmp_path, with_render=True) as h:
        assert h.render is not None
        render = h.render

        async def down() -> None:
            await render.stop()

        async def up() -> None:
            servers = [render]
            await h.replace(servers, 0)
            h.render = servers[0]

        outcome = await run_case(
            h,
            "render backend down",
            down,
            up,
            note="turns continue without reuse: without the prompt ids nothing can be checked, so no handle is attached",
        )
        assert outcome.paths["cold-error"] > 0 and outcome.failed == 0


async def test_tokens_only_decode_killed_mid_stream_and_restarted(tmp_path: Path) -> None:
    async with harness(tmp_path, tokens=True) as h:

        async def kill() -> None:
            await h.decode[0].stop()

        async def restart() -> None:
            await h.replace(h.decode, 0)

        await run_case(
            h,
            "tokens-only engines: decode killed mid-stream, restarted",
            kill,
            restart,
            note="as with OpenAI engines; streamed turns keep their reuse through the handle captured after the stream",
        )


async def test_tokens_only_render_server_down(tmp_path: Path) -> None:
    async with harness(tmp_path, tokens=True) as h:
        render = h.tokens_render
        assert render is not None

        outcome = await run_case(
            h,
            "tokens-only engines: render server down",
            render.stop,
            render.start,
            note="refused with 503 (tokens-only engines cannot render); reuse resumes when it is back",
        )
        assert outcome.failed > 0
        assert {status for status, _ in outcome.refusals} == {503}, outcome.refusals


async def test_router_killed_mid_stream(tmp_path: Path) -> None:
    async with harness(tmp_path) as h:
        victim = h.routers[0]

        async def kill() -> None:
            h.dead_routers.add(0)
            victim.kill()  # SIGKILL to the router and its workers

        async def nothing() -> None:
            return None

        outcome = await run_case(
            h,
            "one router killed mid-stream",
            kill,
            nothing,
            note="requests in flight on the killed router fail with a closed connection; the other router keeps serving the same conversations from Redis",
        )
        assert outcome.paths["reuse"] > 0


# Redis deployments. The fault lasts until the deployment has healed: the store's calls retry
# within their deadline while a new primary is elected, and turns are served cold meanwhile.
# With replica durability, a primary without a replica in sync answers WAIT with 0, so turns
# stay cold (not_durable) until the failed node is back as a replica.


async def test_sentinel_primary_killed(tmp_path: Path) -> None:
    async with harness(tmp_path, topology="sentinel") as h:
        deployment = h.sentinels
        old = deployment.current_primary()

        async def kill() -> None:
            old.kill()
            await asyncio.to_thread(deployment.wait_failed_over, old)

        async def restart() -> None:
            await asyncio.to_thread(old.start)  # the Sentinels make it a replica
            await asyncio.to_thread(deployment.wait_replicated_to, deployment.current_primary())

        await run_case(
            h,
            "redis sentinel: primary killed, failed over, restarted",
            kill,
            restart,
            note="cold while the Sentinels elect the replica (down-after 2 s); claims stay cold (not durable) until the old primary is back as its replica",
        )


async def test_sentinel_one_sentinel_killed(tmp_path: Path) -> None:
    async with harness(tmp_path, topology="sentinel") as h:
        victim = h.sentinels.sentinels[0]

        async def kill() -> None:
            victim.kill()

        async def restart() -> None:
            await asyncio.to_thread(victim.start)

        outcome = await run_case(h, "redis sentinel: one Sentinel killed", kill, restart)
        assert outcome.failed == 0


async def test_sentinel_replica_frozen(tmp_path: Path) -> None:
    async with harness(tmp_path, topology="sentinel") as h:
        replica = next(
            s for s in (h.sentinels.primary, h.sentinels.replica)
            if s is not h.sentinels.current_primary()
        )  # fmt: skip

        async def freeze() -> None:
            replica.pause()  # partitioned: the primary's WAIT gets no acknowledgement

        async def thaw() -> None:
            replica.resume()

        outcome = await run_case(
            h,
            "redis sentinel: replica partitioned (SIGSTOP)",
            freeze,
            thaw,
            note="claims the replica did not acknowledge are not used (cold, not_durable); reuse resumes when it answers",
        )
        assert outcome.failed == 0


async def test_cluster_primary_killed(tmp_path: Path) -> None:
    async with harness(tmp_path, topology="cluster") as h:
        cluster = h.cluster
        victim = next(n for n in cluster.nodes if n.cli("ROLE").split()[0] == "master")

        async def kill() -> None:
            victim.kill()
            await asyncio.to_thread(cluster.wait_healthy, replicas=False)

        async def restart() -> None:
            await asyncio.to_thread(victim.start)  # rejoins as its old replica's replica
            await asyncio.to_thread(cluster.wait_healthy)

        await run_case(
            h,
            "redis cluster: a primary killed, failed over, restarted",
            kill,
            restart,
            note="conversations in the killed primary's slots are cold until its replica takes over (node timeout 2 s), then not durable until the node is back as a replica; the other slots keep reusing",
        )


async def test_cluster_slots_moved_during_traffic(tmp_path: Path) -> None:
    async with harness(tmp_path, topology="cluster") as h:
        cluster = h.cluster

        async def reshard() -> None:
            await asyncio.to_thread(cluster.move_slots, 2000)

        async def back() -> None:
            await asyncio.to_thread(cluster.move_slots, 2000)

        outcome = await run_case(
            h,
            "redis cluster: 2,000 slots resharded during traffic, twice",
            reshard,
            back,
            note="MOVED and ASK redirects are followed within the store deadline",
        )
        assert outcome.failed == 0
