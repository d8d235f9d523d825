"""Redis URLs read as redis-py reads them; the password never shows."""

from __future__ import annotations

import ssl

import pytest

from carryover.state.redis_url import Topology, parse_redis_url
from carryover.state.resp import Address, Arg, Tls, pack
from carryover.state.slots import SLOTS, key_slot, shard_tags


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6380/2", Address(port=6380, db=2)),
        ("redis://cache", Address(host="cache")),
        ("redis://:pw@cache:1/0", Address(host="cache", port=1, password="pw")),
        (
            "redis://carry:p%40ss%3Aw@cache/3",
            Address(host="cache", db=3, username="carry", password="p@ss:w"),
        ),
        ("rediss://cache:6390", Address(host="cache", port=6390, tls=True)),
        ("redis://cache/1?db=4", Address(host="cache", db=4)),
        ("unix:///run/redis.sock?db=5", Address(path="/run/redis.sock", db=5)),
        ("redis://[::1]:6379/0", Address(host="::1")),
    ],
)
def test_urls(url: str, expected: Address) -> None:
    assert Address.from_url(url) == expected


@pytest.mark.parametrize(
    "url", ["http://cache:6379", "redis://cache/zero", "unix://", "redis+sentinel://a/b"]
)
def test_urls_refused(url: str) -> None:
    with pytest.raises(ValueError):
        Address.from_url(url)


def test_the_password_stays_out_of_repr_and_setup_runs_auth_then_select() -> None:
    address = Address.from_url("redis://carry:s3cret@cache:1/2")
    assert "s3cret" not in repr(address) and "s3cret" not in str(address)
    assert address.setup() == [pack(["AUTH", "carry", "s3cret"]), pack(["SELECT", 2])]
    assert Address.from_url("redis://cache").setup() == []


def test_pack_is_a_resp_array_of_bulk_strings() -> None:
    assert pack(["SET", "k", b"\x00v", 12, 1.5]) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n\x00v\r\n$2\r\n12\r\n$3\r\n1.5\r\n"
    )


@pytest.mark.parametrize(
    "value", [0.1, 1e20, -0.0, float("inf"), 2**70, -5, "é", "", b"\xff", True]
)
def test_pack_writes_every_value_as_str_would(value: Arg) -> None:
    data = value if isinstance(value, bytes) else str(value).encode()
    assert pack(["SET", value]) == b"*2\r\n$3\r\nSET\r\n$%d\r\n%b\r\n" % (len(data), data)


@pytest.mark.parametrize(
    ("url", "topology", "seeds", "master", "db"),
    [
        (
            "redis+sentinel://s1:26379,s2:26380/mymaster/2",
            Topology.SENTINEL,
            (("s1", 26379), ("s2", 26380)),
            "mymaster",
            2,
        ),
        ("redis+sentinel://s1/main", Topology.SENTINEL, (("s1", 26379),), "main", 0),
        (
            "redis+cluster://n1:7000,[::1]:7001,n3",
            Topology.CLUSTER,
            (("n1", 7000), ("::1", 7001), ("n3", 6379)),
            "",
            0,
        ),
    ],
)
def test_sentinel_and_cluster_urls(
    url: str, topology: Topology, seeds: tuple[tuple[str, int], ...], master: str, db: int
) -> None:
    target = parse_redis_url(url)
    assert (target.topology, target.seeds, target.master_name, target.address.db) == (
        topology,
        seeds,
        master,
        db,
    )


def test_credentials_and_tls_reach_every_node_of_a_deployment_and_never_show() -> None:
    target = parse_redis_url(
        "rediss+cluster://carry:s3cr%40t@n1:7000?ssl_ca_certs=/ca.pem", tls=Tls(cert_file="/c")
    )
    node = target.address.at("n2", 7001)
    assert (node.host, node.port, node.username, node.password, node.tls) == (
        "n2",
        7001,
        "carry",
        "s3cr@t",
        True,
    )
    assert node.tls_files == Tls(ca_file="/ca.pem", cert_file="/c")  # the query wins per file
    assert "s3cr" not in repr(target) and "s3cr" not in repr(node)


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://s1:26379",  # no master name
        "redis+cluster://n1:7000/1",  # Cluster has database 0 only
        "redis+cluster://n1:x",
        "redis+replica://n1",
        "redis://cache?ssl_ca_certs=/ca.pem",  # TLS files for a plain-text URL
    ],
)
def test_deployment_urls_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_redis_url(url)


def test_key_slots_follow_the_cluster_specification() -> None:
    assert key_slot("123456789") == 0x31C3  # the specification's CRC16 test vector
    assert key_slot("foo") == 12182  # CLUSTER KEYSLOT foo
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
    assert key_slot("foo{}{bar}") == key_slot(b"foo{}{bar}")  # empty tag: whole key
    assert key_slot("foo{{bar}}zap") == key_slot("{bar")


def test_shard_tags_spread_evenly_over_the_slot_ranges() -> None:
    tags = shard_tags(64)
    slots = [key_slot("{" + tag + "}") for tag in tags]
    assert all(i * SLOTS // 64 <= slot < (i + 1) * SLOTS // 64 for i, slot in enumerate(slots))
    thirds = [
        sum(1 for slot in slots if k * SLOTS // 3 <= slot < (k + 1) * SLOTS // 3) for k in range(3)
    ]
    assert max(thirds) - min(thirds) <= 1  # three primaries with equal ranges: 21 or 22 each
    assert shard_tags(64) == tags  # every router computes the same


def test_sentinels_are_reached_with_the_data_nodes_tls_files() -> None:
    from carryover.state.sentinel import SentinelChannel

    ca = ssl.get_default_verify_paths().cafile
    assert ca is not None
    template = Address(tls=True, tls_files=Tls(ca_file=ca), password="node-pw")
    channel = SentinelChannel(template, [("s1", 26379)], "m", sentinel_password="sentinel-pw")
    sentinel = channel._sentinels[0].address
    assert (sentinel.tls, sentinel.tls_files, sentinel.password) == (
        True,
        Tls(ca_file=ca),
        "sentinel-pw",
    )
    channel.close()


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@127.0.0.1:1/x",
        "redis://user:s3cret@127.0.0.1:notaport/0",
        "redis+sentinel://:s3cret@127.0.0.1:1",
        "redis+cluster://:s3cret@127.0.0.1:1/2",
        "http://:s3cret@h:1",
        "redis+sentinel://h:1?sentinel_password=s3cret",
    ],
)
def test_a_refused_url_is_named_without_its_password(url: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_redis_url(url)
    assert "s3cret" not in str(refused.value)
