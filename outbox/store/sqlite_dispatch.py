"""A dispatcher batch's statements on SQLite's bare ``sqlite3`` driver: the claim, the
settle, the outcomes owed to the mirrors (with every row of their records) and clearing them.

SQLAlchemy's statement handling was most of a no-op batch's database time (docs/benchmarks.md),
so on SQLite these run on a pooled connection's own driver, in transactions begun here with
``BEGIN IMMEDIATE`` as the engine begins them. They write the same rows under the same lease
guards as the Core statements PostgreSQL runs (``deliveries.py``, ``mirror_state.py``); the
storage conformance suite holds both to one behaviour. Free of SQLAlchemy, like
``sqlite_writes.py``.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from outbox.core.states import DeliveryState
from outbox.store.rows import DeliveryRow
from outbox.store.steady import OUTCOMES_OWED

# A pooled connection's own driver for the block, given back after (the caller's pool).
Connect = Callable[[], contextlib.AbstractContextManager[sqlite3.Connection]]

_LEASED = DeliveryState.LEASED.value
_DUE = f"'{DeliveryState.PENDING.value}', '{_LEASED}'"

_CLAIM = (
    "UPDATE deliveries SET state = :leased, lease_owner = :owner, lease_expires_at = :expires,"
    " available_at = :expires, attempts = attempts + 1, updated_at = :now"
    " WHERE id IN (SELECT id FROM deliveries WHERE sink = :sink"
    f" AND state IN ({_DUE}) AND available_at <= :now ORDER BY available_at LIMIT :limit)"
    " RETURNING id, record_key, attempts, op"
)
# The lease guard every write of a lease holder carries.
_OURS = f"lease_owner = :owner AND state = '{_LEASED}'"
_DELIVERED = (
    f"UPDATE deliveries SET state = '{DeliveryState.DELIVERED.value}', sink_id = given.value,"
    " delivered_at = :now, available_at = :now, lease_owner = NULL, lease_expires_at = NULL,"
    " last_error = NULL, mirror_pending = 1, updated_at = :now"
    " FROM json_each(:given) AS given WHERE deliveries.id = CAST(given.key AS INTEGER)"
    f" AND deliveries.lease_owner = :owner AND deliveries.state = '{_LEASED}'"
    " RETURNING deliveries.id"
)
_DELETED = (
    f"UPDATE deliveries SET state = '{DeliveryState.FORGOTTEN.value}', lease_owner = NULL,"
    " lease_expires_at = NULL, last_error = NULL, available_at = :now, mirror_pending = 1,"
    f" updated_at = :now WHERE id = :id AND {_OURS}"
)
_FAILED = (
    "UPDATE deliveries SET state = :state, available_at = :at, mirror_pending = 1,"
    " last_error = :error, error_class = :reason, lease_owner = NULL, lease_expires_at = NULL,"
    f" updated_at = :now WHERE id = :id AND {_OURS}"
)
# A DeliveryRow's fields, in its order.
_ROW = (
    "id, record_key, sink, state, attempts, available_at, last_error, error_class, sink_id,"
    " mirror_pending, created_at, delivered_at, op"
)
_OWED = (
    f"SELECT {_ROW} FROM deliveries WHERE record_key IN (SELECT record_key FROM deliveries"
    f" WHERE {OUTCOMES_OWED} AND deliveries.id > :after ORDER BY id LIMIT :limit) ORDER BY id"
)
_CLEAR = (
    "UPDATE deliveries SET mirror_pending = 0"
    " WHERE id = :id AND state = :state AND attempts = :attempts"
)


@contextlib.contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction, begun as the engine begins every writer's: the lock up front."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def delivery_row(values: Sequence[Any]) -> DeliveryRow:
    """A row of ``_ROW``'s columns as a DeliveryRow."""
    (delivery_id, key, sink, state, attempts, available_at, *rest) = values
    last_error, error_class, sink_id, pending, created_at, delivered_at, op = rest
    return DeliveryRow(
        delivery_id,
        key,
        sink,
        state,
        attempts,
        available_at,
        last_error,
        error_class,
        sink_id,
        bool(pending),
        created_at,
        delivered_at,
        op,
    )


class SqliteDispatch:
    """The batch statements, writing on ``writer``'s connections and reading on ``reader``'s."""

    def __init__(self, writer: Connect, reader: Connect) -> None:
        self._writer = writer
        self._reader = reader

    def claim(
        self, sink: str, owner: str, limit: int, expires: float, now: float
    ) -> list[tuple[int, str, int, str]]:
        """Lease up to ``limit`` due rows of ``sink``: (id, key, attempts, op) of each."""
        params = {
            "leased": _LEASED,
            "owner": owner,
            "expires": expires,
            "now": now,
            "sink": sink,
            "limit": limit,
        }
        with self._writer() as conn, immediate(conn):
            return [(int(i), str(k), int(a), str(o)) for i, k, a, o in conn.execute(_CLAIM, params)]

    def settle(
        self,
        owner: str,
        delivered: Sequence[tuple[int, str]],
        failed: Sequence[tuple[int, str, str, float | None]],
        deleted: Sequence[int],
        now: float,
    ) -> tuple[list[int], list[int]]:
        """One transaction for a batch's outcomes, each row only while ``owner`` leases it:
        (ids delivered or deleted, ids put back or dead-lettered)."""
        done: list[int] = []
        put_back: list[int] = []
        with self._writer() as conn, immediate(conn):
            if delivered:
                given: dict[str, str] = {}
                for delivery_id, sink_id in delivered:
                    given.setdefault(str(delivery_id), sink_id)  # a repeated id settles once
                params = {"given": json.dumps(given), "owner": owner, "now": now}
                ours = {int(row[0]) for row in conn.execute(_DELIVERED, params)}
                done = [int(i) for i in given if int(i) in ours]
            for delivery_id in deleted:
                if conn.execute(_DELETED, {"id": delivery_id, "owner": owner, "now": now}).rowcount:
                    done.append(delivery_id)
            for delivery_id, error, reason, next_at in failed:
                retry = next_at is not None
                params = {
                    "state": (DeliveryState.PENDING if retry else DeliveryState.DEAD).value,
                    "at": next_at if retry else now,
                    "error": error[:2000],
                    "reason": reason,
                    "now": now,
                    "id": delivery_id,
                    "owner": owner,
                }
                if conn.execute(_FAILED, params).rowcount:
                    put_back.append(delivery_id)
        return done, put_back

    def owed(
        self, origin: str, limit: int, after: int = 0
    ) -> tuple[list[DeliveryRow], dict[str, list[DeliveryRow]]]:
        """The first ``limit`` outcomes of ``origin``'s records still to mirror past the id
        ``after``, oldest first, and every delivery row of their records (the front matter
        names each sink's state), in one read: (their records' owed rows, all rows by key in
        id order). An owed row outside the page whose record is read anyway comes with it."""
        values = {"origin": origin, "limit": limit, "after": after}
        with self._reader() as conn:
            rows = [delivery_row(row) for row in conn.execute(_OWED, values)]
        by_key: dict[str, list[DeliveryRow]] = {}
        for row in rows:
            by_key.setdefault(row.key, []).append(row)
        return [row for row in rows if row.mirror_pending], by_key

    def clear(self, mirrored: Sequence[DeliveryRow]) -> None:
        """Mark these outcomes mirrored, each only while its row is still as it was read."""
        params = [
            {"id": row.delivery_id, "state": row.state, "attempts": row.attempts}
            for row in mirrored
        ]
        with self._writer() as conn, immediate(conn):
            conn.executemany(_CLEAR, params)
