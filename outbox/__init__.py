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
    from outbox.config import Settings, load_settings
    from outbox.errors import ConfigError, OutboxError, StoreFailed, ValidationError
    from outbox.receipt import Receipt
    from outbox.sinks.base import (
        Delivered,
        NotDelivered,
        Outcome,
        Permanent,
        Rejected,
        Sink,
        Transient,
    )
    from outbox.states import (
        BuiltinSink,
        DeliveryState,
        FailureReason,
        FallbackReason,
        MirrorEvent,
        ReceiptStatus,
    )
    from outbox.store.delivery_reads import DeliveryRow
    from outbox.store.recall import RecentRow
    from outbox.store.rows import StoredRecord

__version__ = "0.1.0"

# Where each public name lives; ``__getattr__`` imports its module when it is first used.
_HOMES = {
    "Outbox": "outbox.api",
    "Settings": "outbox.config",
    "load_settings": "outbox.config",
    "ConfigError": "outbox.errors",
    "OutboxError": "outbox.errors",
    "StoreFailed": "outbox.errors",
    "ValidationError": "outbox.errors",
    "Receipt": "outbox.receipt",
    # What a sink author needs.
    "Delivered": "outbox.sinks.base",
    "NotDelivered": "outbox.sinks.base",
    "Outcome": "outbox.sinks.base",
    "Permanent": "outbox.sinks.base",
    "Rejected": "outbox.sinks.base",
    "Sink": "outbox.sinks.base",
    "Transient": "outbox.sinks.base",
    # The words the library stores and prints.
    "BuiltinSink": "outbox.states",
    "DeliveryState": "outbox.states",
    "FailureReason": "outbox.states",
    "FallbackReason": "outbox.states",
    "MirrorEvent": "outbox.states",
    "ReceiptStatus": "outbox.states",
    # The rows ``Outbox``'s operations return, for callers that annotate them.
    "DeliveryRow": "outbox.store.delivery_reads",
    "RecentRow": "outbox.store.recall",
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
