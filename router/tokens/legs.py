"""Request bodies for tokens-only engines (``/inference/v1/generate``), built from the
``GenerateRequest`` the render server returned for the client's request.

The render server resolves the client's sampling fields into ``sampling_params`` (vLLM 0.32
``scale_out/render/serving.py``); P and D run exactly its ``token_ids``, the ids the router
checked, so nothing a client sends reaches an engine unchecked.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "GENERATE_PATH",
    "SAMPLING_DEFAULT_MAX_TOKENS",
    "capture_request",
    "decode_request",
    "mend_rendered",
    "prefill_request",
    "release_request",
]

GENERATE_PATH = "/inference/v1/generate"

# Sampling fields that make no sense on P's one token, and would cost it work (logprobs) or
# refuse the request (min_tokens > max_tokens).
_PREFILL_SAMPLING_DROP = ("min_tokens", "logprobs", "prompt_logprobs", "n", "best_of")


#: ``SamplingParams.max_tokens``'s default in vLLM.
SAMPLING_DEFAULT_MAX_TOKENS = 16


def mend_rendered(generate: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The render server's ``GenerateRequest``, with what it loses put back.

    It serializes ``sampling_params`` without the fields that equal ``SamplingParams``'
    defaults, so a request for exactly 16 tokens arrives without ``max_tokens``, and the
    generate server then applies its own default instead: the rest of the context (vLLM 0.32
    ``token_in_token_out/serving.py``, "Apply server-side max_tokens defaulting"). The
    client's limit goes back in."""
    sampling = generate.get("sampling_params")
    if isinstance(sampling, dict) and "max_tokens" not in sampling:
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(asked, int) and not isinstance(asked, bool):
            sampling["max_tokens"] = asked
    return generate


def prefill_request(generate: dict[str, Any], kv: dict[str, Any]) -> dict[str, Any]:
    sampling = {
        k: v for k, v in generate["sampling_params"].items() if k not in _PREFILL_SAMPLING_DROP
    }
    sampling["max_tokens"] = 1
    body = dict(generate)
    body["sampling_params"] = sampling
    body["stream"] = False
    body["stream_options"] = None
    body["return_token_ids"] = True  # the ids P ran: D's KV is computed from them
    body["kv_transfer_params"] = kv
    return body


def decode_request(
    generate: dict[str, Any], p_params: dict[str, Any] | None, *, stream: bool
) -> dict[str, Any]:
    body = dict(generate)
    # P's dict verbatim; no P: D computes alone and still returns a handle.
    body["kv_transfer_params"] = (
        dict(p_params) if p_params is not None else {"do_remote_prefill": False}
    )
    body["return_token_ids"] = True  # the ids D ran are the sequence its handle covers
    body["stream"] = stream
    return body


def capture_request(generate: dict[str, Any], sequence: list[int]) -> dict[str, Any]:
    """One token after a streamed answer's whole sequence (prompt and answer), computed by D
    alone (``do_remote_prefill: false``): its non-streamed answer carries the handle of the
    sequence. The cache salt stays, so D's prefix cache finds the stream's blocks."""
    body: dict[str, Any] = {
        "request_id": f"{generate.get('request_id') or 'turn'}-capture",
        "token_ids": sequence,
        "sampling_params": {"max_tokens": 1},
        "kv_transfer_params": {"do_remote_prefill": False},
        "stream": False,
    }
    for name in ("model", "cache_salt"):
        if generate.get(name) is not None:
            body[name] = generate[name]
    return body


def release_request(model: str, kv: dict[str, Any]) -> dict[str, Any]:
    """A one-token request carrying a handle with nothing to pull: P computes one token,
    D frees the blocks."""
    return {
        "model": model,
        "token_ids": [0],
        "sampling_params": {"max_tokens": 1},
        "kv_transfer_params": kv,
    }
