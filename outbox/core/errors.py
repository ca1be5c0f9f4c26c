"""The exceptions a caller can meet, each carrying one line that names what is wrong."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from outbox.core.naming import is_markdown_name, key_prefix
from outbox.core.states import FallbackReason


class OutboxError(Exception):
    """Base of every error this library raises on purpose."""


class ValidationError(OutboxError, ValueError):
    """Input rejected before anything was written (CLI exit 2)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"invalid {field}: {problem}")


class ConfigError(OutboxError, ValueError):
    """A setting has a value the library cannot use; raised before any write."""

    def __init__(self, setting: str, problem: str) -> None:
        self.setting = setting
        super().__init__(f"bad setting {setting}: {problem}")


class StoreFailed(OutboxError):
    """Neither the database nor the fallback file took the write (CLI exit 1)."""


class MirrorBusy(OutboxError):
    """The mirror lock could not be taken within the write's time bound."""


class DatabaseTimeout(OutboxError):
    """The database server did not answer within the write's time bound (a server that
    stopped answering: the driver itself would wait for its reply forever)."""


class DatabaseLacksRecords(OutboxError):
    """The JSONL log names records the database does not hold: the database was deleted,
    emptied or replaced by an older copy. Writing on would bury the gap under new records,
    so writes go to the fallback queue until ``command`` (``outbox rebuild``) closes it."""

    def __init__(self, database: str, log: str, *, older_copy: bool, gone: bool = False) -> None:
        self.gone = gone  # the SQLite file itself is missing: nothing may create it anew
        self.older_copy = older_copy  # it holds records of this machine, not the newest
        self.command = "outbox rebuild --merge" if older_copy else "outbox rebuild"
        lacks = "lacks the newest records" if older_copy else "holds none of the records"
        super().__init__(
            f"the database {database} {lacks} its JSONL log {log} names (deleted, emptied or "
            f"an older copy put back?); writes go to the fallback queue; run `{self.command}`"
        )


class StoreUnreadable(OutboxError):
    """The database could not be opened or read: names where it is and what to check."""

    @classmethod
    def of(
        cls, db_url: str, exc: BaseException, reason: FallbackReason, doing: str = "read"
    ) -> StoreUnreadable:
        """The error for ``exc`` met on ``db_url`` while trying to ``doing`` it: the driver's
        first line, the database (a file's path, a server's URL without its password), and
        what to do about it, chosen by ``reason`` (``store/driver_errors.py`` reads it from
        the driver's code, so this layer never looks inside a driver's error)."""
        from sqlalchemy.engine import make_url

        url = make_url(db_url)
        sqlite = url.drivername.startswith("sqlite")
        where = url.database if sqlite else url.render_as_string(hide_password=True)
        cause = str(getattr(exc, "orig", None) or exc).splitlines()[0] or type(exc).__name__
        if reason == FallbackReason.DB_BUSY:
            hint = "another process holds its lock; try again, or raise OUTBOX_BUSY_TIMEOUT"
        elif reason == FallbackReason.CORRUPT:
            hint = "the file is damaged or not an outbox database; `outbox rebuild` recreates it"
        elif sqlite:
            hint = "check that the file and its folder exist and this user may read and write them"
        else:
            hint = "check that the server is up and reachable"
        return cls(
            f"cannot {doing} the database {where} ({cause}); {hint}, or point OUTBOX_DB_URL "
            "(or OUTBOX_HOME) at the right store"
        )


class RecordFileError(OutboxError, OSError):
    """A record's markdown file could not be read, written or removed. The message names the
    record by its key prefix and the file's folder, never the file: its name carries the
    memory's first words. Still an ``OSError`` with the same errno, so a caller that handles
    file trouble (repair at the next open, a warning) goes on doing so."""

    def __init__(self, key: str, doing: str, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or type(cause).__name__)
        self.key = key
        named = next((name for name in (cause.filename, cause.filename2) if name is not None), None)
        where = f" in {Path(os.fsdecode(named)).parent}" if named is not None else ""
        self.message = (
            f"record {key_prefix(key)}: cannot {doing} its markdown file{where} ({self.strerror})"
        )

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def about_record(key: str, doing: str) -> Iterator[None]:
    """Work on ``key``'s markdown file: an ``OSError`` met inside becomes a
    ``RecordFileError`` naming the record. The cause is not chained, and its markdown file
    names are cleared, so neither a traceback nor a caller reading ``__context__`` sees them."""
    try:
        yield
    except RecordFileError:
        raise
    except OSError as exc:
        error = RecordFileError(key, doing, exc)
        if exc.filename is not None and is_markdown_name(exc.filename):
            exc.filename = None
        if exc.filename2 is not None and is_markdown_name(exc.filename2):
            exc.filename2 = None
        raise error from None
