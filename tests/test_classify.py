"""Error classification: seed 000's activation signals and the sinks' real exception texts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.dispatch.classify import classify
from outbox.sinks.base import NotDelivered, Rejected


def _named(class_name: str, message: str, base: type[Exception] = Exception) -> Exception:
    """An exception of a given class name, as the sink libraries raise them."""
    return type(class_name, (base,), {})(message)


@pytest.mark.parametrize(
    ("exc", "reason", "transient"),
    [
        (ConnectionError("Transport closed"), "transport_closed", True),
        (_named("McpError", "-32000: Connection closed"), "transport_closed", True),
        (_named("ConnectError", "[Errno 111] Connection refused"), "transport_closed", True),
        (
            ValueError("Could not connect to a Chroma server. Are you sure it is running?"),
            "transport_closed",
            True,
        ),
        (_named("ReadOnlyError", "attempt to write a readonly database"), "readonly", True),
        (_named("BusyError", "database is locked"), "db_busy", True),
        (_named("WriterInUseError", "another writer is using x (pid 5)"), "db_busy", True),
        (RuntimeError("sqlite3.OperationalError: database is locked"), "db_busy", True),
        (NotDelivered("chunk_id: null"), "queued_null_chunk", True),
        (RuntimeError("DEFERRED: Memory queued (DB busy)"), "queued_null_chunk", True),
        (TimeoutError("timed out"), "timeout", True),
        (_named("ReadTimeout", "timed out"), "timeout", True),
        (
            _named("InvalidArgumentError", "Collection expecting embedding with dimension of 384"),
            "rejected",
            False,
        ),
        (Rejected("content rejected"), "rejected", False),
        (TypeError("argument 'metadatas': Cannot convert"), "rejected", False),
        (_named("InternalError", "Error in compaction: Failed to apply logs"), "unknown", True),
        (RuntimeError("something odd"), "unknown", True),
    ],
)
def test_known_signals(exc: Exception, reason: str, transient: bool) -> None:
    failure = classify(exc)
    assert (failure.reason, failure.transient) == (reason, transient)


REASONS = {
    "transport_closed",
    "db_busy",
    "queued_null_chunk",
    "readonly",
    "timeout",
    "rejected",
    "unknown",
}


@given(st.text(max_size=200), st.sampled_from([RuntimeError, ValueError, OSError, KeyError]))
def test_always_a_known_reason(message: str, cls: type[Exception]) -> None:
    failure = classify(cls(message))
    assert failure.reason in REASONS
    assert failure.transient == (failure.reason != "rejected")
