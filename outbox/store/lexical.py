"""The lexical leg of recall: how each database finds records by their words.

SQLite's FTS5 (bm25) and PostgreSQL's GIN ``tsvector`` index (ts_rank) answer the same three
questions behind one small interface, chosen once per query by ``RecallQueries``: how common
each word is, the best matches of the rare ones, and the newest matches of the common ones.
Each question reads a bounded number of index entries, so its cost stays flat with the store.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from sqlalchemy import Connection, func, literal_column, select, text

from outbox.core.recall_filter import RecallFilter
from outbox.core.states import DeliveryState
from outbox.store.recall_filters import postgres_clause, sqlite_clause
from outbox.store.schema import deliveries, graph_nodes, records

_WORD = re.compile(r"\w+", re.UNICODE)

# About how many index entries per query word one lookup of the pending overlay may touch:
# what keeps recall's cost flat however large the backlog grows.
MATCH_BUDGET = 500
# How many of the newest records (of the filter's session, when it names one) a filtered
# lookup reads to find the newest ``budget`` that pass the rest of the filter.
SCAN_FACTOR = 8


# English function words: what a question is phrased with rather than what it asks about.
# A query's own stop words would rank short memories that share only "what did you do"
# above the one that answers it; bm25's rarity weight alone does not offset that.
_STOP_WORDS = """
    a about above after again against all also am an and any are as at be because been
    before being below between both but by can could did didn do does doesn doing don down
    during each else ever few for from further had has have having he her here hers herself
    him himself his how if in into is isn it its itself just may me might more most must my
    myself no nor not now of off on once only or other our ours ourselves out over own same
    shall she should so some such than that the their theirs them themselves then there these
    they this those through to too under until up very was wasn we were weren what when where
    which while who whom whose why will with won would you your yours yourself yourselves
"""
QUERY_STOP_WORDS = frozenset(_STOP_WORDS.split())


def match_terms(query: str) -> list[str]:
    """Distinct lowercase words of a query that say what it is about (its stop words only
    when it has nothing else), longest first: the most telling ones."""
    words = dict.fromkeys(word.lower() for word in _WORD.findall(query) if len(word) > 1)
    telling = [word for word in words if word not in QUERY_STOP_WORDS] or list(words)
    return sorted(telling, key=len, reverse=True)[:16]


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


class Overlay(Protocol):
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


class SqliteOverlay:
    """The FTS5 table (rowid = the record's seq), which holds every record."""

    def __init__(self, conn: Connection, vector_sink: str | None, filters: RecallFilter) -> None:
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
        extra: dict[str, Any]
        if self.filters.empty:
            oldest = self.conn.execute(
                text("SELECT rowid FROM records_fts ORDER BY rowid DESC LIMIT 1 OFFSET :skip"),
                {"skip": window - 1},
            ).scalar()
            scope, extra = "rowid >= :oldest", {"oldest": oldest or 0}
        else:
            scope, extra = "rowid IN (SELECT value FROM json_each(:seqs))", self._window(window)
        hits = " UNION ALL ".join(
            f"SELECT rowid AS seq FROM records_fts WHERE records_fts MATCH :t{number} AND {scope}"
            for number in range(len(terms))
        )
        statement = text(
            "SELECT r.key AS key, h.score AS score, r.meta AS meta "
            f"FROM (SELECT seq, count(*) AS score FROM ({hits}) GROUP BY seq) h "
            f"JOIN records r ON r.seq = h.seq WHERE {self.pending} "
            "ORDER BY h.score DESC, h.seq DESC LIMIT :n"
        )
        params = {**self._phrases(terms), **extra, "n": wanted, **self.filter}
        return _found(self.conn.execute(statement, params))

    def _window(self, window: int) -> dict[str, Any]:
        """The newest ``window`` records that pass the filter, among a bounded number of the
        newest (of the session, through its index, when the filter names one)."""
        newest = (
            "SELECT r.* FROM graph_nodes g JOIN records r ON r.key = g.id "
            "WHERE g.session_id = :f_session ORDER BY g.ts DESC LIMIT :scan"
            if self.filters.session_id is not None
            else "SELECT * FROM records ORDER BY seq DESC LIMIT :scan"
        )
        statement = text(f"SELECT r.seq FROM ({newest}) r WHERE {self.pending} LIMIT :window")
        params = {**self.filter, "scan": window * SCAN_FACTOR, "window": window}
        seqs = self.conn.execute(statement, params).scalars().all()
        return {"seqs": "[" + ",".join(str(int(seq)) for seq in seqs) + "]"}


class PostgresOverlay:
    """The GIN index over every record's text; the pending filter applies after the match."""

    # The index's own expression, the configuration inline, so the planner can match it.
    vector = func.to_tsvector(literal_column("'simple'"), records.c.content)

    def __init__(self, conn: Connection, vector_sink: str | None, filters: RecallFilter) -> None:
        self.conn = conn
        self.sink = vector_sink
        self.filters = filters
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
            .where(self.vector.op("@@")(query), postgres_clause(self.filters))
            .order_by(rank.desc(), records.c.seq.desc())
            .limit(wanted)
        )
        return _found(self.conn.execute(self._pending(statement, records.c.key)))

    def newest(self, terms: list[str], wanted: int, window: int) -> _Found:
        recent = (
            select(records.c.key, records.c.seq, records.c.meta, self.vector.label("vector"))
            .where(records.c.seq.in_(self._window(window)))
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

    def _window(self, window: int) -> Any:
        """The seqs of the newest ``window`` records that pass the filter, among a bounded
        number of the newest (of the session, through its index, when the filter names one)."""
        if self.filters.empty:
            newest = select(func.max(records.c.seq)).scalar_subquery() - window
            return select(records.c.seq).where(records.c.seq > newest)
        scan = select(records).order_by(records.c.seq.desc())
        if self.filters.session_id is not None:
            scan = (
                select(records)
                .join(graph_nodes, graph_nodes.c.id == records.c.key)
                .where(graph_nodes.c.session_id == self.filters.session_id)
                .order_by(graph_nodes.c.ts.desc())
            )
        scanned = scan.limit(window * SCAN_FACTOR).subquery()
        return select(scanned.c.seq).where(postgres_clause(self.filters, scanned)).limit(window)


OverlayFactory = Callable[[Connection, str | None, RecallFilter], Overlay]


def _tsquery(terms: list[str]) -> Any:
    return func.to_tsquery("simple", " | ".join(terms))


def _found(rows: Iterable[Any]) -> _Found:
    return [(row.key, float(row.score), row.meta) for row in rows]
