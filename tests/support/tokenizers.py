"""Small tokenizers of other families than Qwen3's, trained here in a few milliseconds: the
SentencePiece shape (Metaspace, a BOS token the post-processor adds) that Llama 2, Mistral
and Gemma ship, in each of its prepend schemes."""

from __future__ import annotations

from functools import cache

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]

_CORPUS = [
    "Hello world, how are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "user: hi\nassistant: hello there\n\tindented",
    "Numbers 12345 and symbols {}[]()<>!?",
]


@cache
def metaspace_tokenizer(prepend_scheme: str) -> Tokenizer:
    """A BPE over ``▁``-marked words with ``prepend_scheme`` ``first`` or ``always``, or
    ``legacy``: no pre-tokenizer, a normalizer that prepends ``▁`` (older Llama 2 files)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    if prepend_scheme == "legacy":
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme=prepend_scheme, split=False
        )
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIAL, show_progress=False)
    tokenizer.train_from_iterator(_CORPUS * 10, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return tokenizer
