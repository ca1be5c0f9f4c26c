"""A write's transaction, one object per dialect: how it begins, how long it waits for the
database lock, how it commits, and the statements that run inside it.

The writer knows none of this: it asks ``transactions_for(settings, storage)`` once and then
only says how long a transaction may wait for the lock. SQLite writes on the writer's own
bare ``sqlite3`` connection (this module and ``sqlite_writes.py`` import no SQLAlchemy, so
``outbox add`` does not load it); PostgreSQL through the engine's pool
(``postgres_transactions.py``, loaded only for it).
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from outbox.core.record import Record
from outbox.store.rows import StoredRecord
from outbox.store.sqlite_writes import SqliteRows, connect_writer, sqlite_path

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.store.storage import Storage

T = TypeVar("T")


class RowWrites(Protocol):
    """The statements of a write, inside the transaction on ``conn``: a bare ``sqlite3``
    connection for ``SqliteRows``, a SQLAlchemy one for ``RecordStore`` (PostgreSQL)."""

    def lookup_many(
        self, conn: Any, keys: Sequence[str], names: Sequence[str]
    ) -> tuple[set[str], dict[str, str]]: ...

    def insert_records(
        self,
        conn: Any,
        named: Sequence[tuple[Record, str]],
        *,
        sinks: Sequence[str],
        origin: str,
        now: float,
    ) -> list[int | None]: ...

    def get_record(self, key: str, conn: Any) -> StoredRecord | None: ...


class Transactions(Protocol):
    """Begins, bounds and commits a write's transaction for one dialect."""

    @property
    def rows(self) -> RowWrites:
        """The statements that run inside the transaction."""

    def transaction(self, lock_wait: float | None) -> contextlib.AbstractContextManager[Any]:
        """A transaction, committed when the block ends and rolled back if it raises. Its
        wait for the database lock ends after ``lock_wait`` seconds, or the configured busy
        timeout when None; it yields the connection ``rows`` take."""

    def within(self, seconds: float, work: Callable[[], T]) -> T:
        """``work()``, cut off after ``seconds`` where the database may never answer."""

    def joined(self, conn: Any) -> Any:
        """The connection ``rows`` take inside a caller's own SQLAlchemy transaction on
        ``conn`` (``Outbox.enqueue``)."""

    def close(self) -> None:
        """Give back what the transactions hold between writes."""


class SqliteTransactions:
    """``BEGIN IMMEDIATE`` ... ``COMMIT`` on the writer's own bare-driver connection, kept
    between writes: no pool checkout per write, and no SQLAlchemy. Only the thread holding
    the mirror lock uses it; one that saw an error is dropped and the next write opens
    another. A shortened lock wait is a ``busy_timeout`` for that transaction only.
    """

    def __init__(self, connect: Callable[[], sqlite3.Connection], busy_timeout: float) -> None:
        self.connect = connect  # opens the connection (a test may wrap it)
        self.busy_timeout = busy_timeout
        self._connection: sqlite3.Connection | None = None
        self._rows = SqliteRows()

    @property
    def rows(self) -> RowWrites:
        return self._rows

    @contextlib.contextmanager
    def transaction(self, lock_wait: float | None) -> Iterator[sqlite3.Connection]:
        if self._connection is None:
            self._connection = self.connect()
        driver = self._connection
        try:
            if lock_wait is not None:
                driver.execute(f"PRAGMA busy_timeout = {max(0, int(lock_wait * 1000))}")
            driver.execute("BEGIN IMMEDIATE")
            yield driver
            driver.execute("COMMIT")
            if lock_wait is not None:
                driver.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        except BaseException:
            self.close()  # closing a connection inside a transaction rolls it back
            raise

    def within(self, seconds: float, work: Callable[[], T]) -> T:
        """SQLite's waits are bounded by its busy timeout: no helper thread needed."""
        return work()

    def joined(self, conn: Any) -> sqlite3.Connection:
        """The caller's transaction's own driver connection: the rows run on the bare driver."""
        driver: sqlite3.Connection = conn.connection.driver_connection
        return driver

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
            self._connection = None


def transactions_for(settings: Settings, storage: Callable[[], Storage]) -> Transactions:
    """The transactions of ``settings.db_url``'s dialect: a SQLite file is written on the
    bare driver; anything else (PostgreSQL, an in-memory SQLite database that no second
    connection could see) through ``storage``'s engine."""
    path = sqlite_path(settings.db_url)
    if path is not None:
        connect = functools.partial(
            connect_writer,
            path,
            busy_timeout=settings.busy_timeout,
            synchronous=settings.synchronous,
        )
        return SqliteTransactions(connect, settings.busy_timeout)
    from outbox.store.postgres_transactions import PostgresTransactions

    return PostgresTransactions(storage)
