"""Tables, in portable SQLAlchemy types, so the same schema runs on SQLite and PostgreSQL.

``records`` holds each memory once; ``graph_nodes``/``graph_edges`` are the recency graph
(an AGENT_MEMORY node per memory, linked from the ``frontier`` anchor); ``deliveries`` is the
outbox proper, one row per (record, sink) with its own state, attempts and lease.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

from outbox.store.revision import SCHEMA_REVISION as SCHEMA_REVISION
from outbox.store.rows import FRONTIER_NODE_ID as FRONTIER_NODE_ID

metadata = MetaData()

# INTEGER PRIMARY KEY on SQLite (the rowid alias), BIGINT identity on PostgreSQL.
SeqType = BigInteger().with_variant(Integer(), "sqlite")

records = Table(
    "records",
    metadata,
    Column("seq", SeqType, primary_key=True, autoincrement=True),
    Column("key", String(64), nullable=False, unique=True),
    Column("ts", String(32), nullable=False),
    Column("content", Text, nullable=False),
    Column("importance", Integer, nullable=False),
    Column("tags", JSON, nullable=False),
    Column("meta", JSON, nullable=False),
    Column("slug", String(128), nullable=False),
    # A file name inside the markdown folder, or an absolute path for an adopted legacy file.
    Column("markdown_name", String(1024), nullable=False),
    Column("origin", String(255), nullable=False),
    Column("created_at", Float, nullable=False),
    # Set by a forget, which also empties content, tags, metadata and slug: the row stays as
    # a tombstone so the key is never written again and the log's accepted line is explained.
    Column("forgotten_at", Float),
    # A forget's unfinished work: 1 until its mirrors are done (log redacted, file deleted),
    # then 2 until the database's own copies are purged (search index merged, WAL truncated).
    Column("redaction_pending", Integer, nullable=False, default=0, server_default="0"),
)
Index("ix_records_origin_seq", records.c.origin, records.c.seq)
Index(
    "ix_records_redaction_pending",
    records.c.seq,
    sqlite_where=records.c.redaction_pending > 0,
    postgresql_where=records.c.redaction_pending > 0,
)
Index("ix_records_markdown_name", records.c.markdown_name)

graph_nodes = Table(
    "graph_nodes",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("label", String(64), nullable=False),
    Column("session_id", String(255)),
    Column("agent", String(255)),
    Column("ts", String(32)),
    Column("properties", JSON, nullable=False),
)
Index("ix_graph_nodes_label_ts", graph_nodes.c.label, graph_nodes.c.ts, graph_nodes.c.id)
Index("ix_graph_nodes_session_ts", graph_nodes.c.session_id, graph_nodes.c.ts)

graph_edges = Table(
    "graph_edges",
    metadata,
    Column("id", SeqType, primary_key=True, autoincrement=True),
    Column("source", String(64), ForeignKey("graph_nodes.id", ondelete="CASCADE"), nullable=False),
    Column("target", String(64), ForeignKey("graph_nodes.id", ondelete="CASCADE"), nullable=False),
    Column("type", String(64), nullable=False),
    Column("weight", Float, nullable=False),
    Column("properties", JSON, nullable=False),
    # Led by the target: a memory's edge comes from the frontier, so only this key is ordered
    # by the memory's hash, and the source's index only appends (migration 0009).
    UniqueConstraint("target", "source", "type", name="uq_graph_edges_target_source_type"),
)
Index("ix_graph_edges_source", graph_edges.c.source)

deliveries = Table(
    "deliveries",
    metadata,
    Column("id", SeqType, primary_key=True, autoincrement=True),
    Column("record_key", String(64), ForeignKey("records.key", ondelete="CASCADE"), nullable=False),
    Column("sink", String(255), nullable=False),
    # One of outbox.core.states.DeliveryState.
    Column("state", String(16), nullable=False),
    # One of outbox.core.states.DeliveryOp: a forget turns the row into a delete for its sink.
    Column("op", String(8), nullable=False, default="deliver", server_default="deliver"),
    Column("attempts", Integer, nullable=False, default=0),
    # When the row may next be claimed: the retry time while pending, the lease expiry while
    # leased. One column keeps "what is due" a single index range scan.
    Column("available_at", Float, nullable=False),
    Column("lease_owner", String(255)),
    Column("lease_expires_at", Float),
    Column("last_error", Text),
    Column("error_class", String(32)),
    Column("sink_id", String(255)),
    Column("mirror_pending", Integer, nullable=False, default=0),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("delivered_at", Float),
    UniqueConstraint("record_key", "sink", name="uq_deliveries_record_sink"),
)
Index("ix_deliveries_due", deliveries.c.sink, deliveries.c.state, deliveries.c.available_at)
# The oldest undelivered row per sink in one index step (add_memory's visibility block).
Index(
    "ix_deliveries_sink_state_created",
    deliveries.c.sink,
    deliveries.c.state,
    deliveries.c.created_at,
)
# Partial: only the few rows whose mirror update is outstanding are indexed.
Index(
    "ix_deliveries_mirror_pending",
    deliveries.c.id,
    sqlite_where=deliveries.c.mirror_pending == 1,
    postgresql_where=deliveries.c.mirror_pending == 1,
)

# Where the mirror repair got to, per machine that keeps mirrors (several may share a database).
mirror_state = Table(
    "mirror_state",
    metadata,
    Column("mirror_id", String(255), primary_key=True),
    Column("record_seq", BigInteger, nullable=False),
    Column("jsonl_offset", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=False),
    # SHA-256 of the line ending at jsonl_offset: tells a log that lost its tail and grew
    # back to the same length from the one the watermark was taken on.
    Column("line_hash", String(64)),
)

# Created by migration 0002 outside the metadata (an FTS5 virtual table and its shadow tables
# on SQLite, an expression index on PostgreSQL); schema comparison skips these names.
SEARCH_INDEX_NAMES = ("records_fts", "ix_records_content_fts")


def is_search_index(name: str | None) -> bool:
    return bool(name) and str(name).startswith(SEARCH_INDEX_NAMES)


# Where each machine's mirrors live (OUTBOX_JSONL_PATH, OUTBOX_MARKDOWN_DIR), recorded by the
# first open that finds none, so a later open pointing elsewhere is refused (migration 0006).
store_locations = Table(
    "store_locations",
    metadata,
    Column("mirror_id", String(255), primary_key=True),
    Column("jsonl_path", Text, nullable=False),
    Column("markdown_dir", Text, nullable=False),
    Column("recorded_at", Float, nullable=False),
)

# One row per dispatcher daemon (``outbox run``): who drains, from where, how fast, and whether
# it still beats. A row whose beat is older than its own ``gone_after`` is a dispatcher that
# died without stopping (migration 0007).
dispatcher_heartbeats = Table(
    "dispatcher_heartbeats",
    metadata,
    Column("owner", String(255), primary_key=True),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("sinks", JSON, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("beat_at", Float, nullable=False),
    Column("gone_after", Float, nullable=False),
    Column("last_batch_at", Float),
    Column("delivered", BigInteger, nullable=False),
    Column("failed", BigInteger, nullable=False),
    Column("records_per_second", Float, nullable=False),
    Column("stopped_at", Float),
)
