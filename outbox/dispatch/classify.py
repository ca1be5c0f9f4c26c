"""Sort a sink failure into transient (retry) or permanent (dead letter), with its reason.

Sinks classify their own library's errors (``Transient``/``Permanent`` in ``sinks.base``);
this only reads those, plus the standard library's timeouts and connection errors, so it
knows no sink library and stays a pure function of the exception.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from outbox.sinks.base import Permanent, Transient, describe
from outbox.states import FailureReason

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
