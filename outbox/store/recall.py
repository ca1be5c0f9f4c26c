"""Read queries behind memory-core's recall: recency from the graph, and the lexical overlay
over records the vector index does not hold yet. Both run on the reader engine."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, and_, func, or_, select, text

from outbox.store.schema import deliveries, graph_nodes, records
from outbox.store.storage import DELIVERED

_WORD = re.compile(r"\w+", re.UNICODE)


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


def recent(
    reader: Engine,
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
    with reader.connect() as conn:
        rows = conn.execute(query).all()
    return [
        RecentRow(
            key=row.id,
            timestamp=row.ts,
            session_id=row.session_id,
            agent=row.agent,
            content=row.content,
            importance=row.importance,
            tags=list(row.tags or []),
            metadata=dict(row.meta or {}),
        )
        for row in rows
    ]


def match_terms(query: str) -> list[str]:
    """Distinct lowercase words of a query, longest first (the most telling ones)."""
    words = dict.fromkeys(word.lower() for word in _WORD.findall(query) if len(word) > 1)
    return sorted(words, key=len, reverse=True)[:16]


def pending_matches(
    reader: Engine,
    query: str,
    *,
    vector_sink: str | None,
    limit: int,
    session_id: str | None = None,
) -> list[tuple[str, float]]:
    """(key, score) of records not yet delivered to ``vector_sink`` (every record when there
    is no vector sink) that share words with ``query``; best first. SQLite: FTS5 bm25 (the
    index only holds what the vector sink lacks); PostgreSQL: ts_rank over to_tsvector."""
    terms = match_terms(query)
    if not terms:
        return []
    with reader.connect() as conn:
        if reader.dialect.name == "sqlite":
            fts_query = " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)
            pending_only = (
                "AND EXISTS (SELECT 1 FROM deliveries d WHERE d.record_key = r.key "
                "AND d.sink = :sink AND d.state != 'delivered') "
                if vector_sink
                else ""
            )
            statement = text(
                "SELECT r.key AS key, -bm25(records_fts) AS score, r.meta AS meta "
                "FROM records_fts JOIN records r ON r.seq = records_fts.rowid "
                f"WHERE records_fts MATCH :q {pending_only}"
                "ORDER BY bm25(records_fts) LIMIT :n"
            )
            rows = conn.execute(
                statement, {"q": fts_query, "sink": vector_sink, "n": limit * 3}
            ).all()
            found = [(row.key, float(row.score), row.meta) for row in rows]
        else:
            vector = func.to_tsvector("simple", records.c.content)
            tsquery = func.to_tsquery("simple", " | ".join(terms))
            rank = func.ts_rank(vector, tsquery).label("score")
            statement = (
                select(records.c.key, rank, records.c.meta)
                .where(vector.op("@@")(tsquery))
                .order_by(rank.desc())
                .limit(limit * 3)
            )
            if vector_sink:
                statement = statement.where(
                    select(deliveries.c.id)
                    .where(
                        deliveries.c.record_key == records.c.key,
                        deliveries.c.sink == vector_sink,
                        deliveries.c.state != DELIVERED,
                    )
                    .exists()
                )
            found = [(row.key, float(row.score), row.meta) for row in conn.execute(statement)]
    if session_id is not None:
        found = [item for item in found if _meta_session(item[2]) == session_id]
    return [(key, score) for key, score, _meta in found[:limit]]


def _meta_session(meta: Any) -> str | None:
    if isinstance(meta, str):  # a raw SQL row gives the JSON text
        meta = json.loads(meta)
    if isinstance(meta, dict):
        value = meta.get("session_id")
        return str(value) if value is not None else None
    return None


def rrf(rankings: Sequence[Sequence[str]], k: int = 60) -> list[tuple[str, float]]:
    """Reciprocal rank fusion: one list from several best-first rankings (pure)."""
    scores: dict[str, float] = {}
    for ranking in rankings:
        for position, key in enumerate(ranking):
            scores[key] = scores.get(key, 0.0) + 1.0 / (k + position + 1)
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))
