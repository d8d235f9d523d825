"""What one ``carryover serve`` needs beyond its models: where it serves, its store, its
tenants, deadlines and the fleet's knobs."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

import msgspec

from carryover.router.config.engines import ModelConfig
from carryover.router.config.errors import ConfigError, about

#: The deepest max_nesting_depth: rendering a body takes a few frames a level, and Python
#: stops at 1,000.
_DEEPEST = 256

__all__ = [
    "CONFIG_ENV",
    "LOG_LEVELS",
    "RedisOptions",
    "RouterConfig",
    "TenantLimits",
    "Timeouts",
]

#: The environment variable naming the file ``carryover serve`` writes the config to for its
#: uvicorn workers (``router/http/asgi.py``): the config holds keys and passwords, so it goes in
#: a file only its user can read, never in the environment (``/proc/<pid>/environ``).
CONFIG_ENV = "CARRYOVER_SERVE_CONFIG_FILE"

#: What ``log_level`` may be (Python's level names; uvicorn's too).
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LogLevel = Literal["critical", "error", "warning", "info", "debug"]


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


class Timeouts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Deadlines of the router's connections, in seconds: to the engines, and idle ones
    from clients."""

    connect: Annotated[float, about("TCP connect to an instance.")] = 2.0
    prefill: Annotated[
        float, about("The whole P leg (max_tokens 1); a P that hangs is retried elsewhere.")
    ] = 60.0
    first_byte: Annotated[float, about("D's response headers (or first chunk for streams).")] = 60.0
    request: Annotated[
        float, about("The whole D leg: caps every answer's length in time, streams included.")
    ] = 900.0
    health: Annotated[float, about("One health or metrics probe.")] = 1.0
    keepalive: Annotated[
        float,
        about(
            "How long an idle pooled connection to an engine is kept: below the engines' own "
            "idle close (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so a request never goes out "
            "on a connection the engine is closing."
        ),
    ] = 4.0
    client_keepalive: Annotated[
        float,
        about(
            "How long a client's idle connection stays open: above clients' own pool expiry "
            "(httpx and the openai client: 5 s) and load balancers' idle timeouts (AWS ALB: "
            "60 s), so the router never closes one under a request."
        ),
    ] = 75.0


class RedisOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How the store reaches Redis beyond the URL (docs/redis.md)."""

    ca_file: Annotated[
        str | None,
        about("TLS (rediss://): the CA that signed the servers' certificates (default: system)."),
    ] = None
    cert_file: Annotated[str | None, about("TLS: a client certificate.")] = None
    key_file: Annotated[str | None, about("TLS: the client certificate's key.")] = None
    password_file: Annotated[
        str | None,
        about(
            "A file holding the password (a mounted secret), used when the URL has none; "
            "CARRYOVER_REDIS_PASSWORD does the same from the environment."
        ),
    ] = None
    shards: Annotated[
        int | None,
        about("How many hash tags conversations spread over (default 1; 64 on a Cluster)."),
    ] = None
    durability: Annotated[
        Literal["none", "replica"] | None,
        about(
            "none: a write is done when the primary answers; replica: after WAIT "
            "wait_replicas. Default replica on Sentinel, Cluster and a server that reports "
            "replicas, none otherwise."
        ),
    ] = None
    wait_replicas: Annotated[int, about("The WAIT of replica durability: replicas.")] = 1
    wait_timeout: Annotated[float, about("The WAIT of replica durability: seconds.")] = 0.05

    def __post_init__(self) -> None:
        if self.shards is not None and not 1 <= self.shards <= 256:
            raise ConfigError("redis_options.shards must be between 1 and 256")
        if self.wait_replicas < 1 or self.wait_timeout <= 0:
            raise ConfigError("redis_options.wait_replicas must be ≥ 1 and wait_timeout > 0")


class TenantLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one tenant may use (router/tenants/limits.py)."""

    concurrent_turns: Annotated[
        int | None,
        about("Turns it runs at once in one router process (none: no limit); one more gets 429."),
    ] = None
    conversations: Annotated[
        int | None,
        about(
            "Live conversation records it may hold fleet-wide (none: no limit); at the limit "
            "a turn that would start a new one gets 429 while its live ones go on. Read from "
            "the store every held_interval: soft."
        ),
    ] = None
    pinned_tokens: Annotated[
        int | None,
        about("Tokens decode instances pin for its live conversations, fleet-wide, as above."),
    ] = None
    priority_min: Annotated[
        int,
        about(
            "The lowest priority its requests may ask for (vLLM runs lower values sooner "
            "under --scheduling-policy priority)."
        ),
    ] = 0
    priority_max: Annotated[int, about("The highest.")] = 0

    def __post_init__(self) -> None:
        for name in ("concurrent_turns", "conversations", "pinned_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"tenant limits: {name} must be 1 or more")
        if self.priority_min > self.priority_max:
            raise ConfigError("tenant limits: priority_min must not exceed priority_max")


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything ``carryover serve`` needs."""

    models: Annotated[
        list[ModelConfig],
        about("Served models: [[models]] tables in the file; flags set up one model."),
    ]
    host: Annotated[
        str,
        about(
            "The address to listen on; beyond loopback it needs api_keys or allow_unauthenticated."
        ),
    ] = "127.0.0.1"
    port: Annotated[int, about("The port to listen on.")] = 8000
    workers: Annotated[int, about("uvicorn worker processes (more than 1 needs redis).")] = 1
    redis: Annotated[
        str | None,
        about(
            "Shared conversation state: redis://, rediss://, unix://, redis+sentinel:// or "
            "redis+cluster:// (docs/redis.md); none keeps it in this process. Put a password "
            "in redis_options.password_file rather than here."
        ),
    ] = None
    redis_options: Annotated[RedisOptions, about("", flags="redis-{}")] = RedisOptions()
    store_timeout: Annotated[
        float, about("One store call's deadline before the turn is served cold.")
    ] = 0.25
    max_body_bytes: Annotated[int, about("Larger request bodies get 413.")] = 32 * 1024 * 1024
    max_messages: Annotated[int, about("More chat messages than this get 400.")] = 4096
    max_tools: Annotated[int, about("More tools in a chat request than this get 400.")] = 1024
    max_nesting_depth: Annotated[
        int,
        about("JSON nested deeper than this, in the body or in a tool call's arguments, gets 400."),
    ] = 128
    api_keys: Annotated[
        dict[str, str],
        about(
            'Bearer key to tenant, a JSON object {"sk-…": "tenant"}; empty: no '
            "authentication (tenant default).",
            secret=True,
            file="api_keys_file",
        ),
    ] = {}
    admin_key: Annotated[
        str | None,
        about(
            "Bearer key for /admin/*, and for /metrics where api_keys are set or the host is "
            "beyond loopback (each is off without one).",
            secret=True,
            file="admin_key_file",
        ),
    ] = None
    tenant_limits: Annotated[
        dict[str, TenantLimits],
        about(
            "Limits by tenant name ([router.tenant_limits.NAME] tables; as a flag or variable "
            'a JSON object {"NAME": {"concurrent_turns": 4}}).'
        ),
    ] = {}
    default_tenant_limits: Annotated[TenantLimits, about("", flags="tenant-{}")] = TenantLimits()
    allow_unauthenticated: Annotated[
        bool,
        about(
            "Serve a host beyond loopback without api_keys (everyone is tenant default); "
            "refused otherwise."
        ),
    ] = False
    shared_cache: Annotated[
        bool,
        about(
            "Tenants share the engines' prefix caches, the warm tier and the KV index. Off, "
            "every request carries a salt keyed by its tenant, so no tenant hits, or times, "
            "another's cached prompt (docs/security.md)."
        ),
    ] = False
    cache_salt_key_file: Annotated[
        str | None,
        about(
            "A file holding the secret the tenants' salts are keyed with (without it a fixed "
            "key: tenants stay apart, but whoever reads engine requests can tell a tenant's "
            "salt)."
        ),
    ] = None
    expose_path_header: Annotated[
        bool, about("Add X-Carryover-Path (reuse, partial, cold-…) to responses.")
    ] = False
    timeouts: Annotated[Timeouts, about("", flags="{}-timeout")] = Timeouts()
    health_interval: Annotated[
        float,
        about("Seconds between health and load probes of each instance (and DNS resolutions)."),
    ] = 1.0
    held_interval: Annotated[
        float, about("Seconds between reads of the handles each decode instance holds.")
    ] = 10.0
    decode_kv_high_water: Annotated[
        float,
        about(
            "A decode instance's KV cache use (pins included) at which its oldest handles are "
            "given back, so pins cannot starve running requests; above 1: never "
            "(bench/RESULTS.md, pressure: 0.8 against 0.9)."
        ),
    ] = 0.8
    decode_kv_low_water: Annotated[float, about("The use that giving back aims for.")] = 0.6
    decode_kv_pin_limit: Annotated[
        float,
        about(
            "A decode instance's KV cache use at which turns ending there keep no pin (their "
            "handle is given back at once): relief frees what is held, not what keeps "
            "arriving; above 1: never (bench/RESULTS.md, pressure). Below it, a turn keeps "
            "its pin only if D keeps room for another turn of its size (docs/handles.md)."
        ),
    ] = 0.8
    breaker_failures: Annotated[
        int, about("Consecutive failures that open an instance's circuit.")
    ] = 3
    breaker_reset: Annotated[
        float, about("Seconds an open circuit waits before one trial request.")
    ] = 5.0
    affinity_slack: Annotated[
        int,
        about(
            "How much busier (requests in flight) the instance holding most of the prompt may "
            "be and still be preferred over the least loaded one."
        ),
    ] = 4
    affinity_tokens_per_load: Annotated[
        int,
        about(
            "Prompt tokens a KV holder must hold for each request of load above the least "
            "loaded to be preferred (docs/kv-events.md)."
        ),
    ] = 256
    shutdown_grace: Annotated[
        float, about("Seconds in-flight streams get to finish on shutdown.")
    ] = 30.0
    conversation_headers: Annotated[
        tuple[str, ...],
        about(
            "Request headers that carry the conversation id when the body has none, first "
            "present wins (vLLM's bench sends X-Session-ID, AIPerf X-Correlation-ID).",
            flag="--conversation-header",
            env="CARRYOVER_CONVERSATION_HEADERS",
        ),
    ] = ("x-conversation-id", "x-session-id")
    log_level: Annotated[LogLevel, about("The log level.")] = "info"
    planner: Annotated[
        str | None, about("module:function replacing state.plan (measurement).", hidden=True)
    ] = None

    @property
    def private_metrics(self) -> bool:
        """``/metrics`` needs the admin key: it names tenants and every engine's address, so
        it is the operators' wherever anyone but this machine's users can reach it."""
        return bool(self.api_keys) or not _loopback(self.host)

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("no models configured: give --prefill/--decode or a config file")
        if not all(h.strip() for h in self.conversation_headers):
            raise ConfigError("conversation_headers must be header names")
        if self.workers < 1:
            raise ConfigError("workers must be 1 or more")
        if self.workers > 1 and self.redis is None:
            raise ConfigError(
                "workers > 1 requires redis (--redis URL): each worker would keep its own state"
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
        if self.decode_kv_pin_limit <= 0:
            raise ConfigError("decode_kv_pin_limit must be above 0")
        if not self.api_keys and not self.allow_unauthenticated and not _loopback(self.host):
            raise ConfigError(
                f"host {self.host!r} serves beyond this machine with no api_keys: everyone "
                "would be tenant 'default'; set api_keys_file (or api_keys), or "
                "allow_unauthenticated (--allow-unauthenticated) to mean it"
            )
        if min(self.max_body_bytes, self.max_messages, self.max_tools) <= 0:
            raise ConfigError("max_body_bytes, max_messages and max_tools must be positive")
        if not 1 <= self.max_nesting_depth <= _DEEPEST:
            raise ConfigError(f"max_nesting_depth must be between 1 and {_DEEPEST}")
