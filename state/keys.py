"""Conversation keys and identifier validation.

A key names one conversation of one tenant on one model: ``carryover:{tenant}:{model}:{id}``.
Each part is escaped so that no two different triples map to the same key (a ``:`` inside a
model name cannot make one tenant's conversation collide with another's).
"""

from __future__ import annotations

import re

import msgspec

__all__ = [
    "MAX_ID_LENGTH",
    "ConversationKey",
    "InvalidIdentifier",
    "unescape",
    "validate_identifier",
]

MAX_ID_LENGTH = 256


class InvalidIdentifier(ValueError):
    """An identifier (conversation id, tenant, model) that cannot name state."""


#: What ``str.isspace`` calls whitespace: ``re``'s ``\s`` on a str pattern is the same set.
_WHITESPACE = re.compile(r"\s")


def validate_identifier(value: object, *, what: str = "conversation id") -> str:
    """Return ``value`` if it is a usable identifier, else raise :class:`InvalidIdentifier`.

    Usable means: a non-empty string of at most 256 printable characters with no whitespace.
    """
    if not isinstance(value, str):
        raise InvalidIdentifier(f"{what} must be a string")
    if not value:
        raise InvalidIdentifier(f"{what} must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdentifier(f"{what} is longer than {MAX_ID_LENGTH} characters")
    if not value.isprintable() or _WHITESPACE.search(value):
        raise InvalidIdentifier(f"{what} must be printable and contain no whitespace")
    return value


def _escape(part: str) -> str:
    # '%' first, so that an escaped ':' can never be confused with a literal "%3A".
    return part.replace("%", "%25").replace(":", "%3A")


def unescape(part: str) -> str:
    """A part of a storage key as it was named (the inverse of the escaping above)."""
    return part.replace("%3A", ":").replace("%25", "%")


class ConversationKey(msgspec.Struct, frozen=True):
    """Which conversation a record belongs to: tenant, model, the client's conversation id
    and the client's ``cache_salt`` (``salt``: a digest of it, empty without one). Every part
    that changes what a record's KV may be reused for is in the key: two salts of one
    conversation id are two conversations."""

    tenant: str
    model: str
    conversation_id: str
    salt: str = ""

    def __post_init__(self) -> None:
        validate_identifier(self.tenant, what="tenant")
        validate_identifier(self.model, what="model")
        validate_identifier(self.conversation_id)
        if self.salt:
            validate_identifier(self.salt, what="salt")

    def storage_key(self, namespace: str = "carryover") -> str:
        """The key under which stores keep this conversation's record (a salted one has a
        fifth part; the parts are escaped, so no key of four parts can pass for one of five)."""
        parts = [namespace, _escape(self.tenant), _escape(self.model)]
        parts.append(_escape(self.conversation_id))
        if self.salt:
            parts.append(_escape(self.salt))
        return ":".join(parts)
