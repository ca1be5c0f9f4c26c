"""The interface every sink implements, built-in or custom (``OUTBOX_SINKS=module:attr``).

A sink turns records into something durable elsewhere and says, per record, which id the
other side gave it. The dispatcher owns retries, timeouts, leases and bookkeeping; a sink
only delivers, and must be idempotent by record key (a repeat delivery is no second memory).

A forget reaches a sink as ``delete(items)``, idempotent the same way: a key the sink does not
hold is already deleted.

A sink also says what its own failures mean: it raises (or returns, per record) ``Transient``
for "try again later" and ``Permanent`` for "never", each with a ``FailureReason``. Only the
sink knows its library's exceptions and wording, so the dispatcher never has to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from outbox.core.record import Record
from outbox.core.states import FailureReason

__all__ = [
    "DeleteOutcome",
    "Deleted",
    "Delivered",
    "FailureReason",
    "Held",
    "NotDelivered",
    "Outcome",
    "Permanent",
    "Rejected",
    "Sink",
    "Transient",
    "describe",
]


@dataclass(frozen=True)
class Delivered:
    """The sink durably holds the record under ``sink_id`` (must be non-empty to count)."""

    sink_id: str


# One outcome per record, in the batch's order: an id, or the exception for that record.
Outcome = Delivered | BaseException


@dataclass(frozen=True)
class Held:
    """A record a sink is asked to delete: its key, and the id the sink gave it when it was
    delivered (None when never delivered, or when that row was pruned)."""

    key: str
    sink_id: str | None = None


@dataclass(frozen=True)
class Deleted:
    """The sink no longer holds the record of ``key`` (it deleted it, or never had it)."""

    key: str


# One outcome per key of a delete call, in order: done, or the exception for that key.
DeleteOutcome = Deleted | BaseException


def describe(exc: BaseException) -> str:
    """``ClassName: message``: how a failure reads in ``last_error`` and the logs."""
    return f"{type(exc).__name__}: {exc}"


def _as_reason(value: FailureReason | str) -> FailureReason:
    # A misspelt reason must not turn the sink's failure into a ValueError of its own.
    try:
        return FailureReason(value)
    except ValueError:
        return FailureReason.UNKNOWN


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class _Classified(Exception):
    """A failure that carries its own reason class."""

    def __init__(self, message: str, reason: FailureReason | str) -> None:
        super().__init__(message)
        self.reason = _as_reason(reason)

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled without calling __init__, so subclasses with other signatures survive the
        # trip from a sink's child process (the default would call cls(*args)).
        return _rebuild, (type(self), self.args, dict(self.__dict__))


class Transient(_Classified):
    """Retry this record later, with backoff: the other side cannot take it now."""


class Permanent(_Classified):
    """Never retry this record: it goes to the dead letters at once."""


class NotDelivered(Transient):
    """A reply that is not a delivery (null chunk id, "queued", "deferred"): retried."""

    def __init__(
        self, message: str, reason: FailureReason | str = FailureReason.QUEUED_NULL_CHUNK
    ) -> None:
        super().__init__(message, reason)


class Rejected(Permanent):
    """The sink refuses this record for good (bad content, wrong dimension): dead-letter it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, FailureReason.REJECTED)


@runtime_checkable
class Sink(Protocol):
    """What the dispatcher calls. ``name`` is the configured name stored in the outbox.

    ``semantic`` is True only for a vector index that serves meaning-based recall (the
    Chroma sink): a record it holds leaves the lexical overlay of pending records. Every
    other sink says False; the registry sets False on a custom sink that does not say.
    """

    name: str
    semantic: bool

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        """Deliver ``batch``; return one outcome per record, or raise to fail them all."""
        ...

    def delete(self, items: Sequence[Held]) -> list[DeleteOutcome]:
        """Remove these records (a forget); a record the sink never had is done too.
        Return one outcome per item, or raise to fail them all; retried like a delivery."""
        ...

    def close(self) -> None:
        """Release connections, files and writer locks."""
        ...
