"""A record's rows as plain values: what the write path inserts and what a read gives back.

Pure and free of SQLAlchemy, so the SQLite write path can build and read rows on the bare
driver (``store/sqlite_writes.py``) and ``outbox add`` need not import the database toolkit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from outbox.core.record import Record
from outbox.core.states import DeliveryOp, DeliveryState

# The anchor node every memory hangs from (neo.mjs's recency frontier).
FRONTIER_NODE_ID = "frontier"


@dataclass(frozen=True)
class StoredRecord:
    """A record as stored, with where it came from and where its markdown file is."""

    seq: int
    record: Record
    markdown_name: str
    origin: str
    created_at: float
    # When a forget emptied it (a tombstone: no content, tags, metadata or file).
    forgotten_at: float | None = None

    @property
    def forgotten(self) -> bool:
        return self.forgotten_at is not None


@dataclass(frozen=True)
class DeliveryRow:
    """One delivery as the mirrors and the operator see it (the lease columns left out)."""

    delivery_id: int
    key: str
    sink: str
    state: str
    attempts: int
    available_at: float
    last_error: str | None
    error_class: str | None
    sink_id: str | None
    mirror_pending: bool
    created_at: float
    delivered_at: float | None
    op: str = DeliveryOp.DELIVER.value  # DeliveryOp: "delete" once the record was forgotten


def row_to_record(row: Any) -> StoredRecord:
    """A ``records`` row as a StoredRecord."""
    return StoredRecord(
        seq=row.seq,
        record=Record(
            key=row.key,
            timestamp=row.ts,
            content=row.content,
            importance=row.importance,
            tags=tuple(row.tags or ()),
            metadata=dict(row.meta or {}),
            slug=row.slug,
        ),
        markdown_name=row.markdown_name,
        origin=row.origin,
        created_at=row.created_at,
        forgotten_at=row.forgotten_at,
    )


@dataclass(frozen=True)
class RecentRow:
    """A memory as recency reads it: its graph node joined with its record."""

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


@dataclass(frozen=True)
class NewRows:
    """Every row one record's insert writes, as column values (JSON columns unencoded)."""

    record: dict[str, Any]
    node: dict[str, Any]
    edge: dict[str, Any]
    deliveries: list[dict[str, Any]]


def new_rows(
    record: Record, *, sinks: Sequence[str], markdown_name: str, origin: str, now: float
) -> NewRows:
    """The rows of a new record: its node in neo.mjs's shape, keyed by the record key, the
    edge from the frontier anchor, and a pending delivery per sink."""
    meta = dict(record.metadata)
    session_id, agent = meta.get("session_id"), meta.get("agent")
    return NewRows(
        record={
            "key": record.key,
            "ts": record.timestamp,
            "content": record.content,
            "importance": record.importance,
            "tags": list(record.tags),
            "meta": meta,
            "slug": record.slug,
            "markdown_name": markdown_name,
            "origin": origin,
            "created_at": now,
            "forgotten_at": None,
            "redaction_pending": 0,
        },
        node={
            "id": record.key,
            "label": "AGENT_MEMORY",
            "session_id": str(session_id) if session_id is not None else None,
            "agent": str(agent) if agent is not None else None,
            "ts": record.timestamp,
            "properties": {
                "name": f"Memory: {record.timestamp}",
                "timestamp": record.timestamp,
                "importance": record.importance,
                "semanticVectorId": record.key,
            },
        },
        edge={
            "source": FRONTIER_NODE_ID,
            "target": record.key,
            "type": "SPAWNED_MEMORY",
            "weight": 0.8,
            "properties": {},
        },
        deliveries=[_delivery_row(record.key, sink, now) for sink in sinks],
    )


def _delivery_row(key: str, sink: str, now: float) -> dict[str, Any]:
    return {
        "record_key": key,
        "sink": sink,
        "state": DeliveryState.PENDING.value,
        "op": DeliveryOp.DELIVER.value,
        "attempts": 0,
        "available_at": now,
        "lease_owner": None,
        "lease_expires_at": None,
        "last_error": None,
        "error_class": None,
        "sink_id": None,
        "mirror_pending": 0,
        "created_at": now,
        "updated_at": now,
        "delivered_at": None,
    }
