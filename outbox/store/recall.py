"""Read queries behind memory-core's recall: recency from the graph, and the lexical overlay
over records the vector index does not hold yet. Both run on the reader engine.

``RecallQueries`` is the part ``Storage`` holds; the module functions ``recent`` and
``pending_matches`` serve callers that hold only a reader engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, and_, func, literal_column, or_, select, text

from outbox.states import DeliveryState
from outbox.store.schema import deliveries, graph_nodes, records

_WORD = re.compile(r"\w+", re.UNICODE)

# About how many index entries per query word one lookup of the pending overlay may touch:
# what keeps recall's cost flat however large the backlog grows.
MATCH_BUDGET = 500


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


def match_terms(query: str) -> list[str]:
    """Distinct lowercase words of a query, longest first (the most telling ones)."""
    words = dict.fromkeys(word.lower() for word in _WORD.findall(query) if len(word) > 1)
    return sorted(words, key=len, reverse=True)[:16]


def telling_terms(counts: dict[str, int], budget: int) -> list[str]:
    """The rarest words whose matches fit in ``budget`` together (pure): they tell records
    apart, and ranking all their matches stays bounded."""
    chosen: list[str] = []
    spent = 0
    for term in sorted((term for term in counts if counts[term]), key=counts.__getitem__):
        if spent + counts[term] > budget:
            break
        chosen.append(term)
        spent += counts[term]
    return chosen


_Found = list[tuple[str, float, Any]]


class _Overlay(Protocol):
    """The three bounded steps of a lookup, per database."""

    def counts(self, terms: list[str], cap: int) -> dict[str, int]:
        """Each word's number of matches, counted no further than ``cap``."""
        ...

    def ranked(self, terms: list[str], wanted: int) -> _Found:
        """Pending matches of any of ``terms`` (rare words), best first."""
        ...

    def newest(self, terms: list[str], wanted: int, window: int) -> _Found:
        """Pending matches of any of ``terms`` among the newest ``window`` records."""
        ...


class _SqliteOverlay:
    """The FTS5 table, which holds only the records the vector sink lacks."""

    def __init__(self, conn: Connection, vector_sink: str | None) -> None:
        self.conn = conn
        # The pending filter's parameters, passed with every statement that may use it.
        self.filter = {"sink": vector_sink, "delivered": DeliveryState.DELIVERED.value}
        self.pending = (
            "EXISTS (SELECT 1 FROM deliveries d WHERE d.record_key = r.key "
            "AND d.sink = :sink AND d.state != :delivered)"
            if vector_sink
            else "1"
        )

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
        row = self.conn.execute(
            text(f"SELECT {probes}"), {**self._phrases(terms), "cap": cap}
        ).one()
        return dict(zip(terms, (int(count) for count in row), strict=True))

    def ranked(self, terms: list[str], wanted: int) -> _Found:
        statement = text(
            "SELECT r.key AS key, -bm25(records_fts) AS score, r.meta AS meta "
            "FROM records_fts JOIN records r ON r.seq = records_fts.rowid "
            f"WHERE records_fts MATCH :q AND {self.pending} "
            "ORDER BY bm25(records_fts), records_fts.rowid DESC LIMIT :n"
        )
        phrases = " OR ".join(self._phrases(terms).values())
        return _found(self.conn.execute(statement, {"q": phrases, "n": wanted, **self.filter}))

    def newest(self, terms: list[str], wanted: int, window: int) -> _Found:
        oldest = self.conn.execute(
            text("SELECT rowid FROM records_fts ORDER BY rowid DESC LIMIT 1 OFFSET :skip"),
            {"skip": window - 1},
        ).scalar()
        hits = " UNION ALL ".join(
            f"SELECT rowid AS seq FROM records_fts WHERE records_fts MATCH :t{number} "
            "AND rowid >= :oldest"
            for number in range(len(terms))
        )
        statement = text(
            "SELECT r.key AS key, h.score AS score, r.meta AS meta "
            f"FROM (SELECT seq, count(*) AS score FROM ({hits}) GROUP BY seq) h "
            f"JOIN records r ON r.seq = h.seq WHERE {self.pending} "
            "ORDER BY h.score DESC, h.seq DESC LIMIT :n"
        )
        params = {**self._phrases(terms), "oldest": oldest or 0, "n": wanted, **self.filter}
        return _found(self.conn.execute(statement, params))


