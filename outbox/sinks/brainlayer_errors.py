"""What BrainLayer's failures mean for a delivery, read from its classes and its words.

Both BrainLayer modes use it: exceptions from its store path in process, and the errors that
come back over MCP, where only the text is left. Classes are looked up only in modules
already loaded, so reading an error never imports BrainLayer.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from outbox.core.record import Record
from outbox.core.states import FailureReason
from outbox.sinks.base import Delivered, NotDelivered, Outcome, Permanent, Rejected, Transient

DELIVERED_OUTCOMES = frozenset({"stored", "duplicate", "merged"})
# DEFERRED reasons that mean "the database could not take it now"; any other reason means
# "queued behind other work": both are retried, under different front-matter reasons.
BUSY_DEFERRALS = frozenset({"DB_BUSY", "SCHEMA_FINGERPRINT_MISMATCH"})
# Characters of the content that, found in an error text, mean the text quotes the memory.
_QUOTE_PROBE = 32
_WITHHELD = "(details withheld: they quote the memory)"

Rule = tuple[FailureReason, tuple[tuple[str, str], ...], tuple[str, ...]]
# (reason, (module, class) pairs, words in the lowercased text): the first rule that matches
# by class or by words wins. Only REJECTED is permanent.
_RULES: tuple[Rule, ...] = (
    (FailureReason.REJECTED, (), ("rejected", "dimension", "invalid argument")),
    (
        FailureReason.QUEUED_NULL_CHUNK,
        (),
        (
            "chunk_id: null",
            "null chunk",
            "queued",
            "deferred",
            "queue depth",
            "tool_returned_text=no",
            "no chunk_id",
        ),
    ),
    (FailureReason.READONLY, (("apsw", "ReadOnlyError"),), ("readonly", "read-only")),
    (
        FailureReason.DB_BUSY,
        (
            ("apsw", "BusyError"),
            ("brainlayer.vector_store", "WriterInUseError"),
            # A database BrainLayer will not write yet (a foreign or unmigrated file): wait.
            ("brainlayer.runtime_store", "SchemaFingerprintMismatch"),
        ),
        (
            "database is locked",
            "database is busy",
            "db busy",
            "db_busy",
            "writer-in-use",
            "another writer is using",
            "sqlite_busy",
        ),
    ),
    (FailureReason.TIMEOUT, (), ("timed out", "timeout")),
    (
        FailureReason.TRANSPORT_CLOSED,
        (),
        (
            "transport closed",
            "connection closed",
            "-32000",
            "connection refused",
            "connection reset",
            "broken pipe",
            "server disconnected",
        ),
    ),
)
_LOCK_CLASSES = frozenset({"BusyError", "LockedError", "WriterInUseError"})


def safe_text(text: str, record: Record) -> str:
    """``text`` unless it quotes the record's content; error texts end up in logs."""
    probe = record.content.strip()[:_QUOTE_PROBE]
    if probe and probe in text:
        return _WITHHELD
    return text


def _is_a(exc: BaseException, module: str, name: str) -> bool:
    loaded = sys.modules.get(module)
    cls = getattr(loaded, name, None) if loaded is not None else None
    return isinstance(cls, type) and isinstance(exc, cls)


def failure_of(exc: BaseException, record: Record | None = None) -> BaseException:
    """``exc`` as ``Transient``/``Permanent`` when BrainLayer's classes or words say what it
    is; otherwise ``exc`` itself (the dispatcher's rules for plain errors apply).

    With ``record``, a text that quotes the memory is neither read nor passed on.
    """
    if isinstance(exc, Transient | Permanent):
        return exc
    text = str(exc) if record is None else safe_text(str(exc), record)
    message = f"{type(exc).__name__}: {text}"
    lowered = message.lower()
    for reason, classes, words in _RULES:
        if any(_is_a(exc, module, name) for module, name in classes) or any(
            word in lowered for word in words
        ):
            if reason is FailureReason.REJECTED:
                return Permanent(message, reason)
            return Transient(message, reason)
    if text == _WITHHELD:
        return RuntimeError(f"BrainLayer failed with {type(exc).__name__} (details withheld)")
    return exc


def is_lock_error(exc: BaseException) -> bool:
    """A busy/locked database or a writer held elsewhere: a wait, not a fault of this record,
    so the rest of the batch would wait as long."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & _LOCK_CLASSES) or "locked" in str(exc).lower()


def store_outcome(result: Mapping[str, Any]) -> Outcome:
    """``store_memory``'s reply as an outcome: a delivery only with a concrete chunk id."""
    chunk_id = result.get("id")
    # Releases before the outcome field returned only after COMMIT: that was a store.
    outcome = str(result.get("outcome") or "stored").lower()
    if isinstance(chunk_id, str) and chunk_id and outcome in DELIVERED_OUTCOMES:
        return Delivered(chunk_id)
    return NotDelivered(f"BrainLayer answered {outcome} without a stored chunk id")


def deferred(why: str) -> NotDelivered:
    """BrainLayer's DEFERRED: queued inside BrainLayer, not yet in its database."""
    reason = FailureReason.DB_BUSY if why in BUSY_DEFERRALS else FailureReason.QUEUED_NULL_CHUNK
    return NotDelivered(f"brain_store deferred it ({why}): queued, not stored", reason)


def refused(summary: str) -> Rejected:
    """Content BrainLayer's gates refuse: nothing was written, and nothing ever will be."""
    return Rejected(f"BrainLayer refused it: {summary}")
