"""Read queries behind memory-core's recall: recency from the graph, and the lexical leg
over every record (or, for the pending overlay, over records a vector sink lacks), with the
recall filter inside each query. All run on the reader engine. On SQLite the recall reads
are ``store/sqlite_recall.py``'s, on the pooled connection's driver (the same code ``outbox
search`` runs without SQLAlchemy); on PostgreSQL the lexical leg is ``store/postgres_recall.py``.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Iterator

from sqlalchemy import Engine, and_, or_, select, text

from outbox.core.recall_filter import RecallFilter
from outbox.store.lexical import MATCH_BUDGET, LexicalHits, lexical_hits
from outbox.store.postgres_recall import PostgresOverlay
from outbox.store.rows import RecentRow, StoredRecord, recent_row, row_to_record
from outbox.store.schema import graph_nodes, records
from outbox.store.sqlite_recall import SqliteRecallReads

_BEFORE = text(
    "SELECT id FROM graph_nodes WHERE session_id = :session AND ts < :ts "
    "ORDER BY ts DESC LIMIT :reach"
)
_AFTER = text(
    "SELECT id FROM graph_nodes WHERE session_id = :session AND ts > :ts ORDER BY ts LIMIT :reach"
)


class RecallQueries:
    """Recall's reads over one reader engine: SQLite's on the bare driver, PostgreSQL's
    through SQLAlchemy."""

    def __init__(self, reader: Engine) -> None:
        self.reader = reader
        self.sqlite = reader.dialect.name == "sqlite"

    @contextlib.contextmanager
    def _bare(self) -> Iterator[SqliteRecallReads]:
        """SQLite's recall reads on a pooled reader connection's own driver."""
        with self.reader.connect() as conn:
            driver = conn.connection.driver_connection
            assert isinstance(driver, sqlite3.Connection)
            yield SqliteRecallReads(driver)

    def recent(
        self,
        *,
        limit: int,
        session_id: str | None = None,
        agent: str | None = None,
        before: tuple[str, str] | None = None,
    ) -> list[RecentRow]:
        """Newest AGENT_MEMORY nodes first, keyset-paged by (timestamp, id)."""
        if self.sqlite:
            with self._bare() as reads:
                return reads.recent(limit=limit, session_id=session_id, agent=agent, before=before)
        query = (
            select(
                graph_nodes.c.id,
                graph_nodes.c.ts,
                graph_nodes.c.session_id,
                graph_nodes.c.agent,
                records.c.content,
                records.c.importance,
                records.c.tags,
                records.c.meta,
            )
            .join(records, records.c.key == graph_nodes.c.id)
            .where(graph_nodes.c.label == "AGENT_MEMORY")
            .order_by(graph_nodes.c.ts.desc(), graph_nodes.c.id.desc())
            .limit(limit)
        )
        if session_id is not None:
            query = query.where(graph_nodes.c.session_id == session_id)
        if agent is not None:
            query = query.where(graph_nodes.c.agent == agent)
        if before is not None:
            ts, key = before
            query = query.where(
                or_(graph_nodes.c.ts < ts, and_(graph_nodes.c.ts == ts, graph_nodes.c.id < key))
            )
        with self.reader.connect() as conn:
            rows = conn.execute(query).all()
        return [recent_row(row) for row in rows]

    def neighbours(self, keys: Iterable[str], reach: int) -> dict[str, list[str]]:
        """Each memory's neighbours in its session: the ``reach`` written just before it and
        the ``reach`` just after, nearest first (by the session index, one bounded lookup
        each way; plain statements, since recall asks for twenty memories' at a time)."""
        if self.sqlite:
            with self._bare() as reads:
                return reads.neighbours(keys, reach)
        node = graph_nodes.c
        found: dict[str, list[str]] = {}
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(node.id, node.session_id, node.ts).where(node.id.in_(list(keys)))
            ).all()
            for key, session, ts in rows:
                if session is None:
                    continue
                place = {"session": session, "ts": ts, "reach": reach}
                before = conn.execute(_BEFORE, place).scalars().all()
                after = conn.execute(_AFTER, place).scalars().all()
                found[key] = [*before, *after]
        return found

    def get_records(self, keys: Iterable[str]) -> dict[str, StoredRecord]:
        """The stored records of recall's hits, by key; unknown keys are left out."""
        if self.sqlite:
            with self._bare() as reads:
                return reads.get_records(keys)
        with self.reader.connect() as conn:
            rows = conn.execute(select(records).where(records.c.key.in_(list(keys))))
            return {row.key: row_to_record(row) for row in rows}

    def pending_matches(
        self,
        query: str,
        *,
        vector_sink: str | None,
        limit: int,
        session_id: str | None = None,
        budget: int = MATCH_BUDGET,
    ) -> list[tuple[str, float]]:
        """(key, score) of records not yet delivered to ``vector_sink`` (every record when
        there is no vector sink) that share words with ``query``; best first."""
        filters = RecallFilter(session_id=session_id)
        return self.lexical(
            query, limit=limit, filters=filters, vector_sink=vector_sink, budget=budget
        ).hits

    def lexical(
        self,
        query: str,
        *,
        limit: int,
        filters: RecallFilter | None = None,
        vector_sink: str | None = None,
        budget: int = MATCH_BUDGET,
    ) -> LexicalHits:
        """The records that share words with ``query`` and pass ``filters``, best first
        (``store/lexical.py``'s bounded steps). The filter is part of every query, so no
        match is lost to a LIMIT before it."""
        filters = filters or RecallFilter()
        if self.sqlite:
            with self._bare() as reads:
                return reads.lexical(
                    query, limit=limit, filters=filters, vector_sink=vector_sink, budget=budget
                )
        with self.reader.connect() as conn, conn.begin():
            overlay = PostgresOverlay(conn, vector_sink, filters)
            return lexical_hits(overlay, query, limit=limit, budget=budget)
