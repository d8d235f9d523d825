"""Whether a chat template takes each message's content as a string or as a list of parts,
decided as vLLM decides it: by looking in the template's syntax tree for a loop over a
message's content (vLLM 0.32 ``vllm/renderers/hf.py``, ``_detect_content_format``, with
``--chat-template-content-format auto``, its default). A template whose tree holds such a loop
gets OpenAI's parts (``{"type": "text", "text": ...}``); any other gets one string.

The rules are vLLM's own heuristics, followed as they are, including where they guess: a loop
over a variable named ``content`` counts, as does one over a macro parameter that a call fills
with a message's content; assignments are followed breadth-first without scopes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from enum import StrEnum

from jinja2 import nodes

__all__ = ["ContentFormat", "content_format"]


class ContentFormat(StrEnum):
    STRING = "string"  #: the parts' texts joined into one string
    OPENAI = "openai"  #: a list of ``{"type": "text", "text": ...}`` parts


def content_format(tree: nodes.Template) -> ContentFormat:
    """The format vLLM detects for a template of this syntax tree."""
    try:
        found = next(_content_loops(tree), None)
    except Exception:  # vLLM falls back to its default, the string format
        return ContentFormat.STRING
    return ContentFormat.OPENAI if found is not None else ContentFormat.STRING


def _is_var(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: nodes.Node, name: str, key: str) -> bool:
    """``name[key]`` or ``name.key``."""
    if isinstance(node, nodes.Getitem):
        return (
            _is_var(node.node, name)
            and isinstance(node.arg, nodes.Const)
            and (node.arg.value == key)
        )
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` is ``name`` (or ``name.key``), through filters, tests and slices."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _aliases(tree: nodes.Template, name: str) -> Iterator[str]:
    """``name`` and every variable assigned from it, or from those, breadth-first."""
    yield name
    pending = deque([name])
    while pending:
        current = pending.popleft()
        for assign in tree.find_all(nodes.Assign):
            if _reads(assign.node, current):
                assert isinstance(assign.target, nodes.Name)
                yield assign.target.name
                if assign.target.name != current:
                    pending.append(assign.target.name)


def _message_loop_targets(tree: nodes.Template) -> Iterator[str]:
    """The loop variables of ``{% for message in messages %}`` and its aliases."""
    names = list(_aliases(tree, "messages"))
    for loop in tree.find_all(nodes.For):
        if any(_reads(loop.iter, name) for name in names):
            assert isinstance(loop.target, nodes.Name)
            yield loop.target.name


def _content_loops(tree: nodes.Template) -> Iterator[nodes.For]:
    """Loops over a message's content: ``message.content``, a variable named ``content``
    outside macros, or a macro parameter a call fills with a message's content."""
    messages = list(_message_loop_targets(tree))
    params_by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in tree.find_all(nodes.Macro):
        param_names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_reads(arg, m, "content") for m in messages):
                    params.add(macro.args[i].name)
            for keyword in call.kwargs:
                if (
                    isinstance(keyword, nodes.Keyword)
                    and keyword.key in param_names
                    and any(_reads(keyword.value, m, "content") for m in messages)
                ):
                    params.add(keyword.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    for loop in tree.find_all(nodes.For):
        if any(_reads(loop.iter, m, "content") for m in messages):
            found = True
        elif not isinstance(loop.iter, nodes.Name):
            found = False
        elif loop.iter.name in params_by_loop.get(id(loop), ()):
            found = True
        else:
            found = id(loop) not in in_macros and loop.iter.name == "content"
        if found:
            assert isinstance(loop.target, nodes.Name)  # vLLM's too: else its default
            yield loop
