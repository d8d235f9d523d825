"""The sandbox chat templates render in: Jinja's immutable sandbox, as in ``transformers``
and vLLM, with its per-access checks made cheaper where the answer cannot change.

A chat template comes with the model's files, so it runs sandboxed: no private attributes,
no method that mutates a list or dict. Jinja asks the sandbox on every attribute a template
reads (``message.role``, ``content.startswith``, ``loop.last``, ``ns.last_query_index``),
and for a 12-message Qwen3 chat those checks were half of the render (bench/RESULTS.md).
Two shortcuts, each giving exactly the answer Jinja's own code gives:

- a key of a plain ``dict`` read as an attribute is looked up as a key at once (Jinja tries
  the attribute first and reads the key after the ``AttributeError``; a ``dict`` has no
  attribute of that name);
- the verdict on an attribute of a built-in value or one of Jinja's own runtime objects is
  kept per (type, name): Jinja's checks look only at the object's type and the name.
"""

from __future__ import annotations

from typing import Any

from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

__all__ = ["ChatTemplateSandbox"]

_DICT_ATTRIBUTES = frozenset(dir(dict))
#: Types whose attributes' verdicts depend on (type, name) alone: built-in values and
#: Jinja's loop and namespace objects (no ABC registration can change what they are).
_FIXED_TYPES = frozenset(
    {str, dict, list, tuple, int, float, bool, type(None), LoopContext, Namespace}
)


class ChatTemplateSandbox(ImmutableSandboxedEnvironment):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        kind = type(obj)
        if kind not in _FIXED_TYPES:
            return super().is_safe_attribute(obj, attr, value)
        verdict = self._verdicts.get((kind, attr))
        if verdict is None:
            verdict = self._verdicts[kind, attr] = super().is_safe_attribute(obj, attr, value)
        return verdict

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self.undefined(obj=obj, name=attribute)
        return super().getattr(obj, attribute)
