"""Redis URLs read as redis-py reads them; the password never shows."""

from __future__ import annotations

import pytest

from state.resp import Address, pack


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
