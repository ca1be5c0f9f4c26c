"""memory-core's surface on top of the outbox, named after neo.mjs's MemoryService.

``add_memory`` is the per-turn save that must never fail: it validates, commits through the
outbox and returns at once, with a ``visibility`` block saying what recall can see now. Recall
is read-after-write: ``query_recent_turns`` reads the graph the write just committed, and
``query_raw_memories`` fuses a lexical leg over every record (so a fresh memory is findable
by its own words before any model has run) with Chroma's semantic hits, each result saying
which legs found it and how relevant it reads (docs/memory-core.md).

A turn's content is its canonical document, defined once here::

    User Prompt: <prompt>
    Agent Thought: <thought>
    Agent Response: <response>

with the three field lengths kept in the record's metadata (``turn``), so the fields split
back exactly and replaying a fallback file rebuilds the same turn and the same key.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from outbox.api import Outbox
from outbox.core.config import Settings
from outbox.core.keys import parse_instant
from outbox.core.receipt import Receipt
from outbox.core.record import check_content
from outbox.core.states import BuiltinSink, ReceiptStatus
from outbox.recall.dates import DateWindow, named_dates
from outbox.recall.fusion import (
    MIN_RELEVANCE,
    Candidate,
    Fusion,
    RecallFilter,
    TermWeights,
    candidates,
    fuse,
    relevant,
    with_context,
    with_dates,
)

if TYPE_CHECKING:
    from outbox import RecentRow

log = logging.getLogger(__name__)

PROMPT, THOUGHT, RESPONSE = "User Prompt: ", "\nAgent Thought: ", "\nAgent Response: "
VECTOR_SINK = BuiltinSink.CHROMA
MAX_LIMIT = 100
# How many hits each leg hands to the fusion, at least: room below the top for the other
# leg's evidence to lift a memory.
LEG_DEPTH = 20
# The fusion chosen on the development split (docs/benchmarks.md).
FUSION = Fusion()
# The record metadata keys the BrainLayer sink reads a memory's type and project from.
TYPE_KEY, PROJECT_KEY = "type", "project"


def compose_turn(prompt: str, thought: str, response: str) -> str:
    """The canonical document of a turn (the record's content and markdown body)."""
    return f"{PROMPT}{prompt}{THOUGHT}{thought}{RESPONSE}{response}"


def split_turn(content: str, lengths: Iterable[int] | None = None) -> dict[str, str] | None:
    """Prompt, thought and response back from a turn document; None if it is not one."""
    if not content.startswith(PROMPT):
        return None
    body = content[len(PROMPT) :]
    sizes = list(lengths or [])
    if len(sizes) == 3:
        p, t, r = sizes
        prompt, rest = body[:p], body[p:]
        if rest.startswith(THOUGHT):
            thought, rest = rest[len(THOUGHT) : len(THOUGHT) + t], rest[len(THOUGHT) + t :]
            if rest.startswith(RESPONSE) and len(rest) - len(RESPONSE) == r:
                return {"prompt": prompt, "thought": thought, "response": rest[len(RESPONSE) :]}
    prompt, sep1, rest = body.partition(THOUGHT)
    thought, sep2, response = rest.partition(RESPONSE)
    if not (sep1 and sep2):
        return None
    return {"prompt": prompt, "thought": thought, "response": response}


class MemoryService:
    """The memory-core tools over one open outbox."""

    def __init__(self, outbox: Outbox | None = None, settings: Settings | None = None) -> None:
        self.outbox = outbox or Outbox.open(settings)
        self.session_id = str(uuid.uuid4())  # the fallback session of this process
        self._vector: Any = None

    # -- writing --------------------------------------------------------------------------

    def add_memory(
        self,
        prompt: str,
        thought: str,
        response: str,
        session_id: str | None = None,
        agent: str | None = None,
        model: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Validate each field, commit one durable write, return at once: the per-turn save
        must never fail on a model or a sink."""
        minimum = self.outbox.settings.min_content_length
        fields = {"prompt": prompt, "thought": thought, "response": response}
        for name, value in fields.items():
            check_content(value, min_length=minimum, field_name=name)
        session = session_id or self.session_id
        meta: dict[str, Any] = dict(metadata or {})
        meta.update(
            kind="turn",
            turn=[len(prompt), len(thought), len(response)],
            session_id=session,
        )
        if agent:
            meta["agent"] = agent
        if model:
            meta["model"] = model
        tags = ["turn", *([f"agent:{agent}"] if agent else [])]
        receipt = self.outbox.add(compose_turn(prompt, thought, response), tags=tags, metadata=meta)
        return {
            "id": receipt.key,
            "sessionId": session,
            "timestamp": receipt.timestamp,
            "status": receipt.status,
            "duplicate": receipt.duplicate,
            "message": receipt.text,
            "markdownPath": str(receipt.markdown_path) if receipt.markdown_path else None,
            "visibility": self.visibility(receipt),
        }

    def remember(
        self,
        content: str,
        importance: int = 5,
        tags: Iterable[str] | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        memory_type: str | None = None,
        project: str | None = None,
        session_id: str | None = None,
        agent: str | None = None,
        timestamp: str | datetime | None = None,
    ) -> Receipt:
        """A plain brain_store-style memory (no turn structure). ``memory_type`` and
        ``project`` go under the metadata keys the BrainLayer sink reads them from;
        ``session_id`` and ``agent`` where recall's filters look; ``timestamp`` when it was
        said, if not now (an import of older notes)."""
        meta = dict(metadata or {})
        if session_id:
            meta["session_id"] = session_id
        if agent:
            meta["agent"] = agent
        if memory_type:
            meta[TYPE_KEY] = memory_type
        if project:
            meta[PROJECT_KEY] = project
        return self.outbox.add(
            content, importance=importance, tags=tags, timestamp=timestamp, metadata=meta or None
        )

    def visibility(self, receipt: Receipt) -> dict[str, Any]:
        """What recall can see of this write right now, and how far behind the embed is."""
        semantic = receipt.status == ReceiptStatus.STORED or VECTOR_SINK in receipt.sink_ids
        fallback = receipt.status == ReceiptStatus.FALLBACK
        block: dict[str, Any] = {
            "recencyQueryable": not fallback,
            "lexicalQueryable": not fallback,
            "semanticQueryable": semantic,
            "pendingDepth": None,
            "pendingDepthAtLeast": None,
            "oldestPendingAgeMs": None,
        }
        try:
            depth, capped, age = self.outbox.pending_summary(VECTOR_SINK)
            block["pendingDepth"] = depth
            block["pendingDepthAtLeast"] = capped  # counted no further
            if age is not None:
                block["oldestPendingAgeMs"] = int(age * 1000)
        except Exception as exc:  # the write stands; only the figures are missing
            log.debug("visibility figures unavailable: %s", exc.__class__.__name__)
        if fallback:
            block["hint"] = (
                "The database could not take the write; it is in the fallback file and joins "
                "recall when the outbox is next opened."
            )
        elif semantic:
            block["hint"] = "Embedded: every kind of recall finds it."
        else:
            block["hint"] = (
                "query_recent_turns returns it now; query_raw_memories finds it by its words "
                "now and by meaning once the dispatcher has embedded it."
            )
        return block

    # -- recall ---------------------------------------------------------------------------

    def query_recent_turns(
        self,
        session_id: str | None = None,
        agent: str | None = None,
        limit: int = 20,
        before: Mapping[str, str] | str | None = None,
    ) -> dict[str, Any]:
        """Newest first from the graph, immediately after the write; ``nextCursor`` pages."""
        limit = max(1, min(int(limit), MAX_LIMIT))
        cursor = _parse_cursor(before)
        rows = self.outbox.recent_memories(limit, session_id=session_id, agent=agent, before=cursor)
        turns = [_turn_view(row) for row in rows]
        next_cursor = (
            {"timestamp": rows[-1].timestamp, "id": rows[-1].key} if len(rows) == limit else None
        )
        return {"count": len(turns), "turns": turns, "nextCursor": next_cursor}

    def _vector_index(self) -> Any:
        if self._vector is None:
            from outbox.sinks.chroma import ChromaSink

            self._vector = ChromaSink.from_settings(self.outbox.settings)
        return self._vector

    def query_raw_memories(
        self,
        query: str,
        n_results: int = 10,
        session_id: str | None = None,
        *,
        agent: str | None = None,
        tags: Iterable[str] | None = None,
        min_importance: int | None = None,
        since: str | None = None,
        until: str | None = None,
        min_relevance: float | None = None,
    ) -> dict[str, Any]:
        """Hybrid recall: the lexical leg (every record) fused with Chroma's semantic hits,
        both filtered inside their own query; hits below ``min_relevance`` are left out, so
        a query nothing answers returns nothing."""
        if not isinstance(query, str) or not query.strip():
            from outbox.core.errors import ValidationError

            raise ValidationError("query", "is empty")
        n_results = max(1, min(int(n_results), MAX_LIMIT))
        floor = MIN_RELEVANCE if min_relevance is None else float(min_relevance)
        filters = RecallFilter.of(
            session_id=session_id,
            agent=agent,
            tags=tags,
            min_importance=min_importance,
            since=since,
            until=until,
        )
        depth = max(LEG_DEPTH, n_results)
        lexical = self.outbox.lexical_matches(query, limit=depth, filters=filters)
        vector: list[tuple[str, float]] = []
        degraded: str | None = None
        if VECTOR_SINK in self.outbox.settings.sinks:
            vector, degraded = self._semantic(query, depth, filters)
        stored = self.outbox.get_records({key for key, _ in [*lexical.hits, *vector]})
        weights = TermWeights.of(lexical.counts, lexical.total, lexical.cap)
        when = named_dates(query)
        coverage = {key: _coverage(weights, item, when) for key, item in stored.items()}
        admitted = [
            (key, distance)
            for key, distance in vector
            if key in stored and _admits(filters, stored[key])
        ]
        scored = fuse(candidates(lexical.hits, admitted, coverage), FUSION)
        scored = self._with_context(scored, filters, weights, stored, coverage, when)
        scored = with_dates(scored, [key for key in stored if _on(stored[key], when)], FUSION)
        kept = [
            pair
            for pair in relevant(scored, floor, n_results)
            if pair[0].key in stored and not stored[pair[0].key].forgotten
        ]
        results = [_result_view(item, score, stored) for item, score in kept]
        answer: dict[str, Any] = {"query": query, "count": len(results), "results": results}
        answer["minRelevance"] = floor
        if degraded:
            answer["degraded"] = degraded
        return answer

    def _with_context(
        self,
        scored: list[tuple[Candidate, float]],
        filters: RecallFilter,
        weights: TermWeights,
        stored: dict[str, Any],
        coverage: dict[str, float],
        when: list[DateWindow],
    ) -> list[tuple[Candidate, float]]:
        """The best hits lend part of their score to their session neighbours that pass
        the filter (``stored`` and ``coverage`` gain those neighbours', each measured once)."""
        sources = [item.key for item, _score in scored[: FUSION.context_sources]]
        near = self.outbox.session_neighbours(sources)
        missing = {key for keys in near.values() for key in keys} - stored.keys()
        stored.update(self.outbox.get_records(missing))
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

    def _semantic(
        self, query: str, n_results: int, filters: RecallFilter
    ) -> tuple[list[tuple[str, float]], str | None]:
        """((key, distance) nearest first, why it failed): an unreachable index degrades
        recall to the lexical leg instead of failing it."""
        try:
            hits = self._vector_index().search(query, n_results, filters.chroma_where())
        except Exception as exc:
            degraded = f"vector index unavailable ({exc.__class__.__name__})"
            log.warning("semantic leg of query_raw_memories failed: %s", degraded)
            return [], degraded
        return list(zip(hits.ids, hits.distances, strict=False)), None

    def forget(self, key: str) -> dict[str, Any]:
        """Remove a memory everywhere, by its key or a unique prefix (``Outbox.forget``)."""
        return self.outbox.forget(key).to_dict()

    def close(self) -> None:
        if self._vector is not None:
            self._vector.close()
        self.outbox.close()


def _on(item: Any, when: list[DateWindow]) -> bool:
    """Whether a stored memory was written on one of the dates a query names."""
    return any(window.holds(parse_instant(item.record.timestamp)) for window in when)


def _coverage(weights: TermWeights, item: Any, when: list[DateWindow]) -> float:
    """The share of the query's words a memory holds; a memory written on a date the query
    names holds that date's words too ("July", "2023"), which its text seldom repeats."""
    said = [window.wording for window in when if window.holds(parse_instant(item.record.timestamp))]
    return weights.coverage(" ".join([item.record.content, *said]))


def _admits(filters: RecallFilter, item: Any) -> bool:
    """A vector hit passes the filter by its stored record too: a document embedded before
    its metadata carried a key is never let through on the index's word alone."""
    record = item.record
    if item.forgotten:  # still in the vector index until the dispatcher's delete lands
        return False
    return filters.admits(record.timestamp, record.importance, record.tags, record.metadata)


def _result_view(item: Candidate, score: float, stored: Mapping[str, Any]) -> dict[str, Any]:
    """A fused hit as memory-core shows it: the memory, which legs found it, each leg's
    rank and score, and how relevant it reads."""
    record = stored[item.key].record
    view = _record_view(record.content, record.metadata)
    view.update(
        id=item.key,
        timestamp=record.timestamp,
        sessionId=record.metadata.get("session_id"),
        agent=record.metadata.get("agent"),
        importance=record.importance,
        tags=list(record.tags),
        legs=item.legs,
        source="vector" if item.vector_rank is not None else "lexical",
        relevance=round(item.relevance, 4),
        score=round(score, 6),
        lexicalRank=item.lexical_rank,
        bm25=None if item.lexical_score is None else round(item.lexical_score, 4),
        vectorRank=item.vector_rank,
        distance=item.distance,
    )
    return view


def _parse_cursor(before: Mapping[str, str] | str | None) -> tuple[str, str] | None:
    if before is None or before == "":
        return None
    if isinstance(before, str):
        ts, _, key = before.partition("|")
        return (ts, key or "\uffff")
    return (str(before["timestamp"]), str(before.get("id") or "\uffff"))


def _record_view(content: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    turn = split_turn(content, metadata.get("turn")) if metadata.get("kind") == "turn" else None
    if turn is not None:
        return {"kind": "turn", **turn}
    return {"kind": "memory", "content": content}


def _turn_view(row: RecentRow) -> dict[str, Any]:
    """A recent row as memory-core shows it: the memory, then where and whose it is."""
    view = _record_view(row.content, row.metadata)
    view.update(id=row.key, timestamp=row.timestamp, sessionId=row.session_id, agent=row.agent)
    view.update(importance=row.importance, tags=row.tags)
    return view
