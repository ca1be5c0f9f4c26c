"""The words the library stores and prints, as enums: one place to read them all.

A leaf module (it imports nothing of ours), so the write path, the dispatcher, the sinks and
the mirrors can all use it without importing each other. Every enum is a ``StrEnum``: its
members are the very strings written to the database, the JSONL log and the front matter,
so a stored value compares equal to its member and old rows need no migration.
"""

from __future__ import annotations

from enum import StrEnum


class DeliveryState(StrEnum):
    """Where one record stands with one sink (a ``deliveries`` row)."""

    PENDING = "pending"
    LEASED = "leased"
    DELIVERED = "delivered"
    DEAD = "dead"
    DISCARDED = "discarded"
    # The record was forgotten and this sink no longer holds it (deleted, or never sent).
    FORGOTTEN = "forgotten"


class DeliveryOp(StrEnum):
    """What a ``deliveries`` row asks of its sink: hold the record, or let go of it."""

    DELIVER = "deliver"
    DELETE = "delete"


# Rows a dispatcher still has to deliver, and rows nobody will deliver again.
UNDELIVERED = (DeliveryState.PENDING, DeliveryState.LEASED)
SETTLED = (
    DeliveryState.DELIVERED,
    DeliveryState.DEAD,
    DeliveryState.DISCARDED,
    DeliveryState.FORGOTTEN,
)


class ReceiptStatus(StrEnum):
    """What a write tells its caller: ``stored`` only ever with a sink's concrete id."""

    QUEUED = "queued"
    STORED = "stored"
    FALLBACK = "fallback"


class FallbackReason(StrEnum):
    """Why the database did not take a write, so it went to the fallback file."""

    DB_BUSY = "db_busy"
    DB_UNREACHABLE = "db_unreachable"
    READONLY = "readonly"
    DISK_FULL = "disk_full"
    CORRUPT = "corrupt"
    IO_ERROR = "io_error"
    # The log names records the database lacks (deleted, emptied, an older copy put back):
    # the database is not written until ``outbox rebuild`` brings them back.
    DB_MISSING = "db_missing"
    UNKNOWN = "unknown"


class FailureReason(StrEnum):
    """Why a sink did not take a delivery: the front matter's ``reason`` classes."""

    TRANSPORT_CLOSED = "transport_closed"
    DB_BUSY = "db_busy"
    QUEUED_NULL_CHUNK = "queued_null_chunk"
    READONLY = "readonly"
    TIMEOUT = "timeout"
    REJECTED = "rejected"
    UNKNOWN = "unknown"


# The front matter's ``reason`` while nothing has failed yet.
REASON_PENDING = "pending"
# ... and once every sink has the record without a failure on the way: no failure class to
# give, and ``pending`` would say it still waits (contract 3 allows more words).
REASON_DELIVERED = "delivered"


class MirrorEvent(StrEnum):
    """The ``event`` of a JSONL line."""

    ACCEPTED = "accepted"
    DELIVERED = "delivered"
    DEAD = "dead"
    DISCARDED = "discarded"
    # A forget: the record's accepted line was redacted in place; this line keeps the hash
    # the redacted line had, so the chain still proves nothing else changed.
    FORGOTTEN = "forgotten"
    # One sink deleted a forgotten record.
    DELETED = "deleted"
    # ``verify --repair`` met a break in the chain (lines lost or edited in the middle): this
    # line records where, and what the chain expected there, instead of rewriting history.
    REANCHORED = "reanchored"


class BuiltinSink(StrEnum):
    """The sinks the library ships; any other configured sink is a ``module:attr`` name."""

    CHROMA = "chroma"
    BRAINLAYER = "brainlayer"
