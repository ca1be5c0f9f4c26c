"""The one storage interface every backend passes the same conformance suite through.

All SQL lives here, written once in SQLAlchemy Core; the few dialect differences (insert
conflict handling, ``FOR UPDATE SKIP LOCKED`` on PostgreSQL claims) are chosen per dialect.
No method holds a transaction open while anything outside the database runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, and_, bindparam, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite

from outbox.record import Record
from outbox.store.schema import (
    FRONTIER_NODE_ID,
    deliveries,
    graph_edges,
    graph_nodes,
    mirror_state,
    records,
)

PENDING, LEASED, DELIVERED, DEAD, DISCARDED = "pending", "leased", "delivered", "dead", "discarded"
# How far pending_summary counts: beyond this a backlog is reported as "at least this many".
PENDING_DEPTH_CAP = 1000
STATES = (PENDING, LEASED, DELIVERED, DEAD, DISCARDED)


@dataclass(frozen=True)
class StoredRecord:
    seq: int
    record: Record
    markdown_name: str
    origin: str
    created_at: float


class Watermark(NamedTuple):
    """How far the mirror repair got: the last record seq, the JSONL offset, and the hash of
    the line that ends at that offset (None before migration 0004 or for an empty log)."""

    record_seq: int
    offset: int
    line_hash: str | None


@dataclass(frozen=True)
class Claim:
    """A delivery row leased to one dispatcher."""

    delivery_id: int
    key: str
    sink: str
    attempts: int


@dataclass(frozen=True)
class DeliveryRow:
    delivery_id: int
    key: str
    sink: str
    state: str
    attempts: int
    available_at: float
    last_error: str | None
    error_class: str | None
    sink_id: str | None
    mirror_pending: bool
    created_at: float
    delivered_at: float | None


def _row_to_record(row: Any) -> StoredRecord:
    return StoredRecord(
        seq=row.seq,
        record=Record(
            key=row.key,
            timestamp=row.ts,
            content=row.content,
            importance=row.importance,
            tags=tuple(row.tags or ()),
            metadata=dict(row.meta or {}),
            slug=row.slug,
        ),
        markdown_name=row.markdown_name,
        origin=row.origin,
        created_at=row.created_at,
    )


def _row_to_delivery(row: Any) -> DeliveryRow:
    return DeliveryRow(
        delivery_id=row.id,
        key=row.record_key,
        sink=row.sink,
        state=row.state,
        attempts=row.attempts,
        available_at=row.available_at,
        last_error=row.last_error,
        error_class=row.error_class,
        sink_id=row.sink_id,
        mirror_pending=bool(row.mirror_pending),
        created_at=row.created_at,
        delivered_at=row.delivered_at,
    )


def _node_row(record: Record, meta: dict[str, Any]) -> dict[str, Any]:
    """The AGENT_MEMORY node of a record (neo.mjs's shape, keyed by the record key)."""
    session_id, agent = meta.get("session_id"), meta.get("agent")
    return {
        "id": record.key,
        "label": "AGENT_MEMORY",
        "session_id": str(session_id) if session_id is not None else None,
        "agent": str(agent) if agent is not None else None,
        "ts": record.timestamp,
        "properties": {
            "name": f"Memory: {record.timestamp}",
            "timestamp": record.timestamp,
            "importance": record.importance,
            "semanticVectorId": record.key,
        },
    }


def _edge_row(record: Record) -> dict[str, Any]:
    return {
        "source": FRONTIER_NODE_ID,
        "target": record.key,
        "type": "SPAWNED_MEMORY",
        "weight": 0.8,
        "properties": {},
    }


def _delivery_row(record: Record, sink: str, now: float) -> dict[str, Any]:
    return {
        "record_key": record.key,
        "sink": sink,
        "state": PENDING,
        "attempts": 0,
        "available_at": now,
        "lease_owner": None,
        "lease_expires_at": None,
        "last_error": None,
        "error_class": None,
        "sink_id": None,
        "mirror_pending": 0,
        "created_at": now,
        "updated_at": now,
        "delivered_at": None,
    }


# Settling a delivered row; one statement for the whole batch (executemany).
_DELIVER = (
    update(deliveries)
    .where(
        deliveries.c.id == bindparam("b_id"),
        deliveries.c.lease_owner == bindparam("b_owner"),
        deliveries.c.state == LEASED,
    )
    .values(
        state=DELIVERED,
        sink_id=bindparam("b_sink_id"),
        delivered_at=bindparam("b_now"),
        available_at=bindparam("b_now"),
        lease_owner=None,
        lease_expires_at=None,
        last_error=None,
        mirror_pending=1,
        updated_at=bindparam("b_now"),
    )
)


class _Compiled:
    """A Core statement compiled once to the driver's SQL and parameter order.

    The write path runs these on the raw SQLite connection: the SQL is still written once,
    in SQLAlchemy, but each execution skips about 50 µs of per-statement overhead.
    """

    def __init__(self, statement: Any, dialect: Any) -> None:
        compiled = statement.compile(dialect=dialect)
        self.sql = str(compiled)
        self.order = list(compiled.positiontup or [])

    def args(self, params: dict[str, Any]) -> list[Any]:
        return [params[name] for name in self.order]


def _binds(table: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {col.name: bindparam(col.name) for col in table.columns if col.name not in skip}


class Storage:
    """Reads and writes of records, graph and deliveries over one SQLAlchemy engine."""

    def __init__(self, engine: Engine, reader: Engine | None = None) -> None:
        self.engine = engine
        self.reader = reader or engine
        self.dialect = engine.dialect.name
        self._insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        self._fast: dict[str, _Compiled] = {}
        if self.dialect == "sqlite":
            dialect = engine.dialect
            self._fast = {
                "lookup": _Compiled(
                    select(records.c.key, records.c.markdown_name).where(
                        (records.c.key == bindparam("key"))
                        | (records.c.markdown_name == bindparam("name"))
                    ),
                    dialect,
                ),
                "record": _Compiled(
                    sqlite.insert(records)
                    .values(_binds(records, ("seq",)))
                    .on_conflict_do_nothing(index_elements=["key"])
                    .returning(records.c.seq),
                    dialect,
                ),
                "node": _Compiled(graph_nodes.insert().values(_binds(graph_nodes)), dialect),
                "edge": _Compiled(
                    graph_edges.insert().values(_binds(graph_edges, ("id",))), dialect
                ),
                "delivery": _Compiled(
                    deliveries.insert().values(_binds(deliveries, ("id",))), dialect
                ),
            }

    # -- the write path -------------------------------------------------------------------

    def lookup(self, conn: Connection, key: str, name: str) -> tuple[bool, bool]:
        """(the key exists, another key owns the markdown name): one query for both."""
        if self._fast:
            statement = self._fast["lookup"]
            cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
            rows = cursor.execute(statement.sql, statement.args({"key": key, "name": name}))
            found = rows.fetchall()
        else:
            found = conn.execute(
                select(records.c.key, records.c.markdown_name).where(
                    (records.c.key == key) | (records.c.markdown_name == name)
                )
            ).all()
        exists = any(row[0] == key for row in found)
        taken = any(row[0] != key and row[1] == name for row in found)
        return exists, taken

    def insert_record(
        self,
        conn: Connection,
        record: Record,
        *,
        sinks: Sequence[str],
        markdown_name: str,
        origin: str,
        now: float,
    ) -> int | None:
        """Insert record, graph node, frontier edge and one delivery per sink.

        Returns the new ``seq``, or None when the key already exists (nothing is written).
        """
        if self._fast:
            return self._insert_sqlite(
                conn, record, sinks=sinks, markdown_name=markdown_name, origin=origin, now=now
            )
        meta = dict(record.metadata)
        seq = conn.execute(
            self._insert(records)
            .values(
                key=record.key,
                ts=record.timestamp,
                content=record.content,
                importance=record.importance,
                tags=list(record.tags),
                meta=meta,
                slug=record.slug,
                markdown_name=markdown_name,
                origin=origin,
                created_at=now,
            )
            .on_conflict_do_nothing(index_elements=["key"])
            .returning(records.c.seq)
        ).scalar()
        if seq is None:
            return None
        conn.execute(graph_nodes.insert(), _node_row(record, meta))
        conn.execute(graph_edges.insert(), _edge_row(record))
        if sinks:
            conn.execute(deliveries.insert(), [_delivery_row(record, s, now) for s in sinks])
        return int(seq)

    def _insert_sqlite(
        self,
        conn: Connection,
        record: Record,
        *,
        sinks: Sequence[str],
        markdown_name: str,
        origin: str,
        now: float,
    ) -> int | None:
        """The same rows as the portable path, through the raw driver connection."""
        fast = self._fast
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        meta = dict(record.metadata)
        row = cursor.execute(
            fast["record"].sql,
            fast["record"].args(
                {
                    "key": record.key,
                    "ts": record.timestamp,
                    "content": record.content,
                    "importance": record.importance,
                    "tags": json.dumps(list(record.tags)),
                    "meta": json.dumps(meta) if meta else "{}",
                    "slug": record.slug,
                    "markdown_name": markdown_name,
                    "origin": origin,
                    "created_at": now,
                }
            ),
        ).fetchone()
        if row is None:
            return None
        seq = int(row[0])
        cursor.execute(
            "INSERT INTO records_fts(rowid, content) VALUES (?, ?)", (seq, record.content)
        )
        node = _node_row(record, meta)
        node["properties"] = json.dumps(node["properties"])
        cursor.execute(fast["node"].sql, fast["node"].args(node))
        edge = _edge_row(record)
        edge["properties"] = json.dumps(edge["properties"]) if edge["properties"] else "{}"
        cursor.execute(fast["edge"].sql, fast["edge"].args(edge))
        if sinks:
            delivery = fast["delivery"]
            cursor.executemany(
                delivery.sql, [delivery.args(_delivery_row(record, sink, now)) for sink in sinks]
            )
        return seq

    def rename_markdown(self, conn: Connection, key: str, name: str) -> None:
        """Point a committed record at another markdown file name."""
        conn.execute(update(records).where(records.c.key == key).values(markdown_name=name))

    # -- reads ----------------------------------------------------------------------------

    def get_record(self, key: str, conn: Connection | None = None) -> StoredRecord | None:
        query = select(records).where(records.c.key == key)
        if conn is not None:
            row = conn.execute(query).first()
        else:
            with self.reader.connect() as own:
                row = own.execute(query).first()
        return _row_to_record(row) if row else None

    def get_records(self, keys: Iterable[str]) -> dict[str, StoredRecord]:
        wanted = list(keys)
        found: dict[str, StoredRecord] = {}
        with self.reader.connect() as conn:
            for start in range(0, len(wanted), 500):
                chunk = wanted[start : start + 500]
                for row in conn.execute(select(records).where(records.c.key.in_(chunk))):
                    found[row.key] = _row_to_record(row)
        return found

    def records_after(self, origin: str, seq: int, limit: int = 1000) -> list[StoredRecord]:
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(records)
                .where(records.c.origin == origin, records.c.seq > seq)
                .order_by(records.c.seq)
                .limit(limit)
            ).all()
        return [_row_to_record(row) for row in rows]

    def iter_records(self, origin: str | None = None, batch: int = 1000) -> Iterable[StoredRecord]:
        last = 0
        while True:
            query = select(records).where(records.c.seq > last).order_by(records.c.seq).limit(batch)
            if origin is not None:
                query = query.where(records.c.origin == origin)
            with self.reader.connect() as conn:
                rows = conn.execute(query).all()
            if not rows:
                return
            for row in rows:
                yield _row_to_record(row)
            last = rows[-1].seq

    def deliveries_for(self, keys: Iterable[str]) -> dict[str, list[DeliveryRow]]:
        wanted = list(keys)
        found: dict[str, list[DeliveryRow]] = {}
        with self.reader.connect() as conn:
            for start in range(0, len(wanted), 500):
                chunk = wanted[start : start + 500]
                query = select(deliveries).where(deliveries.c.record_key.in_(chunk))
                for row in conn.execute(query.order_by(deliveries.c.id)):
                    found.setdefault(row.record_key, []).append(_row_to_delivery(row))
        return found

    def count_records(self) -> int:
        with self.reader.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(records)).scalar_one())

    # -- the dispatcher ---------------------------------------------------------------------

    def claim(
        self, sink: str, owner: str, limit: int, lease_seconds: float, now: float | None = None
    ) -> list[Claim]:
        """Lease up to ``limit`` due rows of ``sink`` in one short transaction.

        Due means pending and past its retry time, or leased with an expired lease (its
        dispatcher died). The attempt is counted at claim time, so a record that kills its
        dispatcher still reaches the dead-letter cap.
        """
        now = time.time() if now is None else now
        expires = now + lease_seconds
        due = (
            select(deliveries.c.id)
            .where(
                deliveries.c.sink == sink,
                deliveries.c.state.in_((PENDING, LEASED)),
                deliveries.c.available_at <= now,
            )
            .order_by(deliveries.c.available_at)
            .limit(limit)
        )
        if self.dialect == "postgresql":
            due = due.with_for_update(skip_locked=True)
        statement = (
            update(deliveries)
            .where(deliveries.c.id.in_(due.scalar_subquery()))
            .values(
                state=LEASED,
                lease_owner=owner,
                lease_expires_at=expires,
                available_at=expires,
                attempts=deliveries.c.attempts + 1,
                updated_at=now,
            )
            .returning(deliveries.c.id, deliveries.c.record_key, deliveries.c.attempts)
        )
        with self.engine.begin() as conn:
            rows = conn.execute(statement).all()
        claims = [Claim(row.id, row.record_key, sink, row.attempts) for row in rows]
        claims.sort(key=lambda claim: claim.delivery_id)
        return claims

    def renew(self, owner: str, delivery_ids: Sequence[int], lease_seconds: float) -> int:
        if not delivery_ids:
            return 0
        now = time.time()
        expires = now + lease_seconds
        with self.engine.begin() as conn:
            result = conn.execute(
                update(deliveries)
                .where(
                    deliveries.c.id.in_(list(delivery_ids)),
                    deliveries.c.lease_owner == owner,
                    deliveries.c.state == LEASED,
                )
                .values(lease_expires_at=expires, available_at=expires, updated_at=now)
            )
        return result.rowcount

    def settle(
        self,
        owner: str,
        delivered: Sequence[tuple[int, str]],
        failed: Sequence[tuple[int, str, str, float | None]],
        now: float | None = None,
        *,
        purge_search_index: bool = False,
    ) -> tuple[list[int], list[int]]:
        """Record outcomes of one batch in one transaction, guarded by lease ownership.

        ``delivered`` holds (delivery id, sink id); ``failed`` holds (delivery id, error text,
        error class, next attempt time or None for a dead letter). Returns the ids actually
        updated (a row whose lease was taken over is left to its new owner).
        ``purge_search_index`` drops delivered records from the lexical overlay (set when
        the sink is the vector index).
        """
        now = time.time() if now is None else now
        done: list[int] = []
        dead_or_retry: list[int] = []
        owned = and_(deliveries.c.lease_owner == owner, deliveries.c.state == LEASED)
        with self.engine.begin() as conn:
            if purge_search_index and delivered and self.dialect == "sqlite":
                # The vector index holds these now: the lexical overlay no longer needs them.
                conn.execute(
                    text(
                        "DELETE FROM records_fts WHERE rowid IN (SELECT r.seq FROM records r "
                        "JOIN deliveries d ON d.record_key = r.key "
                        "WHERE d.id = :id AND d.lease_owner = :owner AND d.state = 'leased')"
                    ),
                    [{"id": delivery_id, "owner": owner} for delivery_id, _ in delivered],
                )
            if delivered:
                done = self._settle_delivered(conn, owner, delivered, now)
            for delivery_id, error, error_class, next_at in failed:
                values: dict[str, Any] = {
                    "last_error": error[:2000],
                    "error_class": error_class,
                    "lease_owner": None,
                    "lease_expires_at": None,
                    "updated_at": now,
                }
                if next_at is None:
                    values.update(state=DEAD, available_at=now, mirror_pending=1)
                else:
                    values.update(state=PENDING, available_at=next_at, mirror_pending=1)
                result = conn.execute(
                    update(deliveries).where(deliveries.c.id == delivery_id, owned).values(**values)
                )
                if result.rowcount:
                    dead_or_retry.append(delivery_id)
        return done, dead_or_retry

    def _settle_delivered(
        self, conn: Connection, owner: str, delivered: Sequence[tuple[int, str]], now: float
    ) -> list[int]:
        """Mark the owner's leased rows delivered: one ownership read, one batched update.

        Building an UPDATE per row was most of a batch's settle (7x the batched form for 64
        rows, benchmarks/ in docs/benchmarks.md). Reading first which rows are still ours,
        inside SQLite's write transaction or locked FOR UPDATE on PostgreSQL, keeps the
        per-row answer exact.
        """
        wanted = [delivery_id for delivery_id, _ in delivered]
        owned: set[int] = set()
        for start in range(0, len(wanted), 500):
            query = select(deliveries.c.id).where(
                deliveries.c.id.in_(wanted[start : start + 500]),
                deliveries.c.lease_owner == owner,
                deliveries.c.state == LEASED,
            )
            if self.dialect == "postgresql":
                query = query.with_for_update()
            owned.update(conn.execute(query).scalars())
        done: list[int] = []
        params: list[dict[str, Any]] = []
        for delivery_id, sink_id in delivered:
            if delivery_id in owned:
                owned.discard(delivery_id)  # a repeated id settles once, as before
                done.append(delivery_id)
                params.append(
                    {"b_id": delivery_id, "b_owner": owner, "b_sink_id": sink_id, "b_now": now}
                )
        if params:
            conn.execute(_DELIVER, params)
        return done

    def release(self, owner: str, delivery_ids: Sequence[int] | None = None) -> int:
        """Hand leased rows back untried (clean shutdown): the attempt is not counted."""
        now = time.time()
        condition = and_(deliveries.c.lease_owner == owner, deliveries.c.state == LEASED)
        if delivery_ids is not None:
            condition = and_(condition, deliveries.c.id.in_(list(delivery_ids)))
        with self.engine.begin() as conn:
            result = conn.execute(
                update(deliveries)
                .where(condition)
                .values(
                    state=PENDING,
                    available_at=now,
                    attempts=deliveries.c.attempts - 1,
                    lease_owner=None,
                    lease_expires_at=None,
                    updated_at=now,
                )
            )
        return result.rowcount

    def next_due_at(self, sinks: Sequence[str]) -> float | None:
        """The earliest time any row of these sinks becomes claimable."""
        with self.reader.connect() as conn:
            value = conn.execute(
                select(func.min(deliveries.c.available_at)).where(
                    deliveries.c.sink.in_(list(sinks)),
                    deliveries.c.state.in_((PENDING, LEASED)),
                )
            ).scalar()
        return float(value) if value is not None else None

    # -- mirrors --------------------------------------------------------------------------

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
        now = time.time()
        values = {
            "record_seq": record_seq,
            "jsonl_offset": offset,
            "line_hash": line_hash,
            "updated_at": now,
        }
        statement = self._insert(mirror_state).values(mirror_id=mirror_id, **values)
        statement = statement.on_conflict_do_update(index_elements=["mirror_id"], set_=values)
        with self.engine.begin() as conn:
            conn.execute(statement)

    def mirror_pending(self, origin: str, limit: int = 1000) -> list[DeliveryRow]:
        """Outcomes of ``origin``'s records still to be mirrored, oldest first.

        The origin test is a correlated EXISTS, not a join: joined, SQLite drove the query
        from every record of the origin (all of them, on one machine) and it grew with the
        outbox, 0.23 s per call at 100k records, twice per dispatcher batch. This way it
        walks only the partial index of pending rows, in id order.
        """
        mine = (
            select(records.c.key)
            .where(records.c.key == deliveries.c.record_key, records.c.origin == origin)
            .exists()
        )
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(deliveries)
                .where(deliveries.c.mirror_pending == 1, mine)
                .order_by(deliveries.c.id)
                .limit(limit)
            ).all()
        return [_row_to_delivery(row) for row in rows]

    def clear_mirror_pending(self, delivery_ids: Sequence[int]) -> None:
        if not delivery_ids:
            return
        with self.engine.begin() as conn:
            conn.execute(
                update(deliveries)
                .where(deliveries.c.id.in_(list(delivery_ids)))
                .values(mirror_pending=0)
            )

    # -- operations -----------------------------------------------------------------------

    def counts(self) -> dict[str, dict[str, int]]:
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(deliveries.c.sink, deliveries.c.state, func.count()).group_by(
                    deliveries.c.sink, deliveries.c.state
                )
            ).all()
        table: dict[str, dict[str, int]] = {}
        for sink, state, count in rows:
            table.setdefault(sink, dict.fromkeys(STATES, 0))[state] = int(count)
        return table

    def oldest_pending(self) -> dict[str, float]:
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(deliveries.c.sink, func.min(deliveries.c.created_at))
                .where(deliveries.c.state.in_((PENDING, LEASED)))
                .group_by(deliveries.c.sink)
            ).all()
        return {sink: float(created) for sink, created in rows}

    def pending_summary(self, sink: str, cap: int = PENDING_DEPTH_CAP) -> tuple[int, float | None]:
        """(rows of ``sink`` not delivered yet, counted up to ``cap``; the oldest one's
        creation time). ``add_memory`` reports both on every write, so neither may grow with
        the backlog: the count stops at ``cap`` and the oldest is one index step per state."""
        undelivered = (PENDING, LEASED)
        depth = (
            select(deliveries.c.id)
            .where(deliveries.c.sink == sink, deliveries.c.state.in_(undelivered))
            .limit(cap)
            .subquery()
        )
        oldest = [
            select(func.min(deliveries.c.created_at))
            .where(deliveries.c.sink == sink, deliveries.c.state == state)
            .scalar_subquery()
            for state in undelivered
        ]
        with self.reader.connect() as conn:
            count, *firsts = conn.execute(
                select(select(func.count()).select_from(depth).scalar_subquery(), *oldest)
            ).one()
        known = [float(value) for value in firsts if value is not None]
        return int(count), (min(known) if known else None)

    def retrying(self) -> dict[str, tuple[int, str | None]]:
        """Per sink: pending rows that already failed at least once, and the most recent
        failure's class (seed 000's readiness signal: the sink is in trouble right now)."""
        failed = and_(deliveries.c.state == PENDING, deliveries.c.error_class.is_not(None))
        found: dict[str, tuple[int, str | None]] = {}
        with self.reader.connect() as conn:
            for sink, count in conn.execute(
                select(deliveries.c.sink, func.count()).where(failed).group_by(deliveries.c.sink)
            ).all():
                latest = conn.execute(
                    select(deliveries.c.error_class)
                    .where(failed, deliveries.c.sink == sink)
                    .order_by(deliveries.c.updated_at.desc())
                    .limit(1)
                ).scalar()
                found[sink] = (int(count), latest)
        return found

    def list_deliveries(
        self, state: str, sink: str | None = None, limit: int = 100
    ) -> list[DeliveryRow]:
        query = select(deliveries).where(deliveries.c.state == state)
        if sink:
            query = query.where(deliveries.c.sink == sink)
        with self.reader.connect() as conn:
            rows = conn.execute(query.order_by(deliveries.c.id).limit(limit)).all()
        return [_row_to_delivery(row) for row in rows]

    def requeue_dead(self, keys: Sequence[str] | None, sink: str | None = None) -> int:
        """Give dead letters a fresh set of attempts."""
        now = time.time()
        return self._update_dead(
            keys, sink, state=PENDING, attempts=0, available_at=now, updated_at=now
        )

    def discard_dead(self, keys: Sequence[str] | None, sink: str | None = None) -> int:
        """Mark dead letters discarded: kept for audit, never retried."""
        return self._update_dead(keys, sink, state=DISCARDED, updated_at=time.time())

    def _update_dead(self, keys: Sequence[str] | None, sink: str | None, **values: Any) -> int:
        """Change dead letters (all, or those of ``keys`` / ``sink``) and flag their mirrors."""
        condition = deliveries.c.state == DEAD
        if keys:
            condition = and_(condition, deliveries.c.record_key.in_(list(keys)))
        if sink:
            condition = and_(condition, deliveries.c.sink == sink)
        with self.engine.begin() as conn:
            result = conn.execute(
                update(deliveries).where(condition).values(mirror_pending=1, **values)
            )
        return result.rowcount

    def prune_delivered(self, sinks: Sequence[str], older_than: float, limit: int = 5000) -> int:
        """Delete delivered rows past retention (the mirrors keep the history)."""
        total = 0
        for sink in sinks:
            ids = (
                select(deliveries.c.id)
                .where(
                    deliveries.c.sink == sink,
                    deliveries.c.state == DELIVERED,
                    deliveries.c.available_at < older_than,
                    deliveries.c.mirror_pending == 0,
                )
                .limit(limit)
            )
            with self.engine.begin() as conn:
                result = conn.execute(
                    deliveries.delete().where(deliveries.c.id.in_(ids.scalar_subquery()))
                )
            total += result.rowcount
        return total
