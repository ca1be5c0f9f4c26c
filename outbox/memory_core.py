"""memory-core's surface on top of the outbox, named after neo.mjs's MemoryService.

``add_memory`` is the per-turn save that must never fail: it validates, commits through the
outbox and returns at once, with a ``visibility`` block saying what recall can see now. Recall
is read-after-write: ``query_recent_turns`` reads the graph the write just committed, and
``query_raw_memories`` shapes ``Outbox.recall``, which fuses a lexical leg over every record
(so a fresh memory is findable by its own words before any model has run) with Chroma's
semantic hits, each result saying which legs found it and how relevant it reads
(docs/memory-core.md). This module only validates writes and shapes answers: recall itself
lives in ``outbox/recall/``, and nothing here imports a sink or the store.

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
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from outbox.core.config import Settings
from outbox.core.receipt import Receipt
from outbox.core.record import check_content
from outbox.core.states import BuiltinSink, FallbackReason, ReceiptStatus

if TYPE_CHECKING:
    from outbox import RecallAnswer, RecallHit, RecentRow
    from outbox.api import Outbox

log = logging.getLogger(__name__)

PROMPT, THOUGHT, RESPONSE = "User Prompt: ", "\nAgent Thought: ", "\nAgent Response: "
VECTOR_SINK = BuiltinSink.CHROMA
MAX_LIMIT = 100
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
        if outbox is None:  # imported here: ``outbox search`` shapes answers without the store
            from outbox.api import Outbox

            outbox = Outbox.open(settings)
        self.outbox = outbox
        self.session_id = str(uuid.uuid4())  # the fallback session of this process

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
        if receipt.reason == FallbackReason.DB_MISSING:
            # The database lacks records its log names: not read (a deleted file would be
            # created anew), and the write waits for the rebuild, not for the next open.
            block["hint"] = (
                "The database lacks records its log names; the write is in the fallback file "
                "and joins recall after `outbox rebuild`."
            )
            return block
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
        limit = recent_limit(limit)
        cursor = parse_cursor(before)
        rows = self.outbox.recent_memories(limit, session_id=session_id, agent=agent, before=cursor)
        return recent_view(rows, limit)

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
        """Hybrid recall (``Outbox.recall``) in memory-core's shape: hits below
        ``min_relevance`` are left out, so a query nothing answers returns nothing."""
        answer = self.outbox.recall(
            query,
            limit=n_results,
            session_id=session_id,
            agent=agent,
            tags=tags,
            min_importance=min_importance,
            since=since,
            until=until,
            min_relevance=min_relevance,
        )
        return recall_view(answer)

    def forget(self, key: str) -> dict[str, Any]:
        """Remove a memory everywhere, by its key or a unique prefix (``Outbox.forget``)."""
        return self.outbox.forget(key).to_dict()

    def close(self) -> None:
        self.outbox.close()


def recall_view(answer: RecallAnswer) -> dict[str, Any]:
    """A recall as memory-core answers ``query_raw_memories`` (and ``outbox search --json``
    prints it): the query, the hits, the floor they were held to, and why the vector leg
    was missing, if it was."""
    results = [_hit_view(hit) for hit in answer.hits]
    shaped: dict[str, Any] = {"query": answer.query, "count": len(results), "results": results}
    shaped["minRelevance"] = answer.min_relevance
    if answer.degraded:
        shaped["degraded"] = answer.degraded
    return shaped


def _hit_view(hit: RecallHit) -> dict[str, Any]:
    """A recalled memory as memory-core shows it: the memory, which legs found it, each
    leg's rank and score, and how relevant it reads."""
    view = record_view(hit.content, hit.metadata)
    view.update(
        id=hit.key,
        timestamp=hit.timestamp,
        sessionId=hit.session_id,
        agent=hit.agent,
        importance=hit.importance,
        tags=list(hit.tags),
        legs=list(hit.legs),
        source=hit.source,
        relevance=round(hit.relevance, 4),
        score=round(hit.score, 6),
        lexicalRank=hit.lexical_rank,
        bm25=None if hit.bm25 is None else round(hit.bm25, 4),
        vectorRank=hit.vector_rank,
        distance=hit.distance,
    )
    return view


def recent_limit(limit: int) -> int:
    """How many recent memories one page holds: what was asked, within 1..MAX_LIMIT."""
    return max(1, min(int(limit), MAX_LIMIT))


def parse_cursor(before: Mapping[str, str] | str | None) -> tuple[str, str] | None:
    """A page cursor (``nextCursor``, or ``timestamp|id`` as the command line prints it) as
    the (timestamp, key) recency pages by."""
    if before is None or before == "":
        return None
    if isinstance(before, str):
        ts, _, key = before.partition("|")
        return (ts, key or "\uffff")
    return (str(before["timestamp"]), str(before.get("id") or "\uffff"))


def recent_view(rows: Sequence[RecentRow], limit: int) -> dict[str, Any]:
    """A page of recent memories as memory-core answers ``query_recent_turns`` (and ``outbox
    recent --json`` prints it), with the cursor of the next page when this one is full."""
    turns = [_turn_view(row) for row in rows]
    next_cursor = (
        {"timestamp": rows[-1].timestamp, "id": rows[-1].key} if len(rows) == limit else None
    )
    return {"count": len(turns), "turns": turns, "nextCursor": next_cursor}


def record_view(content: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """A memory's text as memory-core shows it: a turn split into its three fields, any
    other memory as its content (the dashboard shows recall's hits the same way)."""
    turn = split_turn(content, metadata.get("turn")) if metadata.get("kind") == "turn" else None
    if turn is not None:
        return {"kind": "turn", **turn}
    return {"kind": "memory", "content": content}


def _turn_view(row: RecentRow) -> dict[str, Any]:
    """A recent row as memory-core shows it: the memory, then where and whose it is."""
    view = record_view(row.content, row.metadata)
    view.update(id=row.key, timestamp=row.timestamp, sessionId=row.session_id, agent=row.agent)
    view.update(importance=row.importance, tags=row.tags)
    return view
