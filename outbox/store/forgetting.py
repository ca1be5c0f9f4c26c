"""Forget in the database: a record becomes a tombstone and each sink's row a delete.

The forget is one transaction: the content, tags, metadata and slug are emptied, the search
index row and the graph node are removed, and every sink that may hold the record gets a
``delete`` row that the dispatcher retries like a delivery. A sink that was never sent the
record is settled at once: it never will be. The mirrors' part (log redaction, markdown file)
and the purge of the database's leftover copies follow, each flagged on the row until done.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, delete, func, insert, select, text, update

from outbox.core.states import DeliveryOp, DeliveryState
from outbox.store.rows import StoredRecord, row_to_record
from outbox.store.schema import deliveries, graph_edges, graph_nodes, records
from outbox.store.steady import FORGETS_OWED, MIRRORS_DUE, PURGE_DUE, PURGE_OWED

# What forgets still owe, as the steady-state check reads it too (``steady.py``).
_MIRRORS_OWED = text(FORGETS_OWED)
_PURGE_OWED = text(PURGE_OWED)


@dataclass(frozen=True)
class ForgetPlan:
    """What one forget's commit did, for the mirrors and the caller's receipt."""

    key: str
    seq: int
    markdown_name: str
    deletes: list[str] = field(default_factory=list)  # sinks that get a delete
    never_sent: list[str] = field(default_factory=list)  # sinks the record never reached
    already: bool = False  # it was forgotten before: nothing changed


@dataclass(frozen=True)
class Tombstone:
    """What is left of a forgotten record, as the log tells it (``outbox rebuild``), and
    the sinks whose delete the log records as done. ``owed``: a forget cut off before its
    mirrors were done left words behind (its accepted line, or ``markdown_name``'s file)."""

    key: str
    timestamp: str
    importance: int
    sinks: tuple[str, ...]
    deleted: frozenset[str]
    markdown_name: str = ""
    owed: bool = False


@dataclass(frozen=True)
class PurgeResult:
    """Whether the database's own leftovers are gone: ``complete`` is False when another
    connection's open read kept the WAL from being truncated (the next purge retries)."""

    records: int
    complete: bool


class ForgetStore:
    """The forget's writes on ``engine`` and the reads of what it still owes on ``reader``."""

    def __init__(self, engine: Engine, reader: Engine) -> None:
        self.engine = engine
        self.reader = reader
        self._sqlite = engine.dialect.name == "sqlite"

    def forget(
        self,
        key: str,
        sinks: Sequence[str],
        now: float | None = None,
        deleted: Collection[str] | None = None,
    ) -> ForgetPlan | None:
        """Tombstone ``key`` and queue its sink deletes in one transaction; None when the
        outbox has no such record. ``deleted``: a forget the log already records, over a
        database restored from before it, whose rows cannot tell what the sinks got since:
        every sink gets a delete but those the log says deleted it, which are settled."""
        now = time.time() if now is None else now
        with self.engine.begin() as conn:
            if self._sqlite:
                # Deleted cells and freed pages are overwritten, not just unlinked.
                conn.exec_driver_sql("PRAGMA secure_delete = ON")
            query = select(records.c.seq, records.c.markdown_name, records.c.forgotten_at).where(
                records.c.key == key
            )
            if not self._sqlite:
                query = query.with_for_update()
            row = conn.execute(query).first()
            if row is None:
                return None
            if row.forgotten_at is not None:
                return ForgetPlan(key, row.seq, row.markdown_name, already=True)
            self._empty_record(conn, key, row.seq, now)
            deletes, never_sent = self._turn_deliveries(conn, key, sinks, now, deleted)
        return ForgetPlan(key, row.seq, row.markdown_name, deletes, never_sent)

    def _empty_record(self, conn: Connection, key: str, seq: int, now: float) -> None:
        if self._sqlite:
            conn.exec_driver_sql("DELETE FROM records_fts WHERE rowid = ?", (seq,))
        conn.execute(
            update(records)
            .where(records.c.key == key)
            .values(
                content="",
                tags=[],
                meta={},
                slug="",
                forgotten_at=now,
                redaction_pending=MIRRORS_DUE,
            )
        )
        conn.execute(
            delete(graph_edges).where((graph_edges.c.target == key) | (graph_edges.c.source == key))
        )
        conn.execute(delete(graph_nodes).where(graph_nodes.c.id == key))

    @staticmethod
    def _turn_deliveries(
        conn: Connection,
        key: str,
        sinks: Sequence[str],
        now: float,
        deleted: Collection[str] | None = None,
    ) -> tuple[list[str], list[str]]:
        """Every row becomes a delete; one never attempted is settled now (the sink never
        saw the record), and a configured sink without a row (pruned since) gets one."""
        rows = conn.execute(
            select(
                deliveries.c.id, deliveries.c.sink, deliveries.c.state, deliveries.c.attempts
            ).where(deliveries.c.record_key == key)
        ).all()
        deletes: list[str] = []
        never_sent: list[str] = []
        cleared: dict[str, Any] = {
            "op": DeliveryOp.DELETE,
            "lease_owner": None,
            "lease_expires_at": None,
            "last_error": None,
            "error_class": None,
            "mirror_pending": 0,
            "available_at": now,
            "updated_at": now,
        }
        for row in rows:
            untried = (
                row.state == DeliveryState.PENDING and row.attempts == 0
                if deleted is None
                else row.sink in deleted
            )
            state = DeliveryState.FORGOTTEN if untried else DeliveryState.PENDING
            (never_sent if untried else deletes).append(row.sink)
            conn.execute(
                update(deliveries)
                .where(deliveries.c.id == row.id)
                .values(state=state, attempts=0, **cleared)
            )
        for sink in sorted(set(sinks) - {row.sink for row in rows} - set(deleted or ())):
            deletes.append(sink)
            conn.execute(
                insert(deliveries).values(
                    record_key=key,
                    sink=sink,
                    state=DeliveryState.PENDING,
                    attempts=0,
                    created_at=now,
                    **cleared,
                )
            )
        return sorted(deletes), sorted(never_sent)

    def restore(
        self,
        conn: Connection,
        tombstones: Sequence[Tombstone],
        sinks: Sequence[str],
        origin: str,
        now: float,
    ) -> int:
        """Put forgotten records back as the tombstones they were (``outbox rebuild``), in
        the caller's transaction: no content, no search row, no graph node. A sink whose
        delete the log records is settled; every other sink gets its delete again (a sink
        deletes idempotently). A tombstone whose forget was cut off owes its mirrors (the
        next redaction finishes them). Returns how many were written; a key already there
        is left to the caller."""
        written = 0
        for item in tombstones:
            exists = conn.execute(select(records.c.seq).where(records.c.key == item.key)).first()
            if exists is not None:
                continue
            conn.execute(
                insert(records).values(
                    key=item.key,
                    ts=item.timestamp,
                    content="",
                    importance=item.importance,
                    tags=[],
                    meta={},
                    slug="",
                    markdown_name=item.markdown_name,
                    origin=origin,
                    created_at=now,
                    forgotten_at=now,
                    redaction_pending=MIRRORS_DUE if item.owed else 0,
                )
            )
            for sink in sorted({*item.sinks, *sinks}):
                done = sink in item.deleted
                conn.execute(
                    insert(deliveries).values(
                        record_key=item.key,
                        sink=sink,
                        state=DeliveryState.FORGOTTEN if done else DeliveryState.PENDING,
                        op=DeliveryOp.DELETE,
                        attempts=1 if done else 0,
                        available_at=now,
                        mirror_pending=0,
                        created_at=now,
                        updated_at=now,
                    )
                )
            written += 1
        return written

    # -- what forgets still owe -------------------------------------------------------------

    def mirrors_due(self, origin: str, limit: int = 500) -> list[StoredRecord]:
        """``origin``'s forgotten records whose log line or file is not yet dealt with.

        Read through the small partial index in seq order, with the origin tested here: a
        condition on ``origin`` in SQL makes SQLite pick the origin index instead, which
        holds every record of this machine.
        """
        found: list[StoredRecord] = []
        last = 0
        with self.reader.connect() as conn:
            while len(found) < limit:
                rows = conn.execute(
                    select(records)
                    .where(_MIRRORS_OWED)
                    .where(records.c.seq > last)
                    .order_by(records.c.seq)
                    .limit(limit)
                ).all()
                if not rows:
                    break
                found.extend(row_to_record(row) for row in rows if row.origin == origin)
                last = rows[-1].seq
        return found[:limit]

    def mirrors_done(self, keys: Sequence[str]) -> None:
        """The forgets' mirrors are done: the file name (words of the content) goes too."""
        if not keys:
            return
        with self.engine.begin() as conn:
            if self._sqlite:
                conn.exec_driver_sql("PRAGMA secure_delete = ON")
            conn.execute(
                update(records)
                .where(records.c.key.in_(list(keys)), records.c.redaction_pending == MIRRORS_DUE)
                .values(markdown_name="", redaction_pending=PURGE_DUE)
            )

    def purge_due(self) -> int:
        """How many forgets wait for the purge of the database's own copies."""
        with self.reader.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(records).where(_PURGE_OWED)
                ).scalar_one()
            )

    def purge(self) -> PurgeResult:
        """Remove what a forget leaves in the database files themselves.

        SQLite: merge the search index into one segment (old segments held the words), with
        freed pages zeroed, then truncate the WAL, whose old frames held the rows before the
        forget. PostgreSQL: VACUUM the tables, so dead row versions are no longer kept.
        """
        with self.reader.connect() as conn:
            keys = list(conn.execute(select(records.c.key).where(_PURGE_OWED)).scalars())
        if not keys:
            return PurgeResult(0, True)
        complete = self._purge_sqlite() if self._sqlite else self._purge_postgres()
        if complete:
            with self.engine.begin() as conn:
                conn.execute(
                    update(records)
                    .where(records.c.key.in_(keys), records.c.redaction_pending == PURGE_DUE)
                    .values(redaction_pending=0)
                )
        return PurgeResult(len(keys), complete)

    def _purge_sqlite(self) -> bool:
        with self.engine.begin() as conn:
            conn.exec_driver_sql("PRAGMA secure_delete = ON")
            conn.exec_driver_sql("INSERT INTO records_fts(records_fts) VALUES ('optimize')")
        raw = self.engine.raw_connection()
        try:
            busy, _, _ = raw.driver_connection.execute(  # type: ignore[union-attr]
                "PRAGMA wal_checkpoint(TRUNCATE)"
            ).fetchone()
        finally:
            raw.close()
        return not busy

    def _purge_postgres(self) -> bool:
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in ("records", "graph_nodes", "deliveries"):
                conn.exec_driver_sql(f"VACUUM {table}")
        return True
