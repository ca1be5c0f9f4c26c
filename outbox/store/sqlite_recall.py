"""SQLite's recall reads on the bare ``sqlite3`` driver: the lexical leg over FTS5, the
session neighbours of a hit, and the hits' records, with the recall filter inside each query.

Free of SQLAlchemy on purpose: ``outbox search`` on a store in its steady state reads through
this module without importing the toolkit (``recall/direct.py``), and the full outbox reads
through it too on SQLite (``store/recall.py`` hands it the pooled connection's driver), so
there is one SQLite read path for recall.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterable, Iterator
from typing import Any

from outbox.core.recall_filter import RecallFilter
from outbox.core.states import DeliveryState
from outbox.store.lexical import MATCH_BUDGET, SCAN_FACTOR, Found, LexicalHits, lexical_hits
from outbox.store.rows import RecentRow, StoredRecord
from outbox.store.sqlite_writes import read_records

# A session's memories just before and just after one of them, by the session index.
_BEFORE = (
    "SELECT id FROM graph_nodes WHERE session_id = :session AND ts < :ts "
    "ORDER BY ts DESC LIMIT :reach"
)
_AFTER = (
    "SELECT id FROM graph_nodes WHERE session_id = :session AND ts > :ts ORDER BY ts LIMIT :reach"
)
_PLACES = "SELECT id, session_id, ts FROM graph_nodes WHERE id IN (SELECT value FROM json_each(?))"


_RECENT = (
    "SELECT g.id, g.ts, g.session_id, g.agent, r.content, r.importance, r.tags, r.meta "
    "FROM graph_nodes g JOIN records r ON r.key = g.id WHERE g.label = 'AGENT_MEMORY'"
)


def sqlite_clause(filters: RecallFilter, alias: str = "r") -> tuple[str, dict[str, Any]]:
    """(condition over ``records`` as ``alias``, its named parameters) for SQLite's SQL."""
    parts: list[str] = []
    params: dict[str, Any] = {}
    if filters.session_id is not None:
        parts.append(f"json_extract({alias}.meta, '$.session_id') = :f_session")
        params["f_session"] = filters.session_id
    if filters.agent is not None:
        parts.append(f"json_extract({alias}.meta, '$.agent') = :f_agent")
        params["f_agent"] = filters.agent
    for number, tag in enumerate(filters.tags):
        parts.append(f"EXISTS (SELECT 1 FROM json_each({alias}.tags) WHERE value = :f_tag{number})")
        params[f"f_tag{number}"] = tag
    if filters.min_importance is not None:
        parts.append(f"{alias}.importance >= :f_importance")
        params["f_importance"] = filters.min_importance
    if filters.since is not None:
        parts.append(f"{alias}.ts >= :f_since")
        params["f_since"] = filters.since
    if filters.until is not None:
        parts.append(f"{alias}.ts < :f_until")
        params["f_until"] = filters.until
    return (" AND ".join(parts) or "1"), params


class SqliteOverlay:
    """The FTS5 table (rowid = the record's seq), which holds every record."""

    def __init__(
        self, conn: sqlite3.Connection, vector_sink: str | None, filters: RecallFilter
    ) -> None:
        self.conn = conn
        self.filters = filters
        clause, params = sqlite_clause(filters)
        # The filter's parameters, passed with every statement that may use it.
        self.filter = {"sink": vector_sink, "delivered": DeliveryState.DELIVERED.value, **params}
        pending = (
            "EXISTS (SELECT 1 FROM deliveries d WHERE d.record_key = r.key "
            "AND d.sink = :sink AND d.state != :delivered)"
            if vector_sink
            else "1"
        )
        self.pending = f"{pending} AND {clause}"

    @staticmethod
    def _phrases(terms: list[str]) -> dict[str, str]:
        return {
            f"t{number}": '"' + term.replace('"', '""') + '"' for number, term in enumerate(terms)
        }

    def counts(self, terms: list[str], cap: int) -> dict[str, int]:
        probes = ", ".join(
            f"(SELECT count(*) FROM (SELECT 1 FROM records_fts WHERE records_fts MATCH :t{number} "
            "LIMIT :cap))"
            for number in range(len(terms))
        )
        row = self.conn.execute(f"SELECT {probes}", {**self._phrases(terms), "cap": cap}).fetchone()
        return dict(zip(terms, (int(count) for count in row), strict=True))

    def ranked(self, terms: list[str], wanted: int) -> Found:
        statement = (
            "SELECT r.key, -bm25(records_fts) "
            "FROM records_fts JOIN records r ON r.seq = records_fts.rowid "
            f"WHERE records_fts MATCH :q AND {self.pending} "
            "ORDER BY bm25(records_fts), records_fts.rowid DESC LIMIT :n"
        )
        phrases = " OR ".join(self._phrases(terms).values())
        return _found(self.conn.execute(statement, {"q": phrases, "n": wanted, **self.filter}))

    def newest(self, terms: list[str], wanted: int, window: int) -> Found:
        extra: dict[str, Any]
        if self.filters.empty:
            oldest = self.conn.execute(
                "SELECT rowid FROM records_fts ORDER BY rowid DESC LIMIT 1 OFFSET :skip",
                {"skip": window - 1},
            ).fetchone()
            scope, extra = "rowid >= :oldest", {"oldest": oldest[0] if oldest else 0}
        else:
            scope, extra = "rowid IN (SELECT value FROM json_each(:seqs))", self._window(window)
        hits = " UNION ALL ".join(
            f"SELECT rowid AS seq FROM records_fts WHERE records_fts MATCH :t{number} AND {scope}"
            for number in range(len(terms))
        )
        statement = (
            "SELECT r.key, h.score "
            f"FROM (SELECT seq, count(*) AS score FROM ({hits}) GROUP BY seq) h "
            f"JOIN records r ON r.seq = h.seq WHERE {self.pending} "
            "ORDER BY h.score DESC, h.seq DESC LIMIT :n"
        )
        params = {**self._phrases(terms), **extra, "n": wanted, **self.filter}
        return _found(self.conn.execute(statement, params))

    def total(self) -> int:
        (seq,) = self.conn.execute("SELECT max(seq) FROM records").fetchone()
        return int(seq or 0)

    def _window(self, window: int) -> dict[str, Any]:
        """The newest ``window`` records that pass the filter, among a bounded number of the
        newest (of the session, through its index, when the filter names one)."""
        newest = (
            "SELECT r.* FROM graph_nodes g JOIN records r ON r.key = g.id "
            "WHERE g.session_id = :f_session ORDER BY g.ts DESC LIMIT :scan"
            if self.filters.session_id is not None
            else "SELECT * FROM records ORDER BY seq DESC LIMIT :scan"
        )
        statement = f"SELECT r.seq FROM ({newest}) r WHERE {self.pending} LIMIT :window"
        params = {**self.filter, "scan": window * SCAN_FACTOR, "window": window}
        seqs = [int(seq) for (seq,) in self.conn.execute(statement, params)]
        return {"seqs": json.dumps(seqs)}


