"""The simulator tokenizes rendered prompts a piece between added tokens at a time, keeping
each piece's ids: the ids must be the whole text's, whatever the text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from carryover.bench.sim.chat import SimTemplate

_TEMPLATE = SimTemplate.qwen3()
_ADDED = [t.content for t in _TEMPLATE.tokenizer.get_added_tokens_decoder().values()]
# Text near the added tokens' spelling, where a wrong split would show: their fragments,
# whitespace that merges with neighbours, multi-byte characters.
_PIECES = st.sampled_from(
    [
        *_ADDED,
        "<|im",
        "_start|>",
        "<",
        "|",
        ">",
        "think",
        " ",
        "  ",
        "\n",
        "\n\n",
        "é",
        "😀",
        "a",
        "ab",
        " the",
        "'s",
        "1",
        "12",
        "\t",
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_PIECES, max_size=40))
def test_the_pieces_ids_are_the_whole_texts(pieces: list[str]) -> None:
    text = "".join(pieces)
    whole = _TEMPLATE.tokenizer.encode(text, add_special_tokens=False).ids
    assert _TEMPLATE.encode(text) == whole
    assert _TEMPLATE.encode(text) == whole  # again, from the pieces kept


def test_the_pieces_kept_are_bounded() -> None:
    template = SimTemplate.qwen3()
    template.PIECES_KEPT = 8
    for i in range(50):
        template.encode(f"<|im_start|>user\nmessage {i}<|im_end|>\n")
    assert len(template._pieces) <= 8
