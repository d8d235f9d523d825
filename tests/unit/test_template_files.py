"""Chat templates rendered with what ``transformers`` and vLLM give them: the special tokens,
``raise_exception``, ``tojson``'s options, ``chat_template.jinja`` and named templates, and
vLLM's developer role rule; what the router cannot render exactly goes to P."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from carryover.router.render.chat_template import ChatTemplate, bundled_qwen3_dir
from carryover.router.render.messages import RenderDeclined, RenderInputError
from tests.support.tokenizers import metaspace_tokenizer

HI = [{"role": "user", "content": "hi"}]


def folder(tmp_path: Path, config: dict[str, Any], files: dict[str, str] | None = None) -> Path:
    """A model folder with Qwen3's tokenizer, ``config`` as its tokenizer_config.json and
    ``files`` (relative path: text)."""
    shutil.copy(bundled_qwen3_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_special_tokens_reach_the_template_as_strings(tmp_path: Path) -> None:
    template = ChatTemplate(
        folder(
            tmp_path,
            {
                "bos_token": {"__type": "AddedToken", "content": "<|endoftext|>"},
                "eos_token": "<|im_end|>",
                "pad_token": None,
                "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}"
                "{{ eos_token }}{% endfor %}{{ pad_token is defined }}",
            },
        )
    )
    assert template.render_text(HI) == "<|endoftext|>hi<|im_end|>False"
    assert template.eos_token == "<|im_end|>"


def test_a_special_token_the_files_do_not_set_sends_the_turn_to_p(tmp_path: Path) -> None:
    """The tokenizer's class may give it a default the router cannot know."""
    template = ChatTemplate(folder(tmp_path, {"chat_template": "{{ bos_token }}x"}))
    with pytest.raises(RenderDeclined, match="bos_token"):
        template.render_text(HI)


def test_legacy_special_tokens_map_sets_what_the_config_does_not(tmp_path: Path) -> None:
    legacy = {"bos_token": {"content": "B"}, "eos_token": "ignored"}
    path = folder(
        tmp_path,
        {"chat_template": "{{ bos_token }}|{{ eos_token }}", "eos_token": "E"},
        {"special_tokens_map.json": json.dumps(legacy)},
    )
    assert ChatTemplate(path).render_text(HI) == "B|E"


def test_raise_exception_is_a_client_error_with_the_template_s_message(tmp_path: Path) -> None:
    source = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    template = ChatTemplate(folder(tmp_path, {"chat_template": source}))
    assert template.render_text(HI) == "ok"
    with pytest.raises(RenderInputError, match="user first"):
        template.render_text([{"role": "system", "content": "s"}, *HI])


def test_tojson_takes_transformers_options(tmp_path: Path) -> None:
    source = "{{ tools[0] | tojson(indent=4) }}|{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=true) }}"
    template = ChatTemplate(folder(tmp_path, {"chat_template": source}))
    tool = {"type": "function", "function": {"name": "f"}}
    text = template.render_text(HI, tools=[tool])
    dumped = {
        "type": "function",
        "function": {"name": "f", "description": None, "parameters": None},
    }
    assert text == json.dumps(dumped, indent=4) + '|{"a": "é", "b": 1}'


def test_a_date_reading_template_renders_on_p(tmp_path: Path) -> None:
    source = "{% if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y') %}"
    source += "{% endif %}Today {{ date_string }}"
    template = ChatTemplate(folder(tmp_path, {"chat_template": source}))
    with pytest.raises(RenderDeclined, match="date"):
        template.render_text(HI)
    # A client that sets the date itself renders in process.
    assert template.render_text(HI, chat_template_kwargs={"date_string": "1 Jan 2026"}) == (
        "Today 1 Jan 2026"
    )


def test_template_files_take_priority_and_tools_choose_the_tool_use_one(tmp_path: Path) -> None:
    path = folder(
        tmp_path,
        {"chat_template": "from the config"},
        {
            "chat_template.jinja": "default",
            "additional_chat_templates/tool_use.jinja": "tools: {{ tools | length }}",
        },
    )
    template = ChatTemplate(path)
    assert template.render_text(HI) == "default"
    tool = {"type": "function", "function": {"name": "f"}}
    assert template.render_text(HI, tools=[tool]) == "tools: 1"


