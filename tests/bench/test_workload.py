from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from carryover.bench.workload import Distribution, WorkloadSpec, generate, read_conversations


def test_distributions() -> None:
    rng = random.Random(1)
    assert {Distribution("constant", 7).sample(rng) for _ in range(10)} == {7}
    uniform = [Distribution("uniform", low=10, high=20).sample(rng) for _ in range(2000)]
    assert min(uniform) >= 10 and max(uniform) <= 20 and 14 <= statistics.mean(uniform) <= 16
    lognormal = [Distribution("lognormal", 300, sigma=0.5).sample(rng) for _ in range(4000)]
    assert 270 <= statistics.median(lognormal) <= 330
    assert Distribution.parse("uniform:1:5") == Distribution("uniform", low=1, high=5)
    assert Distribution.parse("lognormal:400:0.6") == Distribution("lognormal", 400, sigma=0.6)
    assert Distribution.parse("12") == Distribution("constant", 12)
    assert Distribution("constant", 0).sample(rng, minimum=0) == 0


def test_generation_is_seeded_and_reproducible() -> None:
    spec = WorkloadSpec(
        conversations=8,
        turns=4,
        reasoning_share=0.5,
        edit_probability=0.5,
        arrival="poisson",
        seed=3,
    )
    a, b = generate(spec), generate(spec)
    assert [(c.users, c.output_tokens, c.thinking, c.edits, c.start_after) for c in a] == [
        (c.users, c.output_tokens, c.thinking, c.edits, c.start_after) for c in b
    ]
    other = generate(WorkloadSpec(conversations=8, turns=4, seed=4))
    assert [c.users for c in other] != [c.users for c in a]
    assert all(len(c.users) == 4 for c in a)
    assert any(c.thinking for c in a) and not all(c.thinking for c in a)
    assert all(0 <= earlier < turn for c in a for turn, earlier in c.edits.items())
    starts = [c.start_after for c in a]
    assert starts == sorted(starts) and starts[0] > 0


def test_user_message_lengths_follow_the_distribution() -> None:
    convs = generate(
        WorkloadSpec(conversations=2, turns=2, user_tokens=Distribution("constant", 50))
    )
    for c in convs:
        for text in c.users:
            assert len(text.split()) == 50 + 1  # the "[i.t]" tag plus 50 words


def test_reads_vllm_and_sharegpt_formats(tmp_path: Path) -> None:
    vllm = tmp_path / "gen.json"
    vllm.write_text(
        json.dumps(
            [
                {
                    "id": "a",
                    "messages": [
                        {"role": "system", "content": "sys"},
                        {"role": "user", "content": "u1"},
                        {"role": "assistant", "content": "x"},
                        {"role": "user", "content": "u2"},
                    ],
                }
            ]
        )
    )
    share = tmp_path / "sharegpt.json"
    share.write_text(
        json.dumps(
            [
                {
                    "id": "b",
                    "conversations": [
                        {"from": "human", "value": "h1"},
                        {"from": "gpt", "value": "g"},
                        {"from": "human", "value": "h2"},
                    ],
                }
            ]
        )
    )
    [a] = read_conversations(vllm, output_tokens=9)
    assert (a.id, a.system, a.users, a.output_tokens) == ("a", "sys", ["u1", "u2"], [9, 9])
    [b] = read_conversations(share)
    assert (b.id, b.users) == ("b", ["h1", "h2"])


def test_the_long_overhead_mode_is_one_conversation_growing_by_a_tool_result_a_turn() -> None:
    from carryover.bench.overhead import LONG, jobs_for

    [job] = jobs_for(LONG, 28, conversation=True)
    assert job.path == "/v1/chat/completions" and "conversation_id" in job.body
    assert len(job.follow_ups) == 27
    # About 800 tokens each (a word is a token or so here): turn 28 past 20k.
    assert all(700 <= len(text.split()) <= 900 for text in job.follow_ups)
    assert len({*job.follow_ups}) == 27
    assert jobs_for(LONG, 28, conversation=False)[0].body.get("conversation_id") is None
