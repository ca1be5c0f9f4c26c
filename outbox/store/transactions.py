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
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from outbox.core.record import Record
from outbox.store.rows import StoredRecord
from outbox.store.sqlite_writes import SqliteRows, connect_writer, sqlite_path

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.store.storage import Storage

T = TypeVar("T")

# ``begin_immediate``'s pauses between tries for the database lock, as the mirror lock's
# waiters poll: a try costs a failed statement, so not more often than this.
BEGIN_FIRST_PAUSE = 0.0005
BEGIN_LONGEST_PAUSE = 0.002


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
    another. Its wait for the database lock is ``begin_immediate``'s.
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
            self._connection.execute("PRAGMA busy_timeout = 0")  # begin_immediate waits
        driver = self._connection
        try:
            begin_immediate(driver, self.busy_timeout if lock_wait is None else lock_wait)
            yield driver
            driver.execute("COMMIT")
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


def begin_immediate(driver: sqlite3.Connection, wait: float) -> None:
    """``BEGIN IMMEDIATE`` on a connection with no busy timeout, tried again every
    millisecond or two until ``wait`` seconds pass; the last try's SQLITE_BUSY is raised.

    SQLite's own busy handler sleeps 1, 2, 5, 10 ... 100 ms between tries: a writer process
    that met another's transaction could sleep through dozens of the other's commits, and
    one ``add`` of two writer processes took up to half a second (of four, over one). Once
    the lock is held nothing inside a WAL transaction waits for one (the snapshot is taken,
    the commit's checkpoint is passive), so the connection needs no busy timeout of its own.
    """
    deadline = time.monotonic() + wait
    pause = BEGIN_FIRST_PAUSE
    while True:
        try:
            driver.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            busy = getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_BUSY
            if not busy or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, BEGIN_LONGEST_PAUSE)


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
