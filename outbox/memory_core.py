"""memory-core's surface on top of the outbox, named after neo.mjs's MemoryService.

``add_memory`` is the per-turn save that must never fail: it validates, commits through the
outbox and returns at once, with a ``visibility`` block saying what recall can see now. Recall
is read-after-write: ``query_recent_turns`` reads the graph the write just committed, and
``query_raw_memories`` merges Chroma's semantic hits with a lexical overlay of the records not
embedded yet, so a fresh memory is findable by its own words before any model has run.

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
from typing import TYPE_CHECKING, Any

from outbox.api import Outbox
from outbox.config import Settings
from outbox.receipt import Receipt
from outbox.record import check_content
from outbox.states import BuiltinSink, ReceiptStatus

if TYPE_CHECKING:
    from outbox import RecentRow

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
    ) -> Receipt:
        """A plain brain_store-style memory (no turn structure). ``memory_type`` and
        ``project`` go under the metadata keys the BrainLayer sink reads them from."""
        meta = dict(metadata or {})
        if memory_type:
            meta[TYPE_KEY] = memory_type
        if project:
            meta[PROJECT_KEY] = project
        return self.outbox.add(content, importance=importance, tags=tags, metadata=meta or None)

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
        self, query: str, n_results: int = 10, session_id: str | None = None
    ) -> dict[str, Any]:
        """Chroma's semantic hits fused (RRF) with the lexical overlay of pending records."""
        if not isinstance(query, str) or not query.strip():
            from outbox.errors import ValidationError

            raise ValidationError("query", "is empty")
        n_results = max(1, min(int(n_results), MAX_LIMIT))
        vector_on = VECTOR_SINK in self.outbox.settings.sinks
        vector_ids: list[str] = []
        distances: dict[str, float] = {}
        degraded: str | None = None
        if vector_on:
            vector_ids, distances, degraded = self._semantic(query, n_results, session_id)
        pending = self.outbox.pending_matches(
            query,
            vector_sink=VECTOR_SINK if vector_on else None,
            limit=n_results,
            session_id=session_id,
        )
        pending_ids = [key for key, _score in pending]
        fused = self.outbox.fuse_rankings([vector_ids, pending_ids])[:n_results]
        results = self._result_views(fused, distances)
        answer: dict[str, Any] = {"query": query, "count": len(results), "results": results}
        if degraded:
            answer["degraded"] = degraded
        return answer

    def _semantic(
        self, query: str, n_results: int, session_id: str | None
    ) -> tuple[list[str], dict[str, float], str | None]:
        """(Chroma's ranking, each hit's distance, why it failed): an unreachable index
        degrades recall to the overlay instead of failing it."""
        where = {"session_id": session_id} if session_id else None
        try:
            hits = self._vector_index().search(query, n_results, where)
            ids = list(hits.ids)
            distances = dict(zip(hits.ids, hits.distances, strict=False))
        except Exception as exc:
            degraded = f"vector index unavailable ({exc.__class__.__name__})"
            log.warning("semantic leg of query_raw_memories failed: %s", degraded)
            return [], {}, degraded
        return ids, distances, None

    def _result_views(
        self, fused: list[tuple[str, float]], distances: dict[str, float]
    ) -> list[dict[str, Any]]:
        """Each fused key as a memory that says which leg found it; a key whose record is
        no longer in the outbox is left out."""
        stored = self.outbox.get_records(key for key, _ in fused)
        results = []
        for key, score in fused:
            item = stored.get(key)
            if item is None:
                continue
            view = _record_view(item.record.content, item.record.metadata)
            view.update(
                id=key,
                timestamp=item.record.timestamp,
                sessionId=item.record.metadata.get("session_id"),
                source="vector" if key in distances else "pending",
                score=round(score, 6),
            )
            if key in distances:
                view["distance"] = distances[key]
            results.append(view)
        return results

    def close(self) -> None:
        if self._vector is not None:
            self._vector.close()
        self.outbox.close()


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
