"""Each tenant's ``cache_salt``: the engines' prefix caches, the warm tier and the KV index
never match one tenant's blocks for another's prompt (docs/security.md).

vLLM hashes ``cache_salt`` into a prompt's first block key (``vllm/v1/core/kv_cache_utils.py``,
``generate_block_hash_extra_keys``), so blocks are shared only between requests of the same
salt; LMCache keys by it too (vLLM 0.33 ``lmcache_mp_connector.py``). The router sets the salt
of every request it sends to a keyed hash of the tenant and the client's own salt: a client
cannot pick another tenant's salt, and a client salt still separates users inside a tenant.
The salt changes only which cached blocks a request may hit, never the KV values, so a
conversation's handle is unaffected.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path
from typing import Any

import msgspec

from carryover.router.config import ConfigError, RouterConfig
from carryover.router.errors import BadRequest

__all__ = ["CacheSalts", "check_client_salt", "salts_of"]

# vLLM's own limits (vllm/entrypoints/generate/base/protocol.py, validate_cache_salt).
_MAX_SALT = 128
_FORBIDDEN = frozenset("@/\\\0")

_encode = msgspec.json.Encoder().encode


def check_client_salt(value: Any) -> str | None:
    """The client's ``cache_salt``, refused where vLLM would refuse it."""
    if value is None:
        return None
    if (
        not isinstance(value, str)
        or not value
        or len(value) > _MAX_SALT
        or any(c in _FORBIDDEN for c in value)
    ):
        raise BadRequest(
            "cache_salt must be a non-empty string of at most 128 characters without "
            "'@', '/', '\\' or NUL",
            param="cache_salt",
        )
    return value


class CacheSalts:
    """``shared``: tenants share the caches on purpose (the client's salt goes as sent)."""

    def __init__(self, key: bytes, *, shared: bool) -> None:
        self._key = key
        self.shared = shared

    def log_id(self, tenant: str, conversation_id: str) -> str:
        """How logs and spans name a conversation: keyed, so a log reader cannot test a
        guessed id against it, and stable across replicas sharing the key."""
        message = _encode(("conversation", tenant, conversation_id))
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:16]

    def of(self, tenant: str, client_salt: str | None) -> str | None:
        if self.shared:
            return client_salt
        # The pair is encoded unambiguously: no tenant and salt can pass for another pair.
        message = _encode((tenant, client_salt))
        return "t" + hmac.new(self._key, message, hashlib.sha256).hexdigest()[:40]


#: The key when no ``cache_salt_key_file`` is set: salts still differ per tenant.
_DEFAULT_KEY = b"carryover cache salt"


def salts_of(config: RouterConfig) -> CacheSalts:
    """The salts of a router process; it reads the key file itself (never passed in the
    environment)."""
    key = _DEFAULT_KEY
    if config.cache_salt_key_file:
        try:
            key = Path(config.cache_salt_key_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cache_salt_key_file: {exc.strerror}") from exc
        if not key:
            raise ConfigError("cache_salt_key_file is empty")
    return CacheSalts(key, shared=config.shared_cache)
