"""Multi-node Redis deployments of real servers on free loopback ports: a 3-primary/3-replica
Cluster and a primary + replica watched by three Sentinels. Nodes can be killed, frozen and
restarted like a single ``RedisServer``."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from carryover.bench.ports import free_port
from carryover.bench.redis_server import RedisServer

#: A node silent this long is failed over (ms). Short, so fault tests end soon; long enough
#: that a loaded 2-core machine does not fail over a node that is only slow.
NODE_TIMEOUT_MS = 2000


def _wait(check: object, what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()  # type: ignore[operator]
        except (subprocess.SubprocessError, OSError) as exc:
            last = exc
        if last is True:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} (last: {last!r})")


class RedisCluster:
    """Six ``redis-server --cluster-enabled yes`` nodes joined by ``redis-cli --cluster
    create --cluster-replicas 1``."""

    def __init__(self, workdir: Path, primaries: int = 3) -> None:
        self.nodes: list[RedisServer] = []
        for index in range(primaries * 2):
            port, bus = free_port(), free_port()
            self.nodes.append(
                RedisServer(
                    workdir / f"node{index}",
                    port,
                    extra=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                        "--cluster-node-timeout",
                        str(NODE_TIMEOUT_MS),
                        "--cluster-port",
                        str(bus),
                        # a replica promotes itself however long its primary has been gone
                        "--cluster-replica-validity-factor",
                        "0",
                    ],
                )
            )

    @property
    def url(self) -> str:
        seeds = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes[:3])
        return f"redis+cluster://{seeds}"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{node.port}" for node in self.nodes),
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        self.wait_healthy()

    def wait_healthy(self, *, replicas: bool = True) -> None:
        """Every live node says the cluster is ok; with ``replicas``, every primary also has
        a replica in sync."""

        def ok() -> object:
            for node in self.nodes:
                if not node.answering:
                    continue
                info = node.cli("CLUSTER", "INFO")
                if "cluster_state:ok" not in info:
                    return info.splitlines()[0]
            return True

        def replicated() -> object:
            # Every primary has a replica in sync (until then WAIT answers 0).
            for node in self.nodes:
                if not node.answering:
                    continue
                info = node.cli("INFO", "replication")
                if "role:master" in info and ("state=online" not in info):
                    return info
            return True

        _wait(ok, "the Redis Cluster did not become ok")
        if replicas:
            _wait(replicated, "the Redis Cluster's replicas did not sync")

    def move_slots(self, count: int) -> None:
        """``redis-cli --cluster reshard``: ``count`` slots, keys included, from the first
        primary to the next one (MIGRATE: clients meet ASK, then MOVED)."""
        primaries = []
        for line in self._live().cli("CLUSTER", "NODES").splitlines():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2] and len(fields) > 8:
                primaries.append(fields[0])
        primaries.sort()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "reshard",
                f"127.0.0.1:{self._live().port}",
                "--cluster-from",
                primaries[0],
                "--cluster-to",
                primaries[1],
                "--cluster-slots",
                str(count),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        self.wait_healthy()

    def _live(self) -> RedisServer:
        return next(node for node in self.nodes if node.answering)

    def primary_of(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot now."""
        slot = self.nodes[0].cli("CLUSTER", "KEYSLOT", key).strip()
        for node in self.nodes:
            if not node.answering:
                continue
            role = node.cli("ROLE").split()[0]
            if role != "master":
                continue
            for line in node.cli("CLUSTER", "NODES").splitlines():
                fields = line.split()
                if "myself" in fields[2]:
                    for span in fields[8:]:
                        low, _, high = span.partition("-")
                        if low.isdigit() and int(low) <= int(slot) <= int(high or low):
                            return node
        raise RuntimeError(f"no primary serves the slot of {key!r}")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


class RedisSentinels:
    """A primary, one replica, and three Sentinels monitoring them as ``mymaster`` (quorum 2)."""

    MASTER = "mymaster"

    def __init__(self, workdir: Path) -> None:
        self.primary = RedisServer(workdir / "primary")
        self.replica = RedisServer(workdir / "replica")  # --replicaof is set at start
        self.sentinels = [RedisServer(workdir / f"sentinel{i}", sentinel=True) for i in range(3)]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.MASTER}/0"

    def start(self) -> None:
        self.primary.start()
        self.replica.extra = ["--replicaof", "127.0.0.1", str(self.primary.port)]
        self.replica.start()
        for sentinel in self.sentinels:
            sentinel.extra = [
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} 2",
                f"sentinel down-after-milliseconds {self.MASTER} {NODE_TIMEOUT_MS}",
                f"sentinel failover-timeout {self.MASTER} 10000",
                f"sentinel parallel-syncs {self.MASTER} 1",
            ]
            sentinel.start()
        self.wait_replicated()
        _wait(self._sentinels_agree, "the Sentinels did not all see the replica")

    def _sentinels_agree(self) -> object:
        for sentinel in self.sentinels:
            if not sentinel.answering:
                continue
            info = sentinel.cli("SENTINEL", "MASTER", self.MASTER)
            lines = info.splitlines()
            fields = dict(zip(lines[::2], lines[1::2], strict=False))
            if fields.get("num-slaves") != "1" or fields.get("num-other-sentinels") != "2":
                return fields.get("num-other-sentinels")
        return True

    def current_primary(self) -> RedisServer:
        """The server the Sentinels name now."""
        for sentinel in self.sentinels:
            if not sentinel.answering:
                continue
            port = int(sentinel.cli("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.MASTER).split()[1])
            return next(s for s in (self.primary, self.replica) if s.port == port)
        raise RuntimeError("no Sentinel runs")

    def wait_replicated(self) -> None:
        def linked() -> object:
            info = self.replica.cli("INFO", "replication")
            return "master_link_status:up" in info or info

        _wait(linked, "the replica did not sync with its primary")

    def wait_replicated_to(self, primary: RedisServer) -> None:
        """Until ``primary`` has a replica in sync."""

        def synced() -> object:
            info = primary.cli("INFO", "replication")
            return ("role:master" in info and "state=online" in info) or info

        _wait(synced, "the primary got no replica in sync")

    def wait_failed_over(self, old: RedisServer) -> RedisServer:
        """Until a Sentinel names a primary other than ``old``, which it returns."""

        def moved() -> object:
            return self.current_primary() is not old

        _wait(moved, "the Sentinels did not fail over")
        return self.current_primary()

    def stop(self) -> None:
        for server in [*self.sentinels, self.replica, self.primary]:
            server.kill()
