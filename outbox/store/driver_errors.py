"""Why the database could not be used, read from the code the driver gave, never its words.

The one place that turns a database error into the library's ``FallbackReason``: SQLite's
result codes (``sqlite3.Error.sqlite_errorcode``), PostgreSQL's SQLSTATEs (psycopg's
``sqlstate``, also behind SQLAlchemy's ``.orig``) and the operating system's errno. Error
texts change between versions and locales; codes are the drivers' documented contract.

Two parts. ``reason_for`` is a pure, total function from a code to a reason, so it can be
property-tested over every code. ``driver_code`` finds the code on an exception by duck
typing (``sqlite_errorcode``, ``sqlstate``, ``errno``, walking ``.orig`` and ``__cause__``),
so this module imports no driver and no SQLAlchemy: the SQLite write path
(``write/fallback.py``, ``write/direct.py``) uses it without loading either.

It lives in ``store/``, the database boundary, and imports only ``core``. The wording of
``StoreUnreadable`` (``core/errors.py``) is chosen by the reason its caller computes here and
passes in, so ``core`` never imports ``store``. Errors that are not the database's
(``MirrorBusy``, ``DatabaseTimeout``) are the write path's own and sorted there
(``write/fallback.py`` ``failure_reason``).
"""

from __future__ import annotations

import errno
import sqlite3
from collections.abc import Iterator
from enum import StrEnum

from outbox.core.errors import DatabaseTimeout, MirrorBusy
from outbox.core.states import FallbackReason

# What makes a write go to the fallback file instead of failing, short of SQLAlchemy's own
# errors (``store/engine.py`` adds those: ``UNAVAILABLE``). ``sqlite3.Error``: the SQLite write
# path runs its statements on the bare driver, outside SQLAlchemy's wrapping.
UNAVAILABLE_BARE = (sqlite3.Error, OSError, MirrorBusy, DatabaseTimeout)


class CodeKind(StrEnum):
    """Which numbering a code belongs to."""

    SQLITE = "sqlite"  # an SQLite result code, primary or extended (int)
    SQLSTATE = "sqlstate"  # a PostgreSQL SQLSTATE, five characters (str)
    ERRNO = "errno"  # an operating-system error number (int)
    # A PostgreSQL driver error with no SQLSTATE: the client library itself failed (could
    # not connect, lost the connection). Named by its PEP 249 class, e.g. "OperationalError".
    PG_CLIENT = "pg_client"


Code = tuple[CodeKind, int | str]

# SQLite primary result codes (https://sqlite.org/rescode.html); an extended code is its
# primary code in the low eight bits. Codes not listed (SQLITE_ERROR, SQLITE_CONSTRAINT,
# SQLITE_NOMEM, SQLITE_MISUSE ...) say nothing about the database's state: UNKNOWN.
_SQLITE_PRIMARY: dict[int, FallbackReason] = {
    3: FallbackReason.READONLY,  # SQLITE_PERM: access permission denied
    5: FallbackReason.DB_BUSY,  # SQLITE_BUSY: another connection holds the lock
    6: FallbackReason.DB_BUSY,  # SQLITE_LOCKED: a table locked within this process
    8: FallbackReason.READONLY,  # SQLITE_READONLY (and _DIRECTORY, _CANTINIT, _DBMOVED ...)
    10: FallbackReason.IO_ERROR,  # SQLITE_IOERR (and its thirty-odd extended codes)
    11: FallbackReason.CORRUPT,  # SQLITE_CORRUPT: "database disk image is malformed"
    13: FallbackReason.DISK_FULL,  # SQLITE_FULL
    14: FallbackReason.IO_ERROR,  # SQLITE_CANTOPEN: file or folder missing, not creatable
    23: FallbackReason.READONLY,  # SQLITE_AUTH: an authorizer refused the statement
    26: FallbackReason.CORRUPT,  # SQLITE_NOTADB: "file is not a database"
}

# PostgreSQL SQLSTATE classes (the first two characters,
# https://www.postgresql.org/docs/current/errcodes-appendix.html); a code maps like its class
# unless it is in _SQLSTATE_CODES.
_SQLSTATE_CLASSES: dict[str, FallbackReason] = {
    "08": FallbackReason.DB_UNREACHABLE,  # connection exception
    "40": FallbackReason.DB_BUSY,  # transaction rollback: serialization failure, deadlock
    "53": FallbackReason.DB_BUSY,  # insufficient resources: out of memory, too many clients
    "57": FallbackReason.DB_UNREACHABLE,  # operator intervention: shutdown, cannot connect now
    "58": FallbackReason.IO_ERROR,  # system error (outside PostgreSQL): I/O, missing files
}
_SQLSTATE_CODES: dict[str, FallbackReason] = {
    "25006": FallbackReason.READONLY,  # read_only_sql_transaction
    "40002": FallbackReason.UNKNOWN,  # transaction_integrity_constraint_violation: our data
    "42501": FallbackReason.READONLY,  # insufficient_privilege
    "53100": FallbackReason.DISK_FULL,  # disk_full
    "55006": FallbackReason.DB_BUSY,  # object_in_use
    "55P03": FallbackReason.DB_BUSY,  # lock_not_available (lock_timeout, NOWAIT)
    "57014": FallbackReason.DB_BUSY,  # query_canceled (statement_timeout)
    "XX001": FallbackReason.CORRUPT,  # data_corrupted
    "XX002": FallbackReason.CORRUPT,  # index_corrupted
}

