"""API keys to tenants. Keys are compared in constant time and never logged."""

from __future__ import annotations

import hmac

from carryover.router.errors import Unauthorized

__all__ = ["DEFAULT_TENANT", "Authenticator"]

DEFAULT_TENANT = "default"


def _bearer(header: str | None) -> str | None:
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Authenticator:
    """``private_metrics``: ``/metrics`` is the operators' (api keys are set, or the router
    listens beyond loopback): it names tenants and every engine's address."""

    def __init__(
        self, api_keys: dict[str, str], admin_key: str | None, *, private_metrics: bool = False
    ) -> None:
        self._keys = [(key.encode(), tenant) for key, tenant in api_keys.items()]
        self._admin = admin_key.encode() if admin_key else None
        self._private_metrics = private_metrics

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: str | None) -> str:
        """The tenant of a request (``default`` when keys are off); 401 otherwise."""
        if not self._keys:
            return DEFAULT_TENANT
        token = _bearer(authorization)
        if token is None:
            raise Unauthorized("missing bearer API key")
        presented = token.encode()
        found: str | None = None
        for key, tenant in self._keys:  # every key is compared: no early exit to time
            if hmac.compare_digest(presented, key):
                found = tenant
        if found is None:
            raise Unauthorized("invalid API key")
        return found

    def admin(self, authorization: str | None) -> None:
        token = _bearer(authorization)
        if (
            self._admin is None
            or token is None
            or not hmac.compare_digest(token.encode(), self._admin)
        ):
            raise Unauthorized("admin key required")

    def metrics(self, authorization: str | None) -> None:
        """``/metrics``: open on a loopback listener without api keys, else the admin key's."""
        if self._private_metrics:
            self.admin(authorization)
