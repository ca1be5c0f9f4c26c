"""Sort a sink failure into transient (retry) or permanent (dead letter), with its reason.

Pure: it looks only at the exception's class names and text, so it needs no sink library
imported and can be property-tested. The reasons are the ``reason`` values of the markdown
front matter (contract section 3) plus ``timeout`` and ``rejected``. Seed 000's tier 1 and
tier 2 activation signals all land in a transient class here.
"""

from __future__ import annotations

from dataclasses import dataclass

TRANSPORT_CLOSED = "transport_closed"
DB_BUSY = "db_busy"
QUEUED_NULL_CHUNK = "queued_null_chunk"
READONLY = "readonly"
TIMEOUT = "timeout"
REJECTED = "rejected"
UNKNOWN = "unknown"

# (reason, transient, class names, phrases in the lowercased text). First match wins.
_RULES: tuple[tuple[str, bool, frozenset[str], tuple[str, ...]], ...] = (
    (
        REJECTED,
        False,
        frozenset({"Rejected", "InvalidArgumentError", "DuplicateIDError"}),
        ("rejected", "dimension", "invalid argument"),
    ),
    (
        QUEUED_NULL_CHUNK,
        True,
        frozenset({"NotDelivered"}),
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
    (
        READONLY,
        True,
        frozenset({"ReadOnlyError"}),
        ("readonly", "read-only", "attempt to write a readonly database"),
    ),
    (
        DB_BUSY,
        True,
        frozenset({"BusyError", "WriterInUseError", "SchemaFingerprintMismatch"}),
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
    (
        TIMEOUT,
        True,
        frozenset(
            {
                "TimeoutError",
                "ReadTimeout",
                "WriteTimeout",
                "PoolTimeout",
                "ConnectTimeout",
                "SinkTimeout",
            }
        ),
        ("timed out", "timeout"),
    ),
    (
        TRANSPORT_CLOSED,
        True,
        frozenset(
            {
                "ConnectError",
                "RemoteProtocolError",
                "ReadError",
                "WriteError",
                "BrokenPipeError",
                "ConnectionError",
                "ConnectionRefusedError",
                "ConnectionResetError",
                "ClosedResourceError",
                "BrokenResourceError",
                "EndOfStream",
                "McpError",
                "MCPError",
            }
        ),
        (
            "transport closed",
            "connection closed",
            "-32000",
            "could not connect",
            "connection refused",
            "connection reset",
            "broken pipe",
            "server disconnected",
        ),
    ),
)
_PERMANENT_TYPES = frozenset({"ValueError", "TypeError", "UnicodeError", "KeyError"})


@dataclass(frozen=True)
class Failure:
    reason: str
    transient: bool
    message: str


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def classify(exc: BaseException) -> Failure:
    """The reason class of ``exc`` and whether retrying can help."""
    names = _class_names(exc)
    explicit = getattr(exc, "reason", None)
    text = f"{type(exc).__name__}: {exc}"
    lowered = text.lower()
    if "NotDelivered" in names and isinstance(explicit, str):
        return Failure(explicit, True, text)
    for reason, transient, classes, phrases in _RULES:
        if names & classes or any(phrase in lowered for phrase in phrases):
            return Failure(reason, transient, text)
    if names & _PERMANENT_TYPES:
        return Failure(REJECTED, False, text)
    return Failure(UNKNOWN, True, text)
