"""Reads behind the dashboard (``outbox ui``): memories newest first under its filters, and
how many deliveries and failures each sink had in each slice of a recent window.

Both stay bounded by an index at any store size: paging walks the recency index (or the
session index) and stops at the page's end; the window reads one range of the
``(sink, state, available_at)`` index per sink and state.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Integer,
    Text,
    and_,
    cast,
    func,
    literal,
    or_,
    select,
    text,
    type_coerce,
)
from sqlalchemy.sql.elements import TextClause

from outbox.core.recall_filter import RecallFilter
from outbox.core.states import DeliveryState
from outbox.store.postgres_recall import postgres_clause
from outbox.store.rows import RecentRow, recent_row
from outbox.store.schema import deliveries, graph_nodes, records
from outbox.store.sqlite_recall import sqlite_clause

# How many of the newest memories a tagged page looks among before it scans the records.
TAG_PROBE = 2000


@dataclass(frozen=True)
class Activity:
    """Per slice of the window, oldest first: deliveries, and rows whose latest failure
    fell in it (still retrying, or dead)."""

    delivered: list[int]
    failed: list[int]


class BrowseQueries:
    """The dashboard's reads over one reader engine."""

    def __init__(self, reader: Engine) -> None:
        self.reader = reader
        self._sqlite = reader.dialect.name == "sqlite"

    def memories(
        self,
        *,
        limit: int,
        session_id: str | None = None,
        agent: str | None = None,
        tag: str | None = None,
        before: tuple[str, str] | None = None,
    ) -> list[RecentRow]:
        """Newest memories first, keyset-paged by (timestamp, key) like ``recent``; with a
        tag, only memories that carry it.

        A tag has no index, so a tagged page first looks among the newest ``TAG_PROBE``
        memories that pass the other filters (a common tag fills the page there). When that
        gives less than a page, the tag is rare: one pass over the records, newest first by
        a bounded sort, finds the rest. A page never costs more than one such pass.
        """
        page = self._walk(limit, session_id, agent, before, tag, probe=TAG_PROBE if tag else None)
        if tag is None or len(page) >= limit:
            return page[:limit]
        return self._scan(
            limit, RecallFilter(session_id=session_id, agent=agent, tags=(tag,)), before
        )

    def _walk(
        self,
        limit: int,
        session_id: str | None,
        agent: str | None,
        before: tuple[str, str] | None,
        tag: str | None,
        probe: int | None,
    ) -> list[RecentRow]:
        """Down the recency index (or the session index), the tag checked on the newest
        ``probe`` nodes only."""
        node = graph_nodes.c
        nodes = select(node.id, node.ts, node.session_id, node.agent).where(
            node.label == "AGENT_MEMORY"
        )
        if session_id is not None:
            nodes = nodes.where(node.session_id == session_id)
        if agent is not None:
            nodes = nodes.where(node.agent == agent)
        if before is not None:
            ts, key = before
            nodes = nodes.where(or_(node.ts < ts, and_(node.ts == ts, node.id < key)))
        newest = nodes.order_by(node.ts.desc(), node.id.desc()).limit(probe or limit).subquery()
        query = (
            select(newest, records.c.content, records.c.importance, records.c.tags, records.c.meta)
            .join(records, records.c.key == newest.c.id)
            .order_by(newest.c.ts.desc(), newest.c.id.desc())
            .limit(limit)
        )
        if tag is not None:
            query = query.where(self._condition(RecallFilter(tags=(tag,))))
        with self.reader.connect() as conn:
            return [recent_row(row) for row in conn.execute(query).all()]

    def _scan(
        self, limit: int, filters: RecallFilter, before: tuple[str, str] | None
    ) -> list[RecentRow]:
        """One pass over the records with the recall filter, the newest ``limit`` kept."""
        found = select(records.c.key, records.c.ts).where(self._condition(filters))
        if self._sqlite:
            for tag in filters.tags:
                found = found.where(_may_hold(tag))
        if before is not None:
            ts, key = before
            found = found.where(
                or_(records.c.ts < ts, and_(records.c.ts == ts, records.c.key < key))
            )
        newest = found.order_by(records.c.ts.desc(), records.c.key.desc()).limit(limit).subquery()
        node = graph_nodes.c
        query = (
            select(
                node.id,
                node.ts,
                node.session_id,
                node.agent,
                records.c.content,
                records.c.importance,
                records.c.tags,
                records.c.meta,
            )
            .select_from(newest)
            .join(graph_nodes, node.id == newest.c.key)
            .join(records, records.c.key == newest.c.key)
            .where(node.label == "AGENT_MEMORY")
            .order_by(newest.c.ts.desc(), newest.c.key.desc())
        )
        with self.reader.connect() as conn:
            return [recent_row(row) for row in conn.execute(query).all()]

    def _condition(self, filters: RecallFilter) -> ColumnElement[bool] | TextClause:
        """The recall filter's own SQL, so browsing and recall agree on what a filter
        admits."""
        if not self._sqlite:
            condition: ColumnElement[bool] = postgres_clause(filters)
            return condition
        clause, params = sqlite_clause(filters, alias=records.name)
        return text(clause).bindparams(**params)

    def count(self, state: str, sink: str | None = None) -> int:
        """Rows in ``state`` (of ``sink``, when given)."""
        query = select(func.count()).select_from(deliveries).where(deliveries.c.state == state)
        if sink is not None:
            query = query.where(deliveries.c.sink == sink)
        with self.reader.connect() as conn:
            return int(conn.execute(query).scalar() or 0)

    def activity(
        self, sinks: Sequence[str], *, since: float, width: float, slices: int
    ) -> dict[str, Activity]:
        """Per sink, deliveries and failures in each of ``slices`` slices of ``width``
        seconds from ``since`` on.

        A delivered row's ``available_at`` is its delivery time and a dead row's its death,
        so those two are counted from the ``(sink, state, available_at)`` index alone. A row
        retrying after a failure has its next try there (later than the failure, so the
        range still finds it) and is sliced by ``updated_at``, its failure time. A row keeps
        only its latest failure: earlier failures of one row are not counted.
        """
        column = deliveries.c
        found: dict[str, Activity] = {}
        with self.reader.connect() as conn:
            for sink in sinks:
                window = (since, width)
                delivered = _slices(conn, sink, DeliveryState.DELIVERED, column.available_at,
                                    *window, sqlite=self._sqlite)  # fmt: skip
                failed = _slices(conn, sink, DeliveryState.DEAD, column.available_at, *window,
                                 sqlite=self._sqlite)  # fmt: skip
                retrying = _slices(conn, sink, DeliveryState.PENDING, column.updated_at, *window,
                                   sqlite=self._sqlite, failures_only=True)  # fmt: skip
                found[sink] = Activity(
                    delivered=[delivered.get(index, 0) for index in range(slices)],
                    failed=[
                        failed.get(index, 0) + retrying.get(index, 0) for index in range(slices)
                    ],
                )
        return found


