"""The router's configuration: typed Structs, each key described once where it is declared
(``engines.py``, ``router.py``); flags, ``CARRYOVER_*`` variables and the reference
(docs/configuration.md) are derived from them (``keys.py``, ``load.py``, ``reference.py``)."""

from carryover.router.config.engines import (
    InstanceConfig,
    ModelConfig,
    RenderConfig,
    TokensConfig,
    TurnCosts,
    WarmTierConfig,
)
from carryover.router.config.errors import ConfigError
from carryover.router.config.router import (
    CONFIG_ENV,
    LOG_LEVELS,
    RedisOptions,
    RouterConfig,
    TenantLimits,
    Timeouts,
)

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
    "TurnCosts",
    "WarmTierConfig",
]
