"""Records: the write path's insert and lookup, and the reads of what was stored.

A record is written once with everything that goes with it (its graph node, the frontier
edge, one delivery per sink and, on SQLite, its row in the lexical search index). How those
rows reach the database differs per backend, so a ``_RecordWriter`` chosen once in the
constructor does it: exactly one insert path per backend.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Connection, Dialect, Engine, Table, bindparam, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from outbox.record import Record
from outbox.states import DeliveryOp, DeliveryState
from outbox.store.schema import FRONTIER_NODE_ID, deliveries, graph_edges, graph_nodes, records

# Keys per ``IN (...)`` list: well below every driver's limit on bound parameters.
_CHUNK = 500


@dataclass(frozen=True)
class StoredRecord:
    """A record as stored, with where it came from and where its markdown file is."""

    seq: int
    record: Record
    markdown_name: str
    origin: str
    created_at: float
    # When a forget emptied it (a tombstone: no content, tags, metadata or file).
    forgotten_at: float | None = None

    @property
    def forgotten(self) -> bool:
        return self.forgotten_at is not None


def row_to_record(row: Any) -> StoredRecord:
    """A ``records`` row as a StoredRecord."""
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
        forgotten_at=row.forgotten_at,
    )


@dataclass(frozen=True)
class NewRows:
    """Every row one record's insert writes, as column values (JSON columns unencoded)."""

    record: dict[str, Any]
    node: dict[str, Any]
    edge: dict[str, Any]
    deliveries: list[dict[str, Any]]


def new_rows(
    record: Record, *, sinks: Sequence[str], markdown_name: str, origin: str, now: float
) -> NewRows:
    """The rows of a new record: its node in neo.mjs's shape, keyed by the record key, the
    edge from the frontier anchor, and a pending delivery per sink."""
    meta = dict(record.metadata)
    session_id, agent = meta.get("session_id"), meta.get("agent")
    return NewRows(
        record={
            "key": record.key,
            "ts": record.timestamp,
            "content": record.content,
            "importance": record.importance,
            "tags": list(record.tags),
            "meta": meta,
            "slug": record.slug,
            "markdown_name": markdown_name,
            "origin": origin,
            "created_at": now,
            "forgotten_at": None,
            "redaction_pending": 0,
        },
        node={
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
        },
        edge={
            "source": FRONTIER_NODE_ID,
            "target": record.key,
            "type": "SPAWNED_MEMORY",
            "weight": 0.8,
            "properties": {},
        },
        deliveries=[_delivery_row(record.key, sink, now) for sink in sinks],
    )


