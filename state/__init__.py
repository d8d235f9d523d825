"""Conversation state: records, the token-prefix check, and the stores that keep them."""

from carryover.state.keys import (
    MAX_ID_LENGTH,
    ConversationKey,
    InvalidIdentifier,
    validate_identifier,
)
from carryover.state.memory import MemoryStore
from carryover.state.planning import plan
from carryover.state.prefix import (
    HashedTokens,
    Path,
    Plan,
    PlanSettings,
    Reason,
    TokenPrefix,
    block_size_of,
    chunk_size_for,
    release_handle,
    truncate_handle,
)
from carryover.state.records import Record
from carryover.state.redis_store import Durability, NotDurable, RedisStore
from carryover.state.store import (
    FENCE_SLACK,
    Committed,
    Held,
    Kept,
    Oldest,
    Store,
    StoreUnavailable,
    TenantUsage,
)

__all__ = [
    "FENCE_SLACK",
    "MAX_ID_LENGTH",
    "Committed",
    "ConversationKey",
    "Durability",
    "HashedTokens",
    "Held",
    "InvalidIdentifier",
    "Kept",
    "MemoryStore",
    "NotDurable",
    "Oldest",
    "Path",
    "Plan",
    "PlanSettings",
    "Reason",
    "Record",
    "RedisStore",
    "Store",
    "StoreUnavailable",
    "TenantUsage",
    "TokenPrefix",
    "block_size_of",
    "chunk_size_for",
    "plan",
    "release_handle",
    "truncate_handle",
    "validate_identifier",
]
