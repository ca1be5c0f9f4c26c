"""PostgreSQL's write transaction: the engine's pool, ``lock_timeout`` and a wake-up.

The pool's pre-ping notices a restarted server; a shortened lock wait is a ``SET LOCAL
lock_timeout`` for that transaction only (at least 1 ms: 0 would mean "wait forever"); every
transaction queues a ``NOTIFY`` for the dispatchers, sent at commit (``wakeup.py``). A server
that stops answering cannot be bounded by any timeout of its own, so the whole write runs
under ``call_within`` (``bounded.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

from sqlalchemy import Connection

from outbox.store.bounded import call_within
from outbox.store.storage import Storage
from outbox.store.transactions import RowWrites
from outbox.store.wakeup import notify

T = TypeVar("T")


class PostgresTransactions:
    """Transactions on ``storage``'s engine (built on first use), with its ``RecordStore``
    statements. An in-memory SQLite database takes this way too: it has no file that the
    bare driver could open beside the engine, and no other writer to wait for."""

    def __init__(self, storage: Callable[[], Storage]) -> None:
        self.storage = storage

    @property
    def rows(self) -> RowWrites:
        return self.storage().records

    @contextlib.contextmanager
    def transaction(self, lock_wait: float | None) -> Iterator[Connection]:
        with self.storage().engine.begin() as conn:
            if lock_wait is not None:
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {max(1, int(lock_wait * 1000))}")
            yield conn
            notify(conn)

    def within(self, seconds: float, work: Callable[[], T]) -> T:
        return call_within(seconds, work, "write")

    def joined(self, conn: Connection) -> Connection:
        """The caller's own connection: the rows run through SQLAlchemy."""
        return conn

    def close(self) -> None:
        """Nothing is held between writes: the pool keeps the connections."""
