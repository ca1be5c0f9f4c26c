"""Sort a sink failure into transient (retry) or permanent (dead letter), with its reason.

Sinks classify their own library's errors (``Transient``/``Permanent`` in ``sinks.base``);
this only reads those, plus the standard library's timeouts and connection errors, so it
knows no sink library and stays a pure function of the exception.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from outbox.core.errors import OutboxError
from outbox.core.states import FailureReason
from outbox.sinks.base import Permanent, Transient, describe

# OSErrors that mean the other side's connection is gone, whatever class they came as.
_CONNECTION_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.ESHUTDOWN}
)
# A sink that raises one of these about a record means the record itself is unusable.
_PERMANENT_TYPES = (ValueError, TypeError, UnicodeError, KeyError)


@dataclass(frozen=True)
class Failure:
    reason: FailureReason
    transient: bool
    message: str


def classify(exc: BaseException) -> Failure:
    """The reason class of ``exc`` and whether retrying can help.

    Anything unrecognised is ``unknown`` and transient: a custom sink's surprise is retried,
    and the retry cap dead-letters it if it never goes away.
    """
    if isinstance(exc, Transient | Permanent):
        text = str(exc) if type(exc) in (Transient, Permanent) else describe(exc)
        return Failure(exc.reason, isinstance(exc, Transient), text)
    text = describe(exc)
    if isinstance(exc, TimeoutError):  # the dispatcher's SinkTimeout is one
        return Failure(FailureReason.TIMEOUT, True, text)
    if isinstance(exc, ConnectionError) or (
        isinstance(exc, OSError) and exc.errno in _CONNECTION_ERRNOS
    ):
        return Failure(FailureReason.TRANSPORT_CLOSED, True, text)
    if isinstance(exc, _PERMANENT_TYPES):
        return Failure(FailureReason.REJECTED, False, text)
    return Failure(FailureReason.UNKNOWN, True, text)


def shown_detail(exc: BaseException) -> str | None:
    """``ClassName: message`` when this library wrote the message (an ``OutboxError``, the
    dispatcher's own timeout): those name the setting or path to fix and never a memory's
    words, so a log line may carry them. None for another library's text, which may quote the
    record it failed on."""
    if isinstance(exc, OutboxError) or type(exc).__module__.startswith("outbox.dispatch."):
        return describe(exc)
    return None


def first_line(exc: BaseException) -> str:
    """``ClassName: first line`` of an error from the database or the dispatcher itself (whose
    texts hold no memory: statements are logged without their parameters)."""
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
