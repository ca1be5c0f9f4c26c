"""Records: the write path's insert and lookup, and the reads of what was stored.

A record is written once with everything that goes with it (its graph node, the frontier
edge, one delivery per sink and, on SQLite, its row in the lexical search index). How those
rows reach the database differs per backend, so a ``_RecordWriter`` chosen once in the
constructor does it: exactly one insert path per backend.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import Connection, Engine, func, select, update
from sqlalchemy.dialects import postgresql

from outbox.core.record import Record
from outbox.store.engine import driver_of
from outbox.store.rows import NewRows, StoredRecord, new_rows, row_to_record
from outbox.store.schema import deliveries, graph_edges, graph_nodes, records
from outbox.store.sqlite_writes import CHUNK, SqliteRows, read_records


class _RecordWriter(Protocol):
    """The write path's statements, per database, for a whole group of records at once:
    the group commit's leader pays one statement per table, not one per record."""

    def lookup_many(
        self, conn: Connection, keys: Sequence[str], names: Sequence[str]
    ) -> tuple[set[str], dict[str, str]]:
        """(those of ``keys`` that exist, the key owning each of ``names`` that is taken)."""
        ...

    def insert(self, conn: Connection, rows: Sequence[NewRows]) -> dict[str, int]:
        """Write each record's rows (keys distinct); the new ``seq`` of each record written,
        by key. A key that exists already is left out: nothing is written for it."""
        ...


class _SqliteWriter:
    """The bare-driver statements of ``sqlite_writes``, run on a SQLAlchemy connection's
    driver connection (a caller's own transaction, a rebuild): the one SQLite insert path."""

    def __init__(self) -> None:
        self._rows = SqliteRows()

    def lookup_many(
        self, conn: Connection, keys: Sequence[str], names: Sequence[str]
    ) -> tuple[set[str], dict[str, str]]:
        return self._rows.lookup_many(_driver(conn), keys, names)

    def insert(self, conn: Connection, rows: Sequence[NewRows]) -> dict[str, int]:
        return self._rows.insert(_driver(conn), rows)


def _driver(conn: Connection) -> sqlite3.Connection:
    driver = conn.connection.driver_connection
    assert isinstance(driver, sqlite3.Connection)
    return driver


class _PostgresWriter:
    """Plain Core statements; the GIN expression index covers a record's text by itself."""

    def lookup_many(
        self, conn: Connection, keys: Sequence[str], names: Sequence[str]
    ) -> tuple[set[str], dict[str, str]]:
        found = conn.execute(
            select(records.c.key, records.c.markdown_name).where(
                records.c.key.in_(list(keys)) | records.c.markdown_name.in_(list(names))
            )
        ).all()
        wanted = set(keys)
        return {row[0] for row in found if row[0] in wanted}, {row[1]: row[0] for row in found}

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


@dataclass(frozen=True)
class RecordCounts:
    """What every surface calls "records": the live ones. A forgotten record's tombstone
    stays in the table (its key is never written again) but is counted on its own."""

    live: int
    forgotten: int


class RecordStore:
    """Records: inserted in the caller's transaction on ``engine``, read on ``reader``."""

    def __init__(self, engine: Engine, reader: Engine) -> None:
        self.engine = engine
        self.reader = reader
        self.sqlite = engine.dialect.name != "postgresql"
        self._writer: _RecordWriter = _SqliteWriter() if self.sqlite else _PostgresWriter()

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
        return self._writer.lookup_many(conn, keys, names)

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
        """The stored records of these keys, by key; unknown keys are left out (on SQLite in
        one bare-driver statement: a dispatcher reads its batch's records this way)."""
        if self.sqlite:
            with driver_of(self.reader) as conn:
                return read_records(conn, keys)
        wanted = list(keys)
        found: dict[str, StoredRecord] = {}
        with self.reader.connect() as conn:
            for start in range(0, len(wanted), CHUNK):
                chunk = wanted[start : start + CHUNK]
                for row in conn.execute(select(records).where(records.c.key.in_(chunk))):
                    found[row.key] = row_to_record(row)
        return found

    def held(self, keys: Iterable[str]) -> set[str]:
        """Which of a few keys are records here, live or tombstones (the open's check that
        the database holds what its log names)."""
        with self.reader.connect() as conn:
            rows = conn.execute(select(records.c.key).where(records.c.key.in_(list(keys))))
            return {str(row[0]) for row in rows}

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

    def counts(self) -> RecordCounts:
        """Live and forgotten records, in one read so the two always add up."""
        query = select(func.count(), func.count(records.c.forgotten_at)).select_from(records)
        with self.reader.connect() as conn:
            total, forgotten = conn.execute(query).one()
        return RecordCounts(live=int(total) - int(forgotten), forgotten=int(forgotten))

    def count_records(self) -> int:
        """How many live records the outbox holds (forgotten ones are not records any more)."""
        return self.counts().live

    def newest_seq(self) -> int:
        """The highest ``seq`` written, live or forgotten (0 for an empty outbox)."""
        with self.reader.connect() as conn:
            return int(conn.execute(select(func.max(records.c.seq))).scalar() or 0)

    def rows_after(self, seq: int, limit: int) -> list[StoredRecord]:
        """Up to ``limit`` rows after ``seq`` in ``seq`` order, tombstones included, so a
        caller walking the table sees every position; ``StoredRecord.forgotten`` tells them
        apart."""
        query = select(records).where(records.c.seq > seq).order_by(records.c.seq).limit(limit)
        with self.reader.connect() as conn:
            return [row_to_record(row) for row in conn.execute(query).all()]

    def rows_upto(self, seq: int) -> int:
        """Rows (live or forgotten) at or below ``seq``: more than a walk counted means one
        committed late under a lower ``seq``; a forget changes nothing here."""
        query = select(func.count()).select_from(records).where(records.c.seq <= seq)
        with self.reader.connect() as conn:
            return int(conn.execute(query).scalar_one())
