"""Write a tiny model of one family with seeded random weights whose output depends on its
context: its weights, its config and its tokenizer files with a chat template.

Run with the vLLM environment's python (it needs torch, safetensors, transformers and
mistral_common): ``<vllm env>/bin/python bench/real/make_model.py FAMILY OUT_DIR [QWEN3_DIR]``.

- ``qwen3``: Qwen3ForCausalLM with Qwen3's tokenizer files (``QWEN3_DIR``) and template.
- ``llama2``: LlamaForCausalLM with a SentencePiece tokenizer (Mistral 7B v0.1's 32,000
  pieces, shipped in ``mistral_common``, converted by ``transformers`` as for Llama 2:
  Metaspace, byte fallback, a BOS on completions prompts) and Llama 2's chat format.
- ``mistral``: MistralForCausalLM with a tekken tokenizer (byte-level BPE of 131,072 ids
  whose first 1,000 are control tokens, converted by ``transformers``) and Mistral's
  instruct format with tools.

The templates are ``templates/<family>.jinja`` beside this script.

``--load-format dummy`` is useless for correctness tests: its weights are so small that every
logprob is ln(1/vocab) and greedy output ignores the prompt (``docs/vllm-protocol.md`` §7).
These weights follow the recipe that worked there: N(0, 1) embeddings, linear layers
N(0, 1/fan_in) with o_proj x3 and down_proj x2, q_norm weight 2.5 (without q_norm, q_proj
x2.5), untied lm_head.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS = 64, 2, 1, 64, 128, 2

_COMMON: dict[str, Any] = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": INTERMEDIATE,
    "max_position_embeddings": 4096,
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": KV_HEADS,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "5.19.0",
    "use_cache": True,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "max_window_layers": LAYERS,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "llama2": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_theta": 10000.0,
        "vocab_size": 32000,
    },
    "mistral": {
        **_COMMON,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "vocab_size": 131072,
    },
}


def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(out_features, in_features) * (gain / in_features**0.5)


def weights(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    vocab = CONFIGS[family]["vocab_size"]
    qk_norm = family == "qwen3"
    torch.manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN)}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}"
        q_gain = 1.0 if qk_norm else 2.5
        tensors |= {
            f"{prefix}.self_attn.q_proj.weight": linear(HEADS * HEAD_DIM, HIDDEN, gain=q_gain),
            f"{prefix}.self_attn.k_proj.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.v_proj.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.o_proj.weight": linear(HIDDEN, HEADS * HEAD_DIM, gain=3.0),
            f"{prefix}.mlp.gate_proj.weight": linear(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.up_proj.weight": linear(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.down_proj.weight": linear(HIDDEN, INTERMEDIATE, gain=2.0),
            f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
        if qk_norm:
            tensors[f"{prefix}.self_attn.q_norm.weight"] = torch.full((HEAD_DIM,), 2.5)
            tensors[f"{prefix}.self_attn.k_norm.weight"] = torch.ones(HEAD_DIM)
    tensors["model.norm.weight"] = torch.ones(HIDDEN)
    tensors["lm_head.weight"] = linear(vocab, HIDDEN)
    return {name: t.contiguous() for name, t in tensors.items()}


def _template(family: str) -> str:
    return (Path(__file__).parent / "templates" / f"{family}.jinja").read_text()


def _mistral_common_data() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data"


def write_tokenizer(family: str, out: Path, qwen3_dir: Path | None) -> None:
    if family == "qwen3":
        assert qwen3_dir is not None, "qwen3 takes the folder of its tokenizer files"
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
            shutil.copy(qwen3_dir / name, out / name)
        return
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if family == "llama2":
        from transformers import AutoTokenizer

        source = out / "sentencepiece"
        source.mkdir(exist_ok=True)
        shutil.copy(_mistral_common_data() / "tokenizer.model.v1", source / "tokenizer.model")
        settings = {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True}
        settings |= specials
        (source / "tokenizer_config.json").write_text(json.dumps(settings))
        AutoTokenizer.from_pretrained(str(source)).backend_tokenizer.save(
            str(out / "tokenizer.json")
        )
        shutil.rmtree(source)
        config = {"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True}
    else:
        from tokenizers import processors
        from transformers.integrations.mistral.tokenizer import MistralConverter

        tokenizer = MistralConverter(str(_mistral_common_data() / "tekken_240911.json")).converted()
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
        )
        tokenizer.save(str(out / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    config |= {**specials, "model_max_length": 4096, "chat_template": _template(family)}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def main(family: str, out: Path, qwen3_dir: Path | None) -> None:
    if (out / "model.safetensors").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    config = CONFIGS[family]
    write_tokenizer(family, out, qwen3_dir)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    eos = config["eos_token_id"]
    eos_ids = [eos, config["bos_token_id"]] if family == "qwen3" else eos
    (out / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids, "do_sample": False}
        )
    )
    partial = out / "model.safetensors.partial"
    save_file(weights(family), str(partial), metadata={"format": "pt"})
    partial.rename(out / "model.safetensors")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None)
