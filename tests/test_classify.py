"""The dispatcher's classification: sinks' own Transient/Permanent by their reason, the
standard library's timeouts and connection errors, and nothing of any sink library."""

from __future__ import annotations

import errno
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.core.states import FailureReason
from outbox.dispatch.classify import classify
from outbox.dispatch.worker import SinkTimeout
from outbox.sinks.base import NotDelivered, Permanent, Rejected, Transient


def _named(class_name: str, message: str, base: type[Exception] = Exception) -> Exception:
    """An exception with a sink library's class name, which must not matter here."""
    made: Exception = type(class_name, (base,), {})(message)
    return made


class SocketTrouble(OSError):
    """An OSError that is not one of the stdlib's ConnectionError classes."""


@pytest.mark.parametrize(
    ("exc", "reason", "transient"),
    [
        (Transient("busy", FailureReason.DB_BUSY), "db_busy", True),
        (Transient("read-only", "readonly"), "readonly", True),
        (Permanent("bad vector", FailureReason.REJECTED), "rejected", False),
        (Permanent("the store is gone for good", FailureReason.READONLY), "readonly", False),
        (NotDelivered("chunk_id: null"), "queued_null_chunk", True),
        (NotDelivered("deferred", reason=FailureReason.DB_BUSY), "db_busy", True),
        (Rejected("content rejected"), "rejected", False),
        (Transient("a misspelt reason", "no-such-reason"), "unknown", True),
        (SinkTimeout("chroma did not answer within 25s"), "timeout", True),
        (TimeoutError("timed out"), "timeout", True),
        (ConnectionError("Transport closed"), "transport_closed", True),
        (BrokenPipeError(errno.EPIPE, "Broken pipe"), "transport_closed", True),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), "transport_closed", True),
        (SocketTrouble(errno.ECONNRESET, "Connection reset by peer"), "transport_closed", True),
        (FileNotFoundError(errno.ENOENT, "No such file or directory"), "unknown", True),
        (ValueError("bad content"), "rejected", False),
        (TypeError("argument 'metadatas': Cannot convert"), "rejected", False),
        (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), "rejected", False),
        (KeyError("missing"), "rejected", False),
        (RuntimeError("something odd"), "unknown", True),
        # Library names and wording mean nothing here: the sink classifies its own.
        (_named("BusyError", "database is locked"), "unknown", True),
        (_named("ConnectError", "[Errno 111] Connection refused"), "unknown", True),
        (RuntimeError("DEFERRED: Memory queued (DB busy)"), "unknown", True),
    ],
)
def test_known_signals(exc: Exception, reason: str, transient: bool) -> None:
    failure = classify(exc)
    assert (failure.reason, failure.transient) == (reason, transient)


def test_messages_name_the_class_unless_it_says_nothing() -> None:
    assert classify(Transient("brain_store timed out", FailureReason.TIMEOUT)).message == (
        "brain_store timed out"
    )
    assert classify(Rejected("refused")).message == "Rejected: refused"
    assert classify(ConnectionError("gone")).message == "ConnectionError: gone"


class Owned(Transient):
    """A sink's own class with its own signature, as a child process sends it back."""

    def __init__(self, message: str) -> None:
        super().__init__(message, FailureReason.DB_BUSY)


def test_classified_failures_survive_pickling() -> None:
    for exc in (Owned("another writer"), NotDelivered("queued"), Rejected("no")):
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc)
        assert (str(again), again.reason) == (str(exc), exc.reason)


REASONS = st.sampled_from(list(FailureReason))


@given(st.text(max_size=200), st.sampled_from([RuntimeError, ValueError, OSError, KeyError]))
def test_plain_errors_are_rejected_only_for_bad_input(message: str, cls: type[Exception]) -> None:
    failure = classify(cls(message))
    assert failure.reason in set(FailureReason)
    assert failure.transient == (failure.reason != FailureReason.REJECTED)
    assert failure.reason in (FailureReason.REJECTED, FailureReason.UNKNOWN)


@given(st.text(max_size=200), REASONS, st.booleans())
def test_a_sinks_own_class_is_taken_as_it_says(
    message: str, reason: FailureReason, transient: bool
) -> None:
    exc = Transient(message, reason) if transient else Permanent(message, reason)
    failure = classify(exc)
    assert (failure.reason, failure.transient, failure.message) == (reason, transient, message)