class SqliteRecallReads:
    """Recall's reads on one bare connection to the store (read-only or not: none writes);
    each read sees one snapshot of the database."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def recent(
        self,
        *,
        limit: int,
        session_id: str | None = None,
        agent: str | None = None,
        before: tuple[str, str] | None = None,
    ) -> list[RecentRow]:
        """Newest memories first, keyset-paged by (timestamp, key): ``before`` is the last
        row of the previous page."""
        sql, params = [_RECENT], {"n": limit, "session": session_id, "agent": agent}
        if session_id is not None:
            sql.append("AND g.session_id = :session")
        if agent is not None:
            sql.append("AND g.agent = :agent")
        if before is not None:
            sql.append("AND (g.ts < :ts OR (g.ts = :ts AND g.id < :key))")
            params.update(ts=before[0], key=before[1])
        sql.append("ORDER BY g.ts DESC, g.id DESC LIMIT :n")
        rows = self.conn.execute(" ".join(sql), params).fetchall()
        return [
            RecentRow(
                key=key,
                timestamp=ts,
                session_id=session,
                agent=whose,
                content=content,
                importance=importance,
                tags=list(json.loads(tags) or []),
                metadata=dict(json.loads(meta) or {}),
            )
            for key, ts, session, whose, content, importance, tags, meta in rows
        ]

    def lexical(
        self,
        query: str,
        *,
        limit: int,
        filters: RecallFilter | None = None,
        vector_sink: str | None = None,
        budget: int = MATCH_BUDGET,
    ) -> LexicalHits:
        """The records that share words with ``query`` and pass ``filters`` (every record,
        or those ``vector_sink`` lacks), best first (``lexical_hits``)."""
        with self._snapshot():
            overlay = SqliteOverlay(self.conn, vector_sink, filters or RecallFilter())
            return lexical_hits(overlay, query, limit=limit, budget=budget)

    def neighbours(self, keys: Iterable[str], reach: int) -> dict[str, list[str]]:
        """Each memory's neighbours in its session: the ``reach`` written just before it and
        the ``reach`` just after, nearest first (one bounded lookup each way)."""
        found: dict[str, list[str]] = {}
        with self._snapshot():
            places = self.conn.execute(_PLACES, (json.dumps(list(keys)),)).fetchall()
            for key, session, ts in places:
                if session is None:
                    continue
                place = {"session": session, "ts": ts, "reach": reach}
                before = [row[0] for row in self.conn.execute(_BEFORE, place)]
                after = [row[0] for row in self.conn.execute(_AFTER, place)]
                found[key] = [*before, *after]
        return found

    def get_records(self, keys: Iterable[str]) -> dict[str, StoredRecord]:
        """The stored records of these keys, by key; unknown keys are left out."""
        return read_records(self.conn, keys)

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[None]:
        """One read transaction (WAL: a snapshot), unless the caller holds one already."""
        if self.conn.in_transaction:
            yield
            return
        self.conn.execute("BEGIN")
        try:
            yield
        finally:
            self.conn.execute("COMMIT")


def _found(rows: Iterable[Any]) -> Found:
    return [(str(key), float(score)) for key, score in rows]
