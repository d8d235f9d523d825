"""Runs inside the vLLM environment (not carryover's): reads chat requests as JSON lines on
stdin and writes, for each, what vLLM's own code hands the chat template: the messages after
its request model and chat preprocessing, and the tools as its model dumps them; or the
error it raises. With model folders as arguments, also the prompt's ids for each, rendered
and tokenized by vLLM's renderer (``vllm/renderers/hf.py``, ``safe_apply_chat_template``,
with the kwargs its online renderer builds) through ``transformers``. No engine, no model
weights: only vLLM's request parsing and rendering.

vLLM 0.32: ``vllm.renderers.chat_utils`` (``_parse_chat_message_content``,
``_postprocess_messages``); 0.33 moved them to ``vllm.renderers.chat_utils.chat_message``.
"""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace
from typing import Any

try:
    from vllm.renderers.chat_utils.chat_message import (  # type: ignore[import-not-found]
        _postprocess_messages,
        parse_chat_message_content,
    )
except ImportError:
    from vllm.renderers.chat_utils import (  # type: ignore[import-not-found,no-redef]
        _parse_chat_message_content as parse_chat_message_content,
    )
    from vllm.renderers.chat_utils import (  # type: ignore[import-not-found,no-redef]
        _postprocess_messages,
    )
try:
    from vllm.entrypoints.openai.chat_completion.protocol import (  # type: ignore[import-not-found]
        ChatCompletionRequest,
    )
except ImportError:
    from vllm.entrypoints.openai.protocol import (  # type: ignore[import-not-found,no-redef]
        ChatCompletionRequest,
    )


class _TextOnlyTracker:
    """The multimodal tracker a text-only chat never uses beyond a parser's two questions."""

    def create_parser(self, **_: Any) -> Any:
        return SimpleNamespace(
            model_config=SimpleNamespace(enable_prompt_embeds=False),
            mm_placeholder_storage=lambda: {},
        )


def prepare(body: dict[str, Any], content_format: str = "string") -> dict[str, Any]:
    request = ChatCompletionRequest.model_validate(body)
    conversation: list[Any] = []
    for message in request.messages:
        conversation.extend(
            parse_chat_message_content(
                message, _TextOnlyTracker(), content_format, interleave_strings=False
            )
        )
    _postprocess_messages(conversation)
    tools = None if request.tools is None else [tool.model_dump() for tool in request.tools]
    return {"messages": conversation, "tools": tools}


def render(body: dict[str, Any], prepared: dict[str, Any], folder: str, tokenizer: Any) -> Any:
    """The prompt's ids as vLLM's online renderer builds them (``preprocess_chat``, with the
    content format it detects in the template), or the error it raises."""
    from vllm.renderers.hf import (  # type: ignore[import-not-found]
        resolve_chat_template_content_format,
        safe_apply_chat_template,
    )

    model_config = SimpleNamespace(
        tokenizer=folder,
        model=folder,
        revision=None,
        tokenizer_revision=None,
        code_revision=None,
        trust_remote_code=False,
        hf_config=SimpleNamespace(model_type=None),
    )
    content_format = resolve_chat_template_content_format(
        None, prepared["tools"], "auto", tokenizer, model_config=model_config
    )
    if content_format != "string":
        try:
            prepared = prepare(body, content_format)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    request = ChatCompletionRequest.model_validate(body)
    kwargs = (
        request.build_chat_params(None, content_format)
        .with_defaults({"tools": prepared["tools"], "tokenize": False})
        .get_apply_chat_template_kwargs()
    )
    try:
        text = safe_apply_chat_template(
            model_config, tokenizer, copy.deepcopy(prepared["messages"]), **kwargs
        )
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return tokenizer.encode(text, add_special_tokens=False)


def main() -> None:
    from transformers import AutoTokenizer  # type: ignore[import-not-found]

    folders = sys.argv[1:]
    tokenizers = {f: AutoTokenizer.from_pretrained(f) for f in folders}
    for line in sys.stdin:
        body = json.loads(line)
        try:
            out: dict[str, Any] = prepare(body)
        except Exception as exc:  # what vLLM refuses, whatever its class
            out = {"error": f"{type(exc).__name__}: {exc}"}
        else:
            out["ids"] = {f: render(body, out, f, tokenizers[f]) for f in folders}
        sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
