"""The exceptions a caller can meet, each carrying one line that names what is wrong."""

from __future__ import annotations

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
