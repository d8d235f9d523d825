"""Which Redis deployment a URL names: one server, a Sentinel-watched primary, or a Cluster.

* ``redis://[user:password@]host[:port][/db]``, ``rediss://…`` (TLS), ``unix:///path?db=N``:
  one server (or a fixed primary address behind a proxy).
* ``redis+sentinel://[user:password@]host1:26379,host2:26379/<master name>[/db]``
  (``rediss+sentinel://`` for TLS): the primary the Sentinels name; found again after a
  failover. The credentials are the data nodes'; Sentinels that need their own password take
  ``?sentinel_password=``.
* ``redis+cluster://[user:password@]host1:port,host2:port`` (``rediss+cluster://``): a Redis
  Cluster, found from any of the seed nodes; database 0 only, as Cluster has no other.

TLS options come from the query (``?ssl_ca_certs=…&ssl_certfile=…&ssl_keyfile=…``, redis-py's
names) or from the router's ``redis_options``; the query wins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, unquote, urlsplit

from carryover.state.resp import Address, RespChannel, Tls, redacted_url

if TYPE_CHECKING:
    from carryover.state.channel import Channel
    from carryover.state.redis_store import Durability, RedisStore

__all__ = ["RedisTarget", "Topology", "open_store", "parse_redis_url"]

_SINGLE_SCHEMES = {"redis", "rediss", "unix"}
_SENTINEL_PORT = 26379


class Topology(StrEnum):
    SINGLE = "single"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis URL.

    Attributes:
        topology: what kind of deployment.
        address: the one server (``SINGLE``); for the others, the template every data node's
            connection copies (credentials, database, TLS) with its own host and port.
        seeds: Sentinels (``SENTINEL``) or seed nodes (``CLUSTER``).
        master_name: the Sentinel-monitored primary's name.
        sentinel_password: the Sentinels' own ``requirepass``, when they have one.
    """

    topology: Topology
    address: Address
    seeds: tuple[tuple[str, int], ...] = ()
    master_name: str = ""
    sentinel_password: str | None = None

    def __repr__(self) -> str:  # never a password
        where = ",".join(f"{h}:{p}" for h, p in self.seeds) or repr(self.address)
        return f"RedisTarget({self.topology}, {where}, {self.master_name or '-'})"


def _hosts(netloc: str, default_port: int, url: str) -> tuple[tuple[str, int], ...]:
    hosts: list[tuple[str, int]] = []
    for item in netloc.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"an empty host in a Redis URL: {redacted_url(url)!r}")
        if item.startswith("["):  # [ipv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest.removeprefix(":")
        else:
            host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise ValueError(f"a Redis URL's port is a number: {redacted_url(url)!r}") from None
        hosts.append((host, port))
    return tuple(hosts)


def _db(text: str, url: str) -> int:
    try:
        return int(text or 0)
    except ValueError:
        raise ValueError(
            f"the database of a Redis URL is a number: {redacted_url(url)!r}"
        ) from None


