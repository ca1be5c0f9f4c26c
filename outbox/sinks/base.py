"""The interface every sink implements, built-in or custom (``OUTBOX_SINKS=module:attr``).

A sink turns records into something durable elsewhere and says, per record, which id the
other side gave it. The dispatcher owns retries, timeouts, leases and bookkeeping; a sink
only delivers, and must be idempotent by record key (a repeat delivery is no second memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from outbox.record import Record


@dataclass(frozen=True)
class Delivered:
    """The sink durably holds the record under ``sink_id`` (must be non-empty to count)."""

    sink_id: str


# One outcome per record, in the batch's order: an id, or the exception for that record.
Outcome = Delivered | BaseException


class NotDelivered(Exception):
    """A sink's reply that is not a delivery (null chunk id, "queued", "deferred")."""

    def __init__(self, message: str, reason: str = "queued_null_chunk") -> None:
        super().__init__(message)
        self.reason = reason


class Rejected(Exception):
    """The sink refuses this record for good (bad content, wrong dimension): dead-letter it."""


@runtime_checkable
class Sink(Protocol):
    """What the dispatcher calls. ``name`` is the configured name stored in the outbox."""

    name: str

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        """Deliver ``batch``; return one outcome per record, or raise to fail them all."""
        ...

    def close(self) -> None:
        """Release connections, files and writer locks."""
        ...
