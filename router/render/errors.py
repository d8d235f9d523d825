"""What rendering raises, whichever backend renders."""

from __future__ import annotations

__all__ = ["RenderDeclined", "RenderFailed", "RenderInputError"]


class RenderFailed(Exception):
    """The backend could not render (unreachable, or an answer without ids)."""


class RenderDeclined(RenderFailed):
    """This process cannot render the request exactly as vLLM would (``messages.py``,
    ``chat_template.py``): the engine renders it; with no engine to ask, the turn runs
    unchecked."""


class RenderInputError(ValueError):
    """Messages the template cannot render (bad roles, contents, or template errors)."""
