"""Read queries behind memory-core's recall: recency from the graph, and the lexical leg
over every record (or, for the pending overlay, over records a vector sink lacks), with the
recall filter inside each query. All run on the reader engine; how each database matches
words is in ``store/lexical.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, and_, func, or_, select, text

from outbox.core.recall_filter import RecallFilter
from outbox.store.lexical import (
    MATCH_BUDGET,
    OverlayFactory,
    PostgresOverlay,
    SqliteOverlay,
    match_terms,
    telling_terms,
)
from outbox.store.schema import graph_nodes, records

_BEFORE = text(
    "SELECT id FROM graph_nodes WHERE session_id = :session AND ts < :ts "
    "ORDER BY ts DESC LIMIT :reach"
)
_AFTER = text(
    "SELECT id FROM graph_nodes WHERE session_id = :session AND ts > :ts ORDER BY ts LIMIT :reach"
)


@dataclass(frozen=True)
class LexicalHits:
    """The lexical leg's answer: (key, score) best first, and what relevance needs: each
    query word's number of matches (counted no further than ``cap``) and the store's size."""

    hits: list[tuple[str, float]]
    counts: dict[str, int] = field(default_factory=dict)
    cap: int = MATCH_BUDGET + 1
    total: int = 0


@dataclass(frozen=True)
class RecentRow:
    key: str
    timestamp: str
    session_id: str | None
    agent: str | None
    content: str
    importance: int
    tags: list[str]
    metadata: dict[str, Any]


def recent_row(row: Any) -> RecentRow:
    """A memory row (its graph node joined with its record) as a RecentRow."""
    return RecentRow(
        key=row.id,
        timestamp=row.ts,
        session_id=row.session_id,
        agent=row.agent,
        content=row.content,
        importance=row.importance,
        tags=list(row.tags or []),
        metadata=dict(row.meta or {}),
    )


class RecallQueries:
    """Recall's reads over one reader engine, with its database's overlay chosen once."""

    def __init__(self, reader: Engine) -> None:
        self.reader = reader
        sqlite = reader.dialect.name == "sqlite"
        self._overlay: OverlayFactory = SqliteOverlay if sqlite else PostgresOverlay

    def recent(
        self,
        *,
        limit: int,
        session_id: str | None = None,
        agent: str | None = None,
        before: tuple[str, str] | None = None,
    ) -> list[RecentRow]:
        """Newest AGENT_MEMORY nodes first, keyset-paged by (timestamp, id)."""
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
        """The records that share words with ``query`` and pass ``filters``, best first.

        Recall runs this on every query, so its cost must not grow with the store: each step
        reads at most about ``budget`` matches per word. Each word's matches are counted up
        to ``budget`` + 1; the rarest words whose matches fit in ``budget`` together are
        ranked over all their matches (SQLite: FTS5 bm25, PostgreSQL: ts_rank). Words more
        common than that only count among the newest ``budget`` records that pass the
        filter, whose hits come after: on SQLite ranked by how many of those words each
        holds, on PostgreSQL by ts_rank. Scores order one call's results only. The filter
        is part of every query, so no match is lost to a LIMIT before it.
        """
        terms = match_terms(query)
        if not terms:
            return LexicalHits([])
        filters = filters or RecallFilter()
        with self.reader.connect() as conn:
            overlay = self._overlay(conn, vector_sink, filters)
            counts = overlay.counts(terms, budget + 1)
            telling = telling_terms(counts, budget)
            common = [term for term in terms if counts[term] and term not in telling]
            found = overlay.ranked(telling, limit) if telling else []
            if common and len(found) < limit:
                seen = {key for key, _score, _meta in found}
                newest = overlay.newest(common, limit, budget)
                found += [item for item in newest if item[0] not in seen]
            total = conn.execute(select(func.max(records.c.seq))).scalar() or 0
        hits = [(key, score) for key, score, _meta in found[:limit]]
        return LexicalHits(hits, counts, budget + 1, int(total))