_ERRNOS: dict[int, FallbackReason] = {
    errno.ECONNREFUSED: FallbackReason.DB_UNREACHABLE,
    errno.ECONNRESET: FallbackReason.DB_UNREACHABLE,
    errno.EHOSTUNREACH: FallbackReason.DB_UNREACHABLE,
    errno.ENETUNREACH: FallbackReason.DB_UNREACHABLE,
    errno.EROFS: FallbackReason.READONLY,
    errno.EACCES: FallbackReason.READONLY,
    errno.EPERM: FallbackReason.READONLY,
    errno.ENOSPC: FallbackReason.DISK_FULL,
    errno.EDQUOT: FallbackReason.DISK_FULL,
    errno.EFBIG: FallbackReason.DISK_FULL,
    errno.EIO: FallbackReason.IO_ERROR,
}

# A driver error without a server's code: only a failed operation means the server is out of
# reach; misuse (InterfaceError, ProgrammingError) says nothing about it.
_PG_CLIENT: dict[str, FallbackReason] = {"OperationalError": FallbackReason.DB_UNREACHABLE}

# PEP 249's exception classes, most specific first: the name a driver error is known by.
_PEP249 = (
    "OperationalError",
    "IntegrityError",
    "InternalError",
    "ProgrammingError",
    "NotSupportedError",
    "DataError",
    "InterfaceError",
    "DatabaseError",
    "Error",
)


def reason_for(kind: CodeKind, code: int | str) -> FallbackReason:
    """The reason a code means (pure, total: an unknown code, or a value of the wrong type
    for its kind, is ``UNKNOWN``)."""
    if kind is CodeKind.SQLITE:
        if isinstance(code, int) and not isinstance(code, bool):
            return _SQLITE_PRIMARY.get(code & 0xFF, FallbackReason.UNKNOWN)
    elif kind is CodeKind.SQLSTATE:
        if isinstance(code, str) and len(code) == 5:
            found = _SQLSTATE_CODES.get(code)
            return found or _SQLSTATE_CLASSES.get(code[:2], FallbackReason.UNKNOWN)
    elif kind is CodeKind.ERRNO:
        if isinstance(code, int) and not isinstance(code, bool):
            return _ERRNOS.get(code, FallbackReason.UNKNOWN)
    elif kind is CodeKind.PG_CLIENT and isinstance(code, str):
        return _PG_CLIENT.get(code, FallbackReason.UNKNOWN)
    return FallbackReason.UNKNOWN


def driver_code(exc: BaseException) -> Code | None:
    """The first code found on ``exc``, then on what it wraps (SQLAlchemy's ``.orig``, a
    ``raise ... from`` cause); None when no link carries one."""
    for link in _chain(exc):
        code = _own_code(link)
        if code is not None:
            return code
    return None


def reason_of(exc: BaseException) -> FallbackReason:
    """Why the database could not be used, from the code ``exc`` carries (``UNKNOWN``
    without one)."""
    code = driver_code(exc)
    return FallbackReason.UNKNOWN if code is None else reason_for(*code)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then each wrapped error in turn, each once (a cycle ends the walk)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        orig = getattr(link, "orig", None)
        link = orig if isinstance(orig, BaseException) else link.__cause__


def _own_code(exc: BaseException) -> Code | None:
    """The code ``exc`` itself carries, by the attribute each source sets."""
    sqlite_code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(sqlite_code, int):
        return CodeKind.SQLITE, sqlite_code
    if hasattr(exc, "sqlstate"):  # psycopg: every error has it, None when no server sent one
        sqlstate = getattr(exc, "sqlstate", None)
        if isinstance(sqlstate, str):
            return CodeKind.SQLSTATE, sqlstate
        names = {klass.__name__ for klass in type(exc).__mro__}
        return CodeKind.PG_CLIENT, next((name for name in _PEP249 if name in names), "")
    if isinstance(exc, OSError) and isinstance(exc.errno, int):
        return CodeKind.ERRNO, exc.errno
    return None