class _PostgresOverlay:
    """The GIN index over every record's text; the pending filter applies after the match."""

    # The index's own expression, the configuration inline, so the planner can match it.
    vector = func.to_tsvector(literal_column("'simple'"), records.c.content)

    def __init__(self, conn: Connection, vector_sink: str | None) -> None:
        self.conn = conn
        self.sink = vector_sink
        # The planner prices to_tsvector far below what parsing a record costs, so under
        # a LIMIT it would rather parse record after record than read the GIN index; for
        # this read-only transaction only, the index is the way in.
        conn.execute(text("SET LOCAL enable_seqscan = off"))

    def counts(self, terms: list[str], cap: int) -> dict[str, int]:
        found = dict.fromkeys(self._frequent(terms, cap), cap)
        probed = [term for term in terms if term not in found]
        if probed:
            probes = [
                select(func.count())
                .select_from(
                    select(literal_column("1"))
                    .where(self.vector.op("@@")(_tsquery([term])))
                    .limit(cap)
                    .subquery()
                )
                .scalar_subquery()
                for term in probed
            ]
            row = self.conn.execute(select(*probes)).one()
            found.update(zip(probed, (int(count) for count in row), strict=True))
        return {term: found[term] for term in terms}

    def _frequent(self, terms: list[str], cap: int) -> set[str]:
        """Words ANALYZE last saw in ``cap`` records or more: common without a probe, whose
        bitmap would read every index entry of theirs."""
        statement = text(
            "SELECT s.elem FROM pg_stats p, pg_class c, "
            "unnest(p.most_common_elems::text::text[], p.most_common_elem_freqs) AS s(elem, freq) "
            "WHERE p.schemaname = current_schema() AND p.tablename = 'ix_records_content_fts' "
            "AND c.oid = 'records'::regclass AND s.elem = ANY(:terms) "
            "AND s.freq * c.reltuples >= :cap"
        )
        return set(self.conn.execute(statement, {"terms": terms, "cap": cap}).scalars())

    def _pending(self, statement: Any, key: Any) -> Any:
        if not self.sink:
            return statement
        return statement.where(
            select(deliveries.c.id)
            .where(
                deliveries.c.record_key == key,
                deliveries.c.sink == self.sink,
                deliveries.c.state != DeliveryState.DELIVERED,
            )
            .exists()
        )

    def ranked(self, terms: list[str], wanted: int) -> _Found:
        query = _tsquery(terms)
        rank = func.ts_rank(self.vector, query).label("score")
        statement = (
            select(records.c.key, rank, records.c.meta)
            .where(self.vector.op("@@")(query))
            .order_by(rank.desc(), records.c.seq.desc())
            .limit(wanted)
        )
        return _found(self.conn.execute(self._pending(statement, records.c.key)))

    def newest(self, terms: list[str], wanted: int, window: int) -> _Found:
        recent = (
            select(records.c.key, records.c.seq, records.c.meta, self.vector.label("vector"))
            .where(records.c.seq > select(func.max(records.c.seq)).scalar_subquery() - window)
            .offset(0)  # a fence: each record's text is parsed once, not once per use
            .subquery()
        )
        query = _tsquery(terms)
        rank = func.ts_rank(recent.c.vector, query).label("score")
        statement = (
            select(recent.c.key, rank, recent.c.meta)
            .where(recent.c.vector.op("@@")(query))
            .order_by(rank.desc(), recent.c.seq.desc())
            .limit(wanted)
        )
        return _found(self.conn.execute(self._pending(statement, recent.c.key)))


_OverlayFactory = Callable[[Connection, str | None], _Overlay]


class RecallQueries:
    """Recall's reads over one reader engine, with its database's overlay chosen once."""

    def __init__(self, reader: Engine) -> None:
        self.reader = reader
        sqlite = reader.dialect.name == "sqlite"
        self._overlay: _OverlayFactory = _SqliteOverlay if sqlite else _PostgresOverlay

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
        there is no vector sink) that share words with ``query``; best first.

        Recall runs this on every query, so its cost must not grow with the backlog: each
        step reads at most about ``budget`` matches per word. Each word's matches are counted
        up to ``budget`` + 1; the rarest words whose matches fit in ``budget`` together are
        ranked over all their matches (SQLite: FTS5 bm25, PostgreSQL: ts_rank). Words more
        common than that only count among the newest ``budget`` records, whose hits come
        after: on SQLite ranked by how many of those words each holds (bm25's document
        frequencies would walk every match), on PostgreSQL by ts_rank. Scores order one
        call's results only. PostgreSQL's index holds delivered records too, so there "rare"
        and "newest" count those as well.
        """
        terms = match_terms(query)
        if not terms:
            return []
        wanted = limit * 3  # room for the session filter below
        with self.reader.connect() as conn:
            overlay = self._overlay(conn, vector_sink)
            counts = overlay.counts(terms, budget + 1)
            telling = telling_terms(counts, budget)
            common = [term for term in terms if counts[term] and term not in telling]
            found = overlay.ranked(telling, wanted) if telling else []
            if common and len(found) < wanted:
                seen = {key for key, _score, _meta in found}
                newest = overlay.newest(common, wanted, budget)
                found += [item for item in newest if item[0] not in seen]
        if session_id is not None:
            found = [item for item in found if _meta_session(item[2]) == session_id]
        return [(key, score) for key, score, _meta in found[:limit]]


def _tsquery(terms: list[str]) -> Any:
    return func.to_tsquery("simple", " | ".join(terms))


def _found(rows: Iterable[Any]) -> _Found:
    return [(row.key, float(row.score), row.meta) for row in rows]


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
