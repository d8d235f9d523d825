"""Engine bodies of the tokens-only pipeline."""

from __future__ import annotations

from typing import Any

from carryover.router.tokens.legs import decode_request, mend_rendered, prefill_request


def _rendered(**sampling: Any) -> dict[str, Any]:
    return {"token_ids": [1, 2, 3], "sampling_params": {"temperature": 0.0, **sampling}}


def test_a_limit_equal_to_vllm_s_default_is_put_back() -> None:
    # The render server drops max_tokens == 16 (SamplingParams' default); the generate
    # server would then run to the end of the context.
    mended = mend_rendered(_rendered(), {"max_tokens": 16})
    assert mended["sampling_params"]["max_tokens"] == 16
    assert (
        mend_rendered(_rendered(), {"max_completion_tokens": 16})["sampling_params"]["max_tokens"]
        == 16
    )
    assert "max_tokens" not in mend_rendered(_rendered(), {})["sampling_params"]
    assert (
        mend_rendered(_rendered(max_tokens=40), {"max_tokens": 16})["sampling_params"]["max_tokens"]
        == 40
    )  # what the server resolved stands


def test_p_computes_one_token_and_d_gets_p_s_dict_verbatim() -> None:
    rendered = _rendered(max_tokens=30, logprobs=2, n=2, min_tokens=5)
    p_body = prefill_request(rendered, {"do_remote_decode": True})
    assert p_body["sampling_params"] == {"temperature": 0.0, "max_tokens": 1}
    assert p_body["stream"] is False and p_body["token_ids"] == [1, 2, 3]
    params = {"do_remote_prefill": True, "remote_host": "10.0.0.9"}
    d_body = decode_request(rendered, params, stream=True)
    assert d_body["kv_transfer_params"] == params and d_body["stream"] is True
    assert d_body["sampling_params"]["max_tokens"] == 30 and d_body["return_token_ids"]
    assert rendered["sampling_params"]["max_tokens"] == 30  # the rendered request is not changed
    alone = decode_request(rendered, None, stream=False)
    assert alone["kv_transfer_params"] == {"do_remote_prefill": False}
