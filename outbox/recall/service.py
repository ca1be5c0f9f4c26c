"""Hybrid recall as one library call (``Outbox.recall``): a query through both legs, fused,
lifted by session context and by the dates it names, cut at the relevance floor, returned
as typed hits that each face shapes for its own readers (docs/memory-core.md).

The lexical leg reads the store, so a memory is findable by its words the moment ``add``
returns; the vector leg asks Chroma, whose sink is loaded by the first recall that needs
it, so importing this module (or ``outbox.api``) loads no sink and no model.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime
from typing import TYPE_CHECKING, Any, Protocol

from outbox.core.errors import ValidationError
from outbox.core.keys import parse_instant
from outbox.core.recall_filter import RecallFilter
from outbox.core.states import BuiltinSink
from outbox.recall.dates import DateWindow, named_dates
from outbox.recall.fusion import (
    CONTEXT_REACH,
    MIN_RELEVANCE,
    Candidate,
    Fusion,
    TermWeights,
    background,
    candidates,
    fuse,
    relevant,
    with_context,
    with_dates,
)

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.sinks.chroma import ChromaSink
    from outbox.store.lexical import LexicalHits
    from outbox.store.rows import StoredRecord

log = logging.getLogger(__name__)

VECTOR_SINK = BuiltinSink.CHROMA
# The most hits one recall returns: a caller asking for more gets this many.
MAX_HITS = 100
# How many hits each leg hands to the fusion, at least: room below the top for the other
# leg's evidence to lift a memory.
LEG_DEPTH = 20
# The fusion chosen on the development split (docs/benchmarks.md); read at each recall, so
# a benchmark can measure another one.
FUSION = Fusion()


@dataclass(frozen=True)
class RecallHit:
    """One recalled memory: what it says and whose it is, which legs found it, each leg's
    rank and score, and how relevant it reads (0..1; ``score`` orders one answer only)."""

    key: str
    content: str
    timestamp: str
    session_id: str | None
    agent: str | None
    importance: int
    tags: tuple[str, ...]
    metadata: Mapping[str, Any]
    legs: tuple[str, ...]
    relevance: float
    score: float
    lexical_rank: int | None
    bm25: float | None  # the lexical leg's score: bm25 on SQLite, ts_rank on PostgreSQL
    vector_rank: int | None
    distance: float | None  # cosine distance in the vector leg

    @property
    def source(self) -> str:
        """The leg a reader credits: the vector leg when it found the memory, else lexical."""
        return "vector" if self.vector_rank is not None else "lexical"


@dataclass(frozen=True)
class RecallAnswer:
    """A recall's hits, best first, with the floor they were held to and, when the vector
    index could not be asked, why (the hits are then the lexical leg's alone)."""

    query: str
    hits: tuple[RecallHit, ...]
    min_relevance: float
    degraded: str | None = None


class RecallReads(Protocol):
    """What recall reads from the store: the full outbox's ``RecallQueries``, or SQLite's
    bare reads when ``outbox search`` runs without it (``recall/direct.py``)."""

    def lexical(self, query: str, *, limit: int, filters: RecallFilter) -> LexicalHits: ...

    def neighbours(self, keys: Iterable[str], reach: int) -> dict[str, list[str]]: ...

    def get_records(self, keys: Iterable[str]) -> dict[str, StoredRecord]: ...


class Recaller:
    """Hybrid recall over one outbox's store; Chroma's index is opened on first need and
    kept for the next recall, since opening it costs far more than a query."""

    def __init__(self, reads: RecallReads, settings: Settings) -> None:
        self.reads = reads
        self.settings = settings
        self._vector: ChromaSink | None = None
        self._opening = threading.Lock()  # concurrent first recalls share one index

    def recall(
        self,
        query: str,
        *,
        limit: int = 10,
        session_id: str | None = None,
        agent: str | None = None,
        tags: Iterable[str] | None = None,
        min_importance: int | None = None,
        since: str | datetime | date | None = None,
        until: str | datetime | date | None = None,
        min_relevance: float | None = None,
    ) -> RecallAnswer:
        """The lexical leg (every record) fused with Chroma's nearest documents, both
        filtered inside their own query; when no hit reaches ``min_relevance`` (default
        ``MIN_RELEVANCE``) the answer is empty, so a query nothing answers gets nothing."""
        if not isinstance(query, str) or not query.strip():
            raise ValidationError("query", "is empty")
        limit = max(1, min(int(limit), MAX_HITS))
        floor = MIN_RELEVANCE if min_relevance is None else float(min_relevance)
        filters = RecallFilter.of(
            session_id=session_id,
            agent=agent,
            tags=tags,
            min_importance=min_importance,
            since=since,
            until=until,
        )
        depth = max(LEG_DEPTH, limit)
        lexical = self.reads.lexical(query, limit=depth, filters=filters)
        vector: list[tuple[str, float]] = []
        degraded: str | None = None
        if VECTOR_SINK in self.settings.sinks:
            vector, degraded = self.vector_leg(query, depth, filters)
        stored = self.reads.get_records({key for key, _ in [*lexical.hits, *vector]})
        weights = TermWeights.of(lexical.counts, lexical.total, lexical.cap)
        when = named_dates(query)
        coverage = {key: _coverage(weights, item, when) for key, item in stored.items()}
        admitted = [
            (key, distance)
            for key, distance in vector
            if key in stored and _admits(filters, stored[key])
        ]
        behind = background([distance for _key, distance in vector])
        scored = fuse(candidates(lexical.hits, admitted, coverage, behind), FUSION)
        scored = self._with_context(scored, filters, weights, stored, coverage, when)
        scored = with_dates(scored, [key for key in stored if _on(stored[key], when)], FUSION)
        hits = tuple(
            _hit(item, score, stored[item.key])
            for item, score in relevant(scored, floor, limit)
            if item.key in stored and not stored[item.key].forgotten
        )
        return RecallAnswer(query=query, hits=hits, min_relevance=floor, degraded=degraded)

    def _with_context(
        self,
        scored: list[tuple[Candidate, float]],
        filters: RecallFilter,
        weights: TermWeights,
        stored: dict[str, StoredRecord],
        coverage: dict[str, float],
        when: list[DateWindow],
    ) -> list[tuple[Candidate, float]]:
        """The best hits lend part of their score to their session neighbours that pass
        the filter (``stored`` and ``coverage`` gain those neighbours', each measured once)."""
        sources = [item.key for item, _score in scored[: FUSION.context_sources]]
        near = self.reads.neighbours(sources, CONTEXT_REACH)
        missing = {key for keys in near.values() for key in keys} - stored.keys()
        stored.update(self.reads.get_records(missing))
        coverage.update(
            (key, _coverage(weights, stored[key], when)) for key in missing if key in stored
        )
        neighbours = {
            source: [
                Candidate(key=key, coverage=coverage[key])
                for key in keys
                if key in stored and _admits(filters, stored[key])
            ]
            for source, keys in near.items()
        }
        return with_context(scored, neighbours, FUSION)

    def vector_leg(
        self, query: str, depth: int, filters: RecallFilter
    ) -> tuple[list[tuple[str, float]], str | None]:
        """((key, distance) nearest first, why it failed): an unreachable index degrades
        recall to the lexical leg instead of failing it."""
        try:
            hits = self.vector_index().nearest(query, depth, filters.chroma_where())
        except Exception as exc:
            degraded = f"vector index unavailable ({exc.__class__.__name__})"
            log.warning("semantic leg of recall failed: %s", degraded)
            return [], degraded
        return hits, None

    def vector_index(self) -> ChromaSink:
        """The Chroma sink recall searches, following the active index; loaded on first
        use so a process that never recalls by meaning never imports chromadb."""
        with self._opening:
            if self._vector is None:
                from outbox.sinks.chroma import ChromaSink

                self._vector = ChromaSink.from_settings(self.settings)
            return self._vector

    def close(self) -> None:
        with self._opening:
            vector, self._vector = self._vector, None
        if vector is not None:
            vector.close()


def _hit(item: Candidate, score: float, stored: StoredRecord) -> RecallHit:
    """A fused candidate with its stored memory, as the typed hit callers get."""
    record = stored.record
    return RecallHit(
        key=item.key,
        content=record.content,
        timestamp=record.timestamp,
        session_id=record.metadata.get("session_id"),
        agent=record.metadata.get("agent"),
        importance=record.importance,
        tags=tuple(record.tags),
        metadata=record.metadata,
        legs=tuple(item.legs),
        relevance=item.relevance,
        score=score,
        lexical_rank=item.lexical_rank,
        bm25=item.lexical_score,
        vector_rank=item.vector_rank,
        distance=item.distance,
    )


def _on(item: StoredRecord, when: list[DateWindow]) -> bool:
    """Whether a stored memory was written on one of the dates a query names."""
    return any(window.holds(parse_instant(item.record.timestamp)) for window in when)


def _coverage(weights: TermWeights, item: StoredRecord, when: list[DateWindow]) -> float:
    """The share of the query's words a memory holds; a memory written on a date the query
    names holds that date's words too ("July", "2023"), which its text seldom repeats."""
    said = [window.wording for window in when if window.holds(parse_instant(item.record.timestamp))]
    return weights.coverage(" ".join([item.record.content, *said]))


def _admits(filters: RecallFilter, item: StoredRecord) -> bool:
    """A vector hit passes the filter by its stored record too: a document embedded before
    its metadata carried a key is never let through on the index's word alone."""
    record = item.record
    if item.forgotten:  # still in the vector index until the dispatcher's delete lands
        return False
    return filters.admits(record.timestamp, record.importance, record.tags, record.metadata)
