"""outbox: the write path that AI-agent memory never loses.

``Outbox.open().add(text)`` commits the memory and its outbox rows in one transaction and
returns at once; a dispatcher delivers to Chroma and BrainLayer later, with retries.

Every public name is loaded on first use, so ``import outbox`` (and a sink module that only
needs the sink interface) never pays for SQLAlchemy or a sink's dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from outbox.api import Outbox
    from outbox.core.config import Settings, load_settings
    from outbox.core.errors import ConfigError, OutboxError, StoreFailed, ValidationError
    from outbox.core.receipt import Receipt
    from outbox.core.states import (
        BuiltinSink,
        DeliveryState,
        FailureReason,
        FallbackReason,
        MirrorEvent,
        ReceiptStatus,
    )
    from outbox.recall.service import RecallAnswer, RecallHit
    from outbox.sinks.base import (
        Delivered,
        NotDelivered,
        Outcome,
        Permanent,
        Rejected,
        Sink,
        Transient,
    )
    from outbox.store.delivery_reads import DeliveryRow
    from outbox.store.rows import RecentRow, StoredRecord

__version__ = "0.1.0"

# Where each public name lives; ``__getattr__`` imports its module when it is first used.
_HOMES = {
    "Outbox": "outbox.api",
    "Settings": "outbox.core.config",
    "load_settings": "outbox.core.config",
    "ConfigError": "outbox.core.errors",
    "OutboxError": "outbox.core.errors",
    "StoreFailed": "outbox.core.errors",
    "ValidationError": "outbox.core.errors",
    "Receipt": "outbox.core.receipt",
    # What a sink author needs.
    "Delivered": "outbox.sinks.base",
    "NotDelivered": "outbox.sinks.base",
    "Outcome": "outbox.sinks.base",
    "Permanent": "outbox.sinks.base",
    "Rejected": "outbox.sinks.base",
    "Sink": "outbox.sinks.base",
    "Transient": "outbox.sinks.base",
    # The words the library stores and prints.
    "BuiltinSink": "outbox.core.states",
    "DeliveryState": "outbox.core.states",
    "FailureReason": "outbox.core.states",
    "FallbackReason": "outbox.core.states",
    "MirrorEvent": "outbox.core.states",
    "ReceiptStatus": "outbox.core.states",
    # The rows ``Outbox``'s operations return, for callers that annotate them.
    "DeliveryRow": "outbox.store.delivery_reads",
    "RecallAnswer": "outbox.recall.service",
    "RecallHit": "outbox.recall.service",
    "RecentRow": "outbox.store.rows",
    "StoredRecord": "outbox.store.records",
}

__all__ = [
    "BuiltinSink",
    "ConfigError",
    "Delivered",
    "DeliveryRow",
    "DeliveryState",
    "FailureReason",
    "FallbackReason",
    "MirrorEvent",
    "NotDelivered",
    "Outbox",
    "OutboxError",
    "Outcome",
    "Permanent",
    "RecallAnswer",
    "RecallHit",
    "Receipt",
    "ReceiptStatus",
    "RecentRow",
    "Rejected",
    "Settings",
    "Sink",
    "StoreFailed",
    "StoredRecord",
    "Transient",
    "ValidationError",
    "load_settings",
]


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name for next time."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'outbox' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