def test_named_templates_in_the_config(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "plain"}, {"name": "rag", "template": "rag"}]
    assert ChatTemplate(folder(tmp_path, {"chat_template": named})).render_text(HI) == "plain"


def test_named_templates_without_a_default_render_on_p(tmp_path: Path) -> None:
    named = [{"name": "rag", "template": "rag"}]
    with pytest.raises(RenderDeclined, match="default"):
        ChatTemplate(folder(tmp_path, {"chat_template": named})).render_text(HI)


def test_a_model_with_a_processor_renders_on_p(tmp_path: Path) -> None:
    path = folder(tmp_path, {"chat_template": "x"}, {"processor_config.json": "{}"})
    with pytest.raises(RenderDeclined, match="processor"):
        ChatTemplate(path).render_text(HI)


def test_kwargs_that_change_how_vllm_tokenizes_render_on_p() -> None:
    with pytest.raises(RenderDeclined):
        ChatTemplate.qwen3().render_text(HI, chat_template_kwargs={"truncation": True})


def test_documents_is_defined_and_none_as_transformers_passes_it(tmp_path: Path) -> None:
    source = "{{ documents is defined }} {{ documents is none }}"
    assert ChatTemplate(folder(tmp_path, {"chat_template": source})).render_text(HI) == (
        "True True"
    )


def test_developer_messages_become_one_first_system_message_where_the_template_lacks_the_role() -> (
    None
):
    """vLLM 0.32 (vllm/renderers/hf.py, ``safe_apply_chat_template``): Qwen3's template does
    not name the developer role, so developer messages become system ones, and every system
    message's non-empty content is merged into one, first, joined by a blank line."""
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "developer", "content": "D"},
        {"role": "system", "content": ""},
    ]
    expected = [
        {"role": "system", "content": "S\n\nD"},
        {"role": "user", "content": "hi"},
    ]
    qwen3 = ChatTemplate.qwen3()
    assert qwen3.render_text(messages) == qwen3.render_text(expected)


def test_a_template_that_names_the_developer_role_gets_it(tmp_path: Path) -> None:
    source = "{% for m in messages %}{% if m.role == 'developer' %}dev:{% endif %}"
    source += "{{ m.role }}={{ m.content }};{% endfor %}"
    template = ChatTemplate(folder(tmp_path, {"chat_template": source}))
    messages = [{"role": "developer", "content": "D"}, *HI]
    assert template.render_text(messages) == "dev:developer=D;user=hi;"


def test_a_template_that_does_not_compile_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="compile"):
        ChatTemplate(folder(tmp_path, {"chat_template": "{% if %}"}))


@pytest.mark.parametrize("scheme", ["first", "always", "legacy"])
def test_a_sentencepiece_model_renders_chats_without_and_text_prompts_with_its_bos(
    tmp_path: Path, scheme: str
) -> None:
    """vLLM encodes a rendered chat without the tokenizer's special tokens (the template
    writes ``bos_token``) and a completions prompt with them (``add_special_tokens``
    defaults to true there): a Llama 2 or Mistral tokenizer adds ``<s>`` to the second."""
    tokenizer = metaspace_tokenizer(scheme)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    rendered = ChatTemplate(tmp_path, fast_spans=True)
    chat = [{"role": "user", "content": "Hello world"}, {"role": "user", "content": "fox"}]
    text = "<s>[INST] Hello world [/INST][INST] fox [/INST]"
    assert rendered.render_text(chat) == text
    assert rendered.render(chat) == tokenizer.encode(text, add_special_tokens=False).ids
    for prompt in ("Hello world", " fox\n12", "[INST] Hello"):
        assert rendered.encode_prompt(prompt) == tokenizer.encode(prompt).ids
        assert rendered.encode_prompt(prompt)[0] == tokenizer.token_to_id("<s>")