def parse_redis_url(url: str, *, tls: Tls | None = None) -> RedisTarget:
    """Parse ``url``; ``tls`` gives TLS files the URL's query does not name."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a Redis URL: {redacted_url(url)!r}")
    base, _, kind = scheme.partition("+")
    query = parse_qs(urlsplit(url).query)
    if base in _SINGLE_SCHEMES and not kind:
        address = Address.from_url(url)
        return RedisTarget(Topology.SINGLE, _with_tls(address, query, url, tls))
    if base not in ("redis", "rediss") or kind not in ("sentinel", "cluster"):
        raise ValueError(
            "a Redis URL starts with redis://, rediss://, unix://, redis+sentinel:// or "
            f"redis+cluster://: {redacted_url(url)!r}"
        )
    parts = urlsplit(f"redis://{rest}")
    userinfo, _, netloc = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user_text, colon, password_text = userinfo.partition(":")
        username = unquote(user_text) or None
        password = unquote(password_text) if colon else None
    path = [piece for piece in parts.path.split("/") if piece]
    template = Address(username=username, password=password, tls=base == "rediss")
    if kind == "sentinel":
        if not path:
            raise ValueError(
                f"a Sentinel URL names the primary: …/<master name>[/db]: {redacted_url(url)!r}"
            )
        db = _db(query["db"][0] if "db" in query else (path[1] if len(path) > 1 else ""), url)
        sentinel_password = query["sentinel_password"][0] if "sentinel_password" in query else None
        return RedisTarget(
            Topology.SENTINEL,
            _with_tls(replace(template, db=db), query, url, tls),
            seeds=_hosts(netloc, _SENTINEL_PORT, url),
            master_name=unquote(path[0]),
            sentinel_password=sentinel_password,
        )
    if path or query.get("db", ["0"])[0] != "0":
        raise ValueError(f"Redis Cluster has database 0 only: {redacted_url(url)!r}")
    return RedisTarget(
        Topology.CLUSTER, _with_tls(template, query, url, tls), seeds=_hosts(netloc, 6379, url)
    )


def _with_tls(address: Address, query: dict[str, list[str]], url: str, tls: Tls | None) -> Address:
    given = tls or Tls()
    files = Tls(
        ca_file=query.get("ssl_ca_certs", [given.ca_file])[0],
        cert_file=query.get("ssl_certfile", [given.cert_file])[0],
        key_file=query.get("ssl_keyfile", [given.key_file])[0],
    )
    if files != Tls() and not address.tls:
        raise ValueError(
            f"TLS files are given for a plain-text Redis URL (use rediss://): {redacted_url(url)!r}"
        )
    return replace(address, tls_files=files)


#: Shards on a Cluster: 64 tags over the slot ranges keep each primary's share within a few
#: percent of even (state/slots.py); held reads cost one small script per shard.
CLUSTER_SHARDS = 64


def open_store(
    url: str,
    *,
    timeout: float = 0.25,
    namespace: str = "carryover",
    tls: Tls | None = None,
    password: str | None = None,
    shards: int | None = None,
    durability: Durability | None = None,
    wait_replicas: int = 1,
    wait_timeout: float = 0.05,
) -> RedisStore:
    """A :class:`~state.redis_store.RedisStore` on the deployment ``url`` names.

    ``password`` (from a secret file or the environment) is used when the URL has none.
    ``shards`` and ``durability`` default by topology: one shard and no waiting on a single
    server; on Sentinel and Cluster, ``WAIT`` for one replica (a claim a failover could undo
    is not used), and 64 shards on a Cluster.
    """
    from carryover.state.cluster import ClusterChannel
    from carryover.state.redis_store import Durability, RedisStore
    from carryover.state.sentinel import SentinelChannel

    target = parse_redis_url(url, tls=tls)
    address = target.address
    if password is not None and address.password is None:
        address = replace(address, password=password)
    timeouts = {"connect_timeout": timeout, "dead_after": max(1.0, 4 * timeout)}

    def channel() -> Channel:  # connects on first use
        if target.topology is Topology.SINGLE:
            return RespChannel(address, **timeouts)
        if target.topology is Topology.SENTINEL:
            return SentinelChannel(
                address,
                target.seeds,
                target.master_name,
                sentinel_password=target.sentinel_password,
                **timeouts,
            )
        return ClusterChannel(address, target.seeds, **timeouts)

    replicated = target.topology is not Topology.SINGLE
    return RedisStore(
        channel(),
        waited=channel(),
        timeout=timeout,
        namespace=namespace,
        shards=shards or (CLUSTER_SHARDS if target.topology is Topology.CLUSTER else 1),
        durability=durability or (Durability.REPLICA if replicated else Durability.NONE),
        wait_replicas=wait_replicas,
        wait_timeout=wait_timeout,
    )
