"""What the JSONL and markdown mirrors still have to catch up on.

Two things: per machine, how far the mirror repair got (``mirror_state``), and which
delivery outcomes are not mirrored yet (the ``mirror_pending`` flag on ``deliveries``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import Engine, Table, bindparam, select, text, update
from sqlalchemy.dialects import postgresql, sqlite

from outbox.store.delivery_reads import DeliveryRow, row_to_delivery
from outbox.store.engine import driver_of
from outbox.store.schema import deliveries, mirror_state
from outbox.store.sqlite_dispatch import SqliteDispatch
from outbox.store.steady import OUTCOMES_OWED, Watermark

# What a delivery sync reads per page: the outcomes owed, and every row of their records.
Owed = tuple[list[DeliveryRow], dict[str, list[DeliveryRow]]]


class MirrorStateStore:
    """The mirror repair's watermark and the outstanding mirror updates."""

    def __init__(self, engine: Engine, reader: Engine) -> None:
        self.engine = engine
        self.reader = reader
        # Each dialect's INSERT with ON CONFLICT: the same call, from its own module.
        postgres = engine.dialect.name == "postgresql"
        self._insert: Callable[[Table], Any] = postgresql.insert if postgres else sqlite.insert
        # SQLite's owed outcomes are read and cleared on the bare driver, once per batch.
        self._bare = (
            None
            if postgres
            else SqliteDispatch(lambda: driver_of(engine), lambda: driver_of(reader))
        )

    def mirror_watermark(self, mirror_id: str) -> Watermark:
        """Where the last repair of ``mirror_id``'s mirrors got to (all zero: never ran)."""
        with self.reader.connect() as conn:
            row = conn.execute(
                select(
                    mirror_state.c.record_seq, mirror_state.c.jsonl_offset, mirror_state.c.line_hash
                ).where(mirror_state.c.mirror_id == mirror_id)
            ).first()
        if row is None:
            return Watermark(0, 0, None)
        return Watermark(int(row.record_seq), int(row.jsonl_offset), row.line_hash)

    def set_mirror_watermark(
        self, mirror_id: str, record_seq: int, offset: int, line_hash: str | None = None
    ) -> None:
        """Store how far ``mirror_id``'s repair got, replacing the previous watermark."""
        values = {
            "record_seq": record_seq,
            "jsonl_offset": offset,
            "line_hash": line_hash,
            "updated_at": time.time(),
        }
        statement = self._insert(mirror_state).values(mirror_id=mirror_id, **values)
        statement = statement.on_conflict_do_update(index_elements=["mirror_id"], set_=values)
        with self.engine.begin() as conn:
            conn.execute(statement)

    def mirror_pending(self, origin: str, limit: int = 1000) -> list[DeliveryRow]:
        """Outcomes of ``origin``'s records still to be mirrored, oldest first (what is owed:
        ``steady.OUTCOMES_OWED``, the direct write's check too).

        The origin test is a correlated EXISTS, not a join: joined, SQLite drove the query
        from every record of the origin (all of them, on one machine), so each call grew with
        the outbox, and it runs twice per dispatcher batch. This way it walks only the
        partial index of pending rows, in id order.
        """
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(deliveries)
                .where(text(OUTCOMES_OWED).bindparams(origin=origin))
                .order_by(deliveries.c.id)
                .limit(limit)
            ).all()
        return [row_to_delivery(row) for row in rows]

    def owed(self, origin: str, limit: int = 1000, after: int = 0) -> Owed:
        """What ``mirror_pending`` gives past the delivery id ``after`` (a sync's page
        cursor), with every delivery row of those records (the front matter names each
        sink's state), in one read: (their records' owed rows, oldest first; all their rows
        by key, in id order). An owed row outside the page whose record is read anyway
        comes with it."""
        if self._bare is not None:
            return self._bare.owed(origin, limit, after)
        first = (
            select(deliveries.c.record_key)
            .where(text(OUTCOMES_OWED).bindparams(origin=origin), deliveries.c.id > after)
            .order_by(deliveries.c.id)
            .limit(limit)
        )
        query = select(deliveries).where(deliveries.c.record_key.in_(first.scalar_subquery()))
        with self.reader.connect() as conn:
            rows = [row_to_delivery(row) for row in conn.execute(query.order_by(deliveries.c.id))]
        by_key: dict[str, list[DeliveryRow]] = {}
        for row in rows:
            by_key.setdefault(row.key, []).append(row)
        return [row for row in rows if row.mirror_pending], by_key

    def clear_mirror_pending(self, mirrored: Sequence[DeliveryRow]) -> None:
        """Mark these outcomes mirrored, each only if its row is still as it was read: a
        dispatcher may have settled it again meanwhile (another attempt, another state),
        and that outcome still needs its own line."""
        if not mirrored:
            return
        if self._bare is not None:
            self._bare.clear(mirrored)
            return
        with self.engine.begin() as conn:
            conn.execute(
                update(deliveries)
                .where(
                    deliveries.c.id == bindparam("m_id"),
                    deliveries.c.state == bindparam("m_state"),
                    deliveries.c.attempts == bindparam("m_attempts"),
                )
                .values(mirror_pending=0),
                [
                    {"m_id": row.delivery_id, "m_state": row.state, "m_attempts": row.attempts}
                    for row in mirrored
                ],
            )
