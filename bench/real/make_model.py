"""Write a tiny Qwen3 with seeded random weights whose output depends on its context.

Run with the vLLM environment's python (it needs torch and safetensors):
``<vllm env>/bin/python bench/real/make_model.py OUT_DIR TOKENIZER_DIR``.

``--load-format dummy`` is useless for correctness tests: its weights are so small that every
logprob is ln(1/vocab) and greedy output ignores the prompt (``docs/vllm-protocol.md`` §7).
These weights follow the recipe that worked there: N(0, 1) embeddings, linear layers
N(0, 1/fan_in) with o_proj x3 and down_proj x2, q_norm weight 2.5, untied lm_head.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, LAYERS, VOCAB = 64, 2, 1, 64, 128, 2, 151936

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": INTERMEDIATE,
    "max_position_embeddings": 4096,
    "max_window_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": KV_HEADS,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "5.19.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB,
}


def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
    return torch.randn(out_features, in_features) * (gain / in_features**0.5)


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        prefix = f"model.layers.{i}"
        tensors |= {
            f"{prefix}.self_attn.q_proj.weight": linear(HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.k_proj.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.v_proj.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.o_proj.weight": linear(HIDDEN, HEADS * HEAD_DIM, gain=3.0),
            f"{prefix}.self_attn.q_norm.weight": torch.full((HEAD_DIM,), 2.5),
            f"{prefix}.self_attn.k_norm.weight": torch.ones(HEAD_DIM),
            f"{prefix}.mlp.gate_proj.weight": linear(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.up_proj.weight": linear(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.down_proj.weight": linear(HIDDEN, INTERMEDIATE, gain=2.0),
            f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    tensors["model.norm.weight"] = torch.ones(HIDDEN)
    tensors["lm_head.weight"] = linear(VOCAB, HIDDEN)
    return {name: t.contiguous() for name, t in tensors.items()}


def main(out: Path, tokenizer_dir: Path) -> None:
    if (out / "model.safetensors").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(tokenizer_dir / name, out / name)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": False})
    )
    partial = out / "model.safetensors.partial"
    save_file(weights(), str(partial), metadata={"format": "pt"})
    partial.rename(out / "model.safetensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
