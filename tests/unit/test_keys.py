from __future__ import annotations

import pytest

from carryover.state import MAX_ID_LENGTH, ConversationKey, InvalidIdentifier, validate_identifier


@pytest.mark.parametrize(
    "bad", ["", " ", "a b", "a\tb", "a\nb", "x" * (MAX_ID_LENGTH + 1), "\x00", 5, None]
)
def test_bad_identifiers_are_refused(bad: object) -> None:
    with pytest.raises(InvalidIdentifier):
        validate_identifier(bad)
    assert issubclass(InvalidIdentifier, ValueError)


def test_good_identifiers_pass() -> None:
    for good in ["c1", "x" * MAX_ID_LENGTH, "ünïcode-ok", "a:b%c"]:
        assert validate_identifier(good) == good


def test_key_layout_and_injectivity() -> None:
    key = ConversationKey("acme", "Qwen/Qwen3-8B", "conv-1")
    assert key.storage_key() == "carryover:acme:Qwen/Qwen3-8B:conv-1"
    # A ':' in a model name must not let two different triples share a key.
    a = ConversationKey("t", "m:x", "c").storage_key()
    b = ConversationKey("t", "m", "x:c").storage_key()
    assert a != b
    assert ConversationKey("t", "m%3Ax", "c").storage_key() != a


def test_key_validates_its_parts() -> None:
    with pytest.raises(InvalidIdentifier):
        ConversationKey("tenant", "model", "has space")