def _slices(
    conn: Connection,
    sink: str,
    state: str,
    when: ColumnElement[Any],
    since: float,
    width: float,
    *,
    sqlite: bool,
    failures_only: bool = False,
) -> dict[int, int]:
    """{slice: rows} of one sink's rows in ``state`` found from ``since`` on the index."""
    column = deliveries.c
    elapsed = (when - since) / width
    # Whole slices: SQLite's CAST truncates (and ``elapsed`` is never negative here), while
    # PostgreSQL's rounds, so it takes floor(), which SQLite may be built without.
    slice_of = cast(elapsed, Integer) if sqlite else cast(func.floor(elapsed), Integer)
    query = (
        select(slice_of, func.count())
        .where(column.sink == sink, column.state == state, column.available_at >= since)
        .where(when >= since)
        .group_by(slice_of)
    )
    if failures_only:
        query = query.where(column.error_class.is_not(None))
    return {int(index): int(count) for index, count in conn.execute(query).all()}


def _may_hold(tag: str) -> ColumnElement[bool]:
    """A cheap first test for SQLite's tags text: the tag as JSON (as the writer encodes
    it, or with its non-ASCII letters unescaped) appears in it. Rows that pass still meet
    the exact ``json_each`` test; this only spares it the rest, about half the pass."""
    needles = {json.dumps(tag), json.dumps(tag, ensure_ascii=False)}
    text_of = type_coerce(records.c.tags, Text)  # the stored text, not a JSON value
    return or_(*(func.instr(text_of, literal(needle, Text)) > 0 for needle in sorted(needles)))