def _delivery_row(key: str, sink: str, now: float) -> dict[str, Any]:
    return {
        "record_key": key,
        "sink": sink,
        "state": DeliveryState.PENDING.value,
        "op": DeliveryOp.DELIVER.value,
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


class _RecordWriter(Protocol):
    """The write path's statements, per database, for a whole group of records at once:
    the group commit's leader pays one statement per table, not one per record."""

    def lookup(
        self, conn: Connection, keys: Sequence[str], names: Sequence[str]
    ) -> Sequence[Sequence[Any]]:
        """(key, markdown name) of the records holding any of ``keys`` or ``names``."""
        ...

    def insert(self, conn: Connection, rows: Sequence[NewRows]) -> dict[str, int]:
        """Write each record's rows (keys distinct); the new ``seq`` of each record written,
        by key. A key that exists already is left out: nothing is written for it."""
        ...


class _Compiled:
    """A Core statement compiled once to the driver's SQL and parameter order.

    The SQLite writer runs these on the raw driver connection: the SQL is still written
    once, in SQLAlchemy, but each execution skips SQLAlchemy's per-statement overhead,
    which the write path would pay for every one of a record's rows.
    """

    def __init__(self, statement: Any, dialect: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        self.sql = str(compiled)
        self.order = list(compiled.positiontup or [])

    def args(self, params: dict[str, Any]) -> list[Any]:
        return [params[name] for name in self.order]


def _binds(table: Table, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {col.name: bindparam(col.name) for col in table.columns if col.name not in skip}


def _driver_cursor(conn: Connection) -> Any:
    return conn.connection.driver_connection.cursor()  # type: ignore[union-attr]


class _SqliteWriter:
    """Compiled statements on the raw driver connection, and the FTS5 row recall reads.

    A group's records go in as one multi-row ``INSERT ... RETURNING`` (the compiled
    statement's row repeated) and the other tables' rows as one ``executemany`` each.
    """

    _FTS = "INSERT INTO records_fts(rowid, content) VALUES (?, ?)"
    _LOOKUP = (
        'SELECT "key", markdown_name FROM records WHERE "key" IN ({}) OR markdown_name IN ({})'
    )

    def __init__(self, dialect: Dialect) -> None:
        self._record = _Compiled(
            sqlite.insert(records)
            .values(_binds(records, ("seq",)))
            .on_conflict_do_nothing(index_elements=["key"])
            .returning(records.c.key, records.c.seq),
            dialect,
        )
        head, _, tail = self._record.sql.partition(" VALUES ")
        row, _, rest = tail.partition(")")
        self._record_parts = (f"{head} VALUES ", f"{row})", rest)
        self._node = _Compiled(graph_nodes.insert().values(_binds(graph_nodes)), dialect)
        self._edge = _Compiled(graph_edges.insert().values(_binds(graph_edges, ("id",))), dialect)
        self._delivery = _Compiled(deliveries.insert().values(_binds(deliveries, ("id",))), dialect)

    def lookup(
        self, conn: Connection, keys: Sequence[str], names: Sequence[str]
    ) -> Sequence[Sequence[Any]]:
        cursor = _driver_cursor(conn)
        found: list[Sequence[Any]] = []
        for start in range(0, len(keys), _CHUNK):
            some_keys, some_names = keys[start : start + _CHUNK], names[start : start + _CHUNK]
            sql = self._LOOKUP.format(_marks(len(some_keys)), _marks(len(some_names)))
            found += cursor.execute(sql, [*some_keys, *some_names]).fetchall()
        return found

    def insert(self, conn: Connection, rows: Sequence[NewRows]) -> dict[str, int]:
        cursor = _driver_cursor(conn)
        head, row, rest = self._record_parts
        seqs: dict[str, int] = {}
        for start in range(0, len(rows), _CHUNK):
            chunk = rows[start : start + _CHUNK]
            args = [arg for item in chunk for arg in self._record.args(_record_columns(item))]
            sql = head + ", ".join([row] * len(chunk)) + rest
            seqs.update((str(key), int(seq)) for key, seq in cursor.execute(sql, args).fetchall())
        written = [item for item in rows if item.record["key"] in seqs]
        cursor.executemany(
            self._FTS, [(seqs[item.record["key"]], item.record["content"]) for item in written]
        )
        node, edge, delivery = self._node, self._edge, self._delivery
        cursor.executemany(
            node.sql,
            [
                node.args(dict(item.node, properties=json.dumps(item.node["properties"])))
                for item in written
            ],
        )
        cursor.executemany(
            edge.sql,
            [
                edge.args(dict(item.edge, properties=_json(item.edge["properties"])))
                for item in written
            ],
        )
        cursor.executemany(
            delivery.sql, [delivery.args(one) for item in written for one in item.deliveries]
        )
        return seqs


def _marks(count: int) -> str:
    return ", ".join(["?"] * count)


def _record_columns(rows: NewRows) -> dict[str, Any]:
    """The ``records`` row with its JSON columns encoded, as the raw driver takes them."""
    record = rows.record
    return dict(record, tags=json.dumps(record["tags"]), meta=_json(record["meta"]))


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value) if value else "{}"


class _PostgresWriter:
    """Plain Core statements; the GIN expression index covers a record's text by itself."""

    def lookup(
        self, conn: Connection, keys: Sequence[str], names: Sequence[str]
    ) -> Sequence[Sequence[Any]]:
        return conn.execute(
            select(records.c.key, records.c.markdown_name).where(
                records.c.key.in_(list(keys)) | records.c.markdown_name.in_(list(names))
            )
        ).all()

    def insert(self, conn: Connection, rows: Sequence[NewRows]) -> dict[str, int]:
        found = conn.execute(
            postgresql.insert(records)
            .values([item.record for item in rows])
            .on_conflict_do_nothing(index_elements=["key"])
            .returning(records.c.key, records.c.seq)
        ).all()
        seqs = {str(key): int(seq) for key, seq in found}
        written = [item for item in rows if item.record["key"] in seqs]
        if written:
            conn.execute(graph_nodes.insert(), [item.node for item in written])
            conn.execute(graph_edges.insert(), [item.edge for item in written])
            if any(item.deliveries for item in written):
                conn.execute(
                    deliveries.insert(), [one for item in written for one in item.deliveries]
                )
        return seqs


class RecordStore:
    """Records: inserted in the caller's transaction on ``engine``, read on ``reader``."""

    def __init__(self, engine: Engine, reader: Engine) -> None:
        self.engine = engine
        self.reader = reader
        self._writer: _RecordWriter = (
            _PostgresWriter()
            if engine.dialect.name == "postgresql"
            else _SqliteWriter(engine.dialect)
        )

    # -- the write path -------------------------------------------------------------------

    def lookup(self, conn: Connection, key: str, name: str) -> tuple[bool, bool]:
        """(the key exists, another key owns the markdown name): one query for both."""
        exists, owners = self.lookup_many(conn, [key], [name])
        return key in exists, owners.get(name, key) != key

    def lookup_many(
        self, conn: Connection, keys: Sequence[str], names: Sequence[str]
    ) -> tuple[set[str], dict[str, str]]:
        """(those of ``keys`` that exist, the key owning each of ``names`` that is taken):
        one query for a whole group of records."""
        found = self._writer.lookup(conn, keys, names)
        wanted = set(keys)
        return {row[0] for row in found if row[0] in wanted}, {row[1]: row[0] for row in found}

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
        (seq,) = self.insert_records(
            conn, [(record, markdown_name)], sinks=sinks, origin=origin, now=now
        )
        return seq

    def insert_records(
        self,
        conn: Connection,
        named: Sequence[tuple[Record, str]],
        *,
        sinks: Sequence[str],
        origin: str,
        now: float,
    ) -> list[int | None]:
        """``insert_record`` for a group of (record, markdown name) with distinct keys, one
        statement per table: each record's new ``seq``, or None where its key exists."""
        rows = [
            new_rows(record, sinks=sinks, markdown_name=name, origin=origin, now=now)
            for record, name in named
        ]
        seqs = self._writer.insert(conn, rows)
        return [seqs.get(record.key) for record, _ in named]

    def rename_markdown(self, conn: Connection, key: str, name: str) -> None:
        """Point a committed record at another markdown file name."""
        conn.execute(update(records).where(records.c.key == key).values(markdown_name=name))

    # -- reads ----------------------------------------------------------------------------

    def get_record(self, key: str, conn: Connection | None = None) -> StoredRecord | None:
        """The record of ``key``, read in ``conn`` when given (the write path's transaction)."""
        query = select(records).where(records.c.key == key)
        if conn is not None:
            row = conn.execute(query).first()
        else:
            with self.reader.connect() as own:
                row = own.execute(query).first()
        return row_to_record(row) if row else None

    def get_records(self, keys: Iterable[str]) -> dict[str, StoredRecord]:
        """The stored records of these keys, by key; unknown keys are left out."""
        wanted = list(keys)
        found: dict[str, StoredRecord] = {}
        with self.reader.connect() as conn:
            for start in range(0, len(wanted), _CHUNK):
                chunk = wanted[start : start + _CHUNK]
                for row in conn.execute(select(records).where(records.c.key.in_(chunk))):
                    found[row.key] = row_to_record(row)
        return found

    def records_after(self, origin: str, seq: int, limit: int = 1000) -> list[StoredRecord]:
        """``origin``'s records written after ``seq``, in write order."""
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(records)
                .where(records.c.origin == origin, records.c.seq > seq)
                .order_by(records.c.seq)
                .limit(limit)
            ).all()
        return [row_to_record(row) for row in rows]

    def iter_records(self, origin: str | None = None, batch: int = 1000) -> Iterator[StoredRecord]:
        """Every record (of ``origin``, when given) in write order, read ``batch`` at a time
        so no read transaction stays open while the caller works."""
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
                yield row_to_record(row)
            last = rows[-1].seq

    def keys_with_prefix(self, prefix: str, limit: int = 10) -> list[str]:
        """Up to ``limit`` keys starting with ``prefix`` (lowercase hex), in key order: an
        index range, since every key character sorts below "g"."""
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(records.c.key)
                .where(records.c.key >= prefix, records.c.key < prefix + "g")
                .order_by(records.c.key)
                .limit(limit)
            ).all()
        return [str(row[0]) for row in rows]

    def count_records(self) -> int:
        """How many records the outbox holds."""
        with self.reader.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(records)).scalar_one())
