"""The SQLite write path on the bare ``sqlite3`` driver: its connection discipline and the
statements that insert a group of records.

Free of SQLAlchemy on purpose: ``outbox add`` writes through this module without importing
the toolkit (which alone takes longer to import than the command's whole start budget), and
the full outbox writes through it too, so there is one insert path. The statements name their
columns here; ``tests/test_sqlite_writes.py`` holds them to the tables in ``schema.py``.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from outbox.core.record import Record
from outbox.store.rows import NewRows, StoredRecord, new_rows, row_to_record

# Keys per ``IN (...)`` list and records per multi-row INSERT: well below SQLite's limit on
# bound parameters (32,766) for every table's row.
CHUNK = 500

RECORD_COLUMNS = (
    "key",
    "ts",
    "content",
    "importance",
    "tags",
    "meta",
    "slug",
    "markdown_name",
    "origin",
    "created_at",
    "forgotten_at",
    "redaction_pending",
)
NODE_COLUMNS = ("id", "label", "session_id", "agent", "ts", "properties")
EDGE_COLUMNS = ("source", "target", "type", "weight", "properties")
DELIVERY_COLUMNS = (
    "record_key",
    "sink",
    "state",
    "op",
    "attempts",
    "available_at",
    "lease_owner",
    "lease_expires_at",
    "last_error",
    "error_class",
    "sink_id",
    "mirror_pending",
    "created_at",
    "updated_at",
    "delivered_at",
)


def _names(columns: Sequence[str]) -> str:
    return ", ".join(f'"{name}"' for name in columns)


def _marks(count: int) -> str:
    return ", ".join(["?"] * count)


_RECORD_ROW = f"({_marks(len(RECORD_COLUMNS))})"
_RECORD_HEAD = f"INSERT INTO records ({_names(RECORD_COLUMNS)}) VALUES "
_RECORD_TAIL = ' ON CONFLICT ("key") DO NOTHING RETURNING "key", seq'
_FTS_HEAD = "INSERT INTO records_fts(rowid, content) VALUES "
_NODE_HEAD = f"INSERT INTO graph_nodes ({_names(NODE_COLUMNS)}) VALUES "
_EDGE_HEAD = f"INSERT INTO graph_edges ({_names(EDGE_COLUMNS)}) VALUES "
_DELIVERY_HEAD = f"INSERT INTO deliveries ({_names(DELIVERY_COLUMNS)}) VALUES "
_LOOKUP = 'SELECT "key", markdown_name FROM records WHERE "key" IN ({}) OR markdown_name IN ({})'
# A stored record's columns as ``stored_record`` reads them, in this order.
READ_COLUMNS = ("seq", *RECORD_COLUMNS)
_READ = f'SELECT {_names(READ_COLUMNS)} FROM records WHERE "key" = ?'
_BY_KEYS = (
    f'SELECT {_names(READ_COLUMNS)} FROM records WHERE "key" IN (SELECT value FROM json_each(?))'
)


def apply_discipline(
    conn: sqlite3.Connection, *, busy_ms: int, synchronous: str, writer: bool
) -> None:
    """What every connection to the store gets: WAL, the chosen ``synchronous``, the busy
    timeout, foreign keys; a reader is also made read-only. Writers keep SQLite's checkpoint
    bound (1,000 pages): 10,000 was measured and not kept (docs/configuration.md, the WAL).
    Transactions are ours to begin (``isolation_level = None``), so a writer's
    ``BEGIN IMMEDIATE`` is the one that runs."""
    conn.isolation_level = None
    cursor = conn.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
        mode = cursor.execute("PRAGMA journal_mode").fetchone()[0]
        if writer and str(mode).lower() != "wal":
            cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute(f"PRAGMA synchronous = {synchronous}")
        cursor.execute("PRAGMA foreign_keys = ON")
        if not writer:
            cursor.execute("PRAGMA query_only = ON")
    finally:
        cursor.close()


def connect_writer(path: Path, *, busy_timeout: float, synchronous: str) -> sqlite3.Connection:
    """A writer's own connection to the store at ``path``, with the discipline applied."""
    return _connect(path, busy_timeout=busy_timeout, synchronous=synchronous, writer=True)


def connect_reader(path: Path, *, busy_timeout: float, synchronous: str) -> sqlite3.Connection:
    """A read-only connection to the store at ``path``, as the full outbox's reader has."""
    return _connect(path, busy_timeout=busy_timeout, synchronous=synchronous, writer=False)


def _connect(
    path: Path, *, busy_timeout: float, synchronous: str, writer: bool
) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=busy_timeout, check_same_thread=False)
    try:
        apply_discipline(
            conn, busy_ms=int(busy_timeout * 1000), synchronous=synchronous, writer=writer
        )
    except BaseException:
        conn.close()
        raise
    return conn


@dataclass(frozen=True)
class SqliteUrl:
    """A SQLite URL as the store reads it: its file (None: in memory), and whether it is a
    bare ``sqlite:///path``, with no driver, host or options that only the full outbox reads."""

    path: Path | None
    plain: bool


def sqlite_url(db_url: str) -> SqliteUrl | None:
    """``db_url`` read as SQLite (None: another backend), the way SQLAlchemy reads it: the
    database is what follows the host's slash, percent-decoded, up to the options."""
    scheme, sep, rest = db_url.partition("://")
    if not sep or scheme.split("+", 1)[0] != "sqlite":
        return None
    location, options, _ = rest.partition("?")
    host, _, database = location.partition("/")
    database = unquote(database)
    path = Path(database) if database and database != ":memory:" else None
    return SqliteUrl(path, scheme == "sqlite" and not host and not options)


def sqlite_path(db_url: str) -> Path | None:
    """The database file of a SQLite URL; None for an in-memory database or another backend."""
    url = sqlite_url(db_url)
    return None if url is None else url.path


