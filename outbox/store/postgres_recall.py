"""PostgreSQL's lexical leg: the GIN ``tsvector`` index over every record's text (ts_rank),
and the recall filter as a SQLAlchemy expression, so it applies inside the leg's query (before
its LIMIT), never to the rows a LIMIT already cut. The steps it answers are ``store/lexical.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, and_, cast, func, literal_column, select, text, true
from sqlalchemy.dialects.postgresql import JSONB

from outbox.core.recall_filter import RecallFilter
from outbox.core.states import DeliveryState
from outbox.store.lexical import SCAN_FACTOR, Found
from outbox.store.schema import deliveries, graph_nodes, records


def postgres_clause(filters: RecallFilter, table: Any = records) -> Any:
    """The same condition as a SQLAlchemy expression over ``table`` (``records`` or a
    subquery with its columns)."""
    conditions: list[Any] = []
    if filters.session_id is not None:
        conditions.append(table.c.meta["session_id"].as_string() == filters.session_id)
    if filters.agent is not None:
        conditions.append(table.c.meta["agent"].as_string() == filters.agent)
    if filters.tags:
        conditions.append(cast(table.c.tags, JSONB).contains(list(filters.tags)))
    if filters.min_importance is not None:
        conditions.append(table.c.importance >= filters.min_importance)
    if filters.since is not None:
        conditions.append(table.c.ts >= filters.since)
    if filters.until is not None:
        conditions.append(table.c.ts < filters.until)
    return and_(*conditions) if conditions else true()


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

    def total(self) -> int:
        return int(self.conn.execute(select(func.max(records.c.seq))).scalar() or 0)

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

    def ranked(self, terms: list[str], wanted: int) -> Found:
        query = _tsquery(terms)
        rank = func.ts_rank(self.vector, query).label("score")
        statement = (
            select(records.c.key, rank)
            .where(self.vector.op("@@")(query), postgres_clause(self.filters))
            .order_by(rank.desc(), records.c.seq.desc())
            .limit(wanted)
        )
        return _found(self.conn.execute(self._pending(statement, records.c.key)))

    def newest(self, terms: list[str], wanted: int, window: int) -> Found:
        recent = (
            select(records.c.key, records.c.seq, records.c.meta, self.vector.label("vector"))
            .where(records.c.seq.in_(self._window(window)))
            .offset(0)  # a fence: each record's text is parsed once, not once per use
            .subquery()
        )
        query = _tsquery(terms)
        rank = func.ts_rank(recent.c.vector, query).label("score")
        statement = (
            select(recent.c.key, rank)
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


def _tsquery(terms: list[str]) -> Any:
    return func.to_tsquery("simple", " | ".join(terms))


def _found(rows: Iterable[Any]) -> Found:
    return [(str(row.key), float(row.score)) for row in rows]
