"""The one error a configuration that cannot work raises, and how a key is described."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["ConfigError", "about"]


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which setting and why."""


def about(text: str, **extra: Any) -> msgspec.Meta:
    """A key's meaning (the flag's help and the reference's text), and how its flag and
    variable are named where the rule in ``keys.py`` does not fit: ``flag``, ``env``,
    ``secret`` (no flag: the environment or ``file``), ``file`` (the key of a file holding
    it), ``hidden`` (for tests and benchmarks: no help, not in the reference)."""
    return msgspec.Meta(description=" ".join(text.split()), extra=extra or None)