def sqlite_file(db_url: str) -> Path | None:
    """The file of a plain ``sqlite:///path`` URL; None for anything else (another driver,
    URL options, an in-memory database), which only the full outbox opens."""
    url = sqlite_url(db_url)
    return url.path if url is not None and url.plain else None


class SqliteRows:
    """A group's records in one multi-row ``INSERT ... RETURNING``, the other tables' rows
    (and the FTS5 row recall reads) in one multi-row ``INSERT`` each; all inside the caller's
    transaction on ``conn`` (a bare ``sqlite3`` connection).

    Not ``executemany``: the driver releases the interpreter lock around every row's step,
    and while the mirror writer's thread runs Python each release waits to get it back
    (``add_many`` of 100: 5,000 against 5,700 records/s, alternating runs)."""

    def lookup_many(
        self, conn: sqlite3.Connection, keys: Sequence[str], names: Sequence[str]
    ) -> tuple[set[str], dict[str, str]]:
        """(those of ``keys`` that exist, the key owning each of ``names`` that is taken)."""
        found: list[Any] = []
        for start in range(0, len(keys), CHUNK):
            some_keys, some_names = keys[start : start + CHUNK], names[start : start + CHUNK]
            sql = _LOOKUP.format(_marks(len(some_keys)), _marks(len(some_names)))
            found += conn.execute(sql, [*some_keys, *some_names]).fetchall()
        wanted = set(keys)
        return {row[0] for row in found if row[0] in wanted}, {row[1]: row[0] for row in found}

    def insert_records(
        self,
        conn: sqlite3.Connection,
        named: Sequence[tuple[Record, str]],
        *,
        sinks: Sequence[str],
        origin: str,
        now: float,
    ) -> list[int | None]:
        """Each (record, markdown name)'s rows, keys distinct: its new ``seq``, or None where
        the key exists already (nothing is written for it)."""
        rows = [
            new_rows(record, sinks=sinks, markdown_name=name, origin=origin, now=now)
            for record, name in named
        ]
        seqs = self.insert(conn, rows)
        return [seqs.get(record.key) for record, _ in named]

    def insert(self, conn: sqlite3.Connection, rows: Sequence[NewRows]) -> dict[str, int]:
        """Write each record's rows; the new ``seq`` of each record written, by key."""
        seqs: dict[str, int] = {}
        for start in range(0, len(rows), CHUNK):
            chunk = rows[start : start + CHUNK]
            args = [value for item in chunk for value in _record_values(item)]
            sql = _RECORD_HEAD + ", ".join([_RECORD_ROW] * len(chunk)) + _RECORD_TAIL
            seqs.update((str(key), int(seq)) for key, seq in conn.execute(sql, args).fetchall())
        written = [item for item in rows if item.record["key"] in seqs]
        _insert_rows(
            conn,
            _FTS_HEAD,
            2,
            [(seqs[item.record["key"]], item.record["content"]) for item in written],
        )
        _insert_rows(
            conn,
            _NODE_HEAD,
            len(NODE_COLUMNS),
            [
                _values(item.node, NODE_COLUMNS, properties=json.dumps(item.node["properties"]))
                for item in written
            ],
        )
        _insert_rows(
            conn,
            _EDGE_HEAD,
            len(EDGE_COLUMNS),
            [
                _values(item.edge, EDGE_COLUMNS, properties=_json(item.edge["properties"]))
                for item in written
            ],
        )
        _insert_rows(
            conn,
            _DELIVERY_HEAD,
            len(DELIVERY_COLUMNS),
            [_values(one, DELIVERY_COLUMNS) for item in written for one in item.deliveries],
        )
        return seqs

    def get_record(self, key: str, conn: sqlite3.Connection) -> StoredRecord | None:
        """The record of ``key`` as the transaction on ``conn`` sees it."""
        row = conn.execute(_READ, (key,)).fetchone()
        return None if row is None else stored_record(row)


def read_records(conn: sqlite3.Connection, keys: Iterable[str]) -> dict[str, StoredRecord]:
    """The stored records of these keys, by key, in one statement; unknown keys are left out."""
    rows = conn.execute(_BY_KEYS, (json.dumps(list(keys)),)).fetchall()
    return {stored.record.key: stored for stored in map(stored_record, rows)}


def stored_record(row: Sequence[Any]) -> StoredRecord:
    """A row of ``READ_COLUMNS`` (JSON columns as the driver gives them) as a StoredRecord."""
    values = dict(zip(READ_COLUMNS, row, strict=True))
    values.update(tags=json.loads(values["tags"]), meta=json.loads(values["meta"]))
    return row_to_record(_Row(values))


class _Row:
    """Column values by attribute, as ``row_to_record`` reads a row."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


def _insert_rows(
    conn: sqlite3.Connection, head: str, width: int, rows: Sequence[Sequence[Any]]
) -> None:
    """Insert ``rows`` with multi-row statements of up to CHUNK rows: one step, so one
    release of the interpreter lock, per statement instead of per row."""
    row = f"({_marks(width)})"
    for start in range(0, len(rows), CHUNK):
        chunk = rows[start : start + CHUNK]
        conn.execute(head + ", ".join([row] * len(chunk)), [v for one in chunk for v in one])


def _values(row: dict[str, Any], columns: Sequence[str], **encoded: Any) -> list[Any]:
    return [encoded[name] if name in encoded else row[name] for name in columns]


def _record_values(rows: NewRows) -> list[Any]:
    """The ``records`` row with its JSON columns encoded, as the driver takes them."""
    record = rows.record
    return _values(
        record, RECORD_COLUMNS, tags=json.dumps(record["tags"]), meta=_json(record["meta"])
    )


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value) if value else "{}"
