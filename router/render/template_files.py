"""A model folder's chat templates and special tokens, found as ``transformers`` (v5, which
vLLM 0.32 runs) finds them, and the template a request renders with.

- Templates: ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` take priority
  over the ``chat_template`` entry of ``tokenizer_config.json``, a string or a list of named
  templates (``tokenization_utils_base.py``, ``_from_pretrained``). A request with tools
  renders with the ``tool_use`` template where there is one, else with ``default``
  (``get_chat_template``).
- Special tokens: the named ones (``bos_token`` ... ``mask_token``) reach every template as
  strings (``special_tokens_map``), from ``tokenizer_config.json``, else the legacy
  ``special_tokens_map.json``. One neither file sets may still have a default in the
  tokenizer's class, which the router cannot know: a template that reads it renders on P
  (``chat_template.py``).
- A processor's files: vLLM may then render a request without tools with the processor's
  template (``vllm/renderers/hf.py``, ``_try_get_processor_chat_template``), so the router
  does not render such a model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "SPECIAL_TOKEN_NAMES",
    "TemplateFiles",
    "read_template_files",
]

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.json")


@dataclass(frozen=True)
class TemplateFiles:
    templates: dict[str, str]  # by name; a single template is "default"
    #: Named special tokens the files set (``None``: explicitly unset).
    special_tokens: dict[str, str | None]
    #: The folder holds a processor's files: vLLM may render with another template.
    processor: bool

    def template_for(self, tools: object) -> str | None:
        """The template a request with ``tools`` (``None``: none) renders with, as
        ``get_chat_template`` chooses; ``None`` when the model has no template to choose."""
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates.get("default")

    def special_token_variables(self) -> dict[str, str]:
        """What ``transformers`` passes a template of the special tokens."""
        return {k: v for k, v in self.special_tokens.items() if v is not None}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        value = value.get("content")
    return value if isinstance(value, str) else None


def _templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    files: dict[str, str] = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    extra = folder / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if files:
        return files
    entry = config.get("chat_template")
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list):
        return {
            t["name"]: t["template"]
            for t in entry
            if isinstance(t, dict)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str)
        }
    return {}


def read_template_files(folder: Path, config: dict[str, Any]) -> TemplateFiles:
    """``config``: the folder's ``tokenizer_config.json``, read."""
    legacy_path = folder / "special_tokens_map.json"
    legacy = json.loads(legacy_path.read_text()) if legacy_path.is_file() else {}
    special: dict[str, str | None] = {}
    for name in SPECIAL_TOKEN_NAMES:
        if name in config:
            special[name] = _token_text(config[name])
        elif name in legacy:
            special[name] = _token_text(legacy[name])
    return TemplateFiles(
        templates=_templates(folder, config),
        special_tokens=special,
        processor=any((folder / name).is_file() for name in _PROCESSOR_FILES),
    )
