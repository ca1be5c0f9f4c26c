"""Build big outboxes fast: the rows ``Outbox.add`` would write, inserted in bulk.

A million ``add`` calls would take most of an hour and leave a million markdown files; the
scale benchmark only needs the database to hold that many rows. So each record gets exactly
the rows a write makes (record, FTS entry, graph node, frontier edge, one delivery per sink,
same columns, same JSON encodings, same key formula) through ``executemany`` in transactions
of ``chunk`` records, with ``synchronous=OFF`` while building. The rows carry their own
``origin``, so the outbox's mirror repair (which works per origin) leaves them alone.
"""

from __future__ import annotations

import hashlib
import json
import random
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.common import memory_text
from outbox.keys import format_instant
from outbox.slugs import derive_slug, markdown_filename

BULK_ORIGIN = "bulk"

_RECORD = (
    "INSERT INTO records (key, ts, content, importance, tags, meta, slug, markdown_name,"
    " origin, created_at) VALUES (?,?,?,?,?,?,?,?,?,?)"
)
_FTS = "INSERT INTO records_fts (rowid, content) SELECT seq, content FROM records WHERE seq > ?"
_NODE = (
    "INSERT INTO graph_nodes (id, label, session_id, agent, ts, properties)"
    " VALUES (?, 'AGENT_MEMORY', NULL, NULL, ?, ?)"
)
_EDGE = (
    "INSERT INTO graph_edges (source, target, type, weight, properties)"
    " VALUES ('frontier', ?, 'SPAWNED_MEMORY', 0.8, '{}')"
)
_DELIVERY = (
    "INSERT INTO deliveries (record_key, sink, state, attempts, available_at, mirror_pending,"
    " created_at, updated_at) VALUES (?, ?, 'pending', 0, ?, 0, ?, ?)"
)


def bulk_insert(
    db_path: Path,
    count: int,
    *,
    sinks: tuple[str, ...],
    start: int = 0,
    chunk: int = 20_000,
    seed: int = 7,
    size: int = 600,
) -> float:
    """Append ``count`` pending records (numbered from ``start``); returns seconds taken.

    The database must already have the outbox schema (open an ``Outbox`` on it first).
    """
    rng = random.Random(seed + start)
    began = time.perf_counter()
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=OFF")
        base = time.time() - 3600.0  # due an hour ago: claimable at once
        for offset in range(0, count, chunk):
            rows = []
            for number in range(start + offset, start + min(count, offset + chunk)):
                content = memory_text(number, rng, size)
                ts = format_instant(datetime.fromtimestamp(base + number * 1e-3, UTC))
                key = hashlib.sha256(content.encode() + b"\n" + ts.encode()).hexdigest()
                rows.append((content, ts, key))
            conn.execute("BEGIN IMMEDIATE")
            (last_seq,) = conn.execute("SELECT coalesce(max(seq), 0) FROM records").fetchone()
            record_rows, node_rows, edge_rows, delivery_rows = [], [], [], []
            for content, ts, key in rows:
                slug = derive_slug(content)
                now = base
                record_rows.append(
                    (
                        key,
                        ts,
                        content,
                        5,
                        "[]",
                        "{}",
                        slug,
                        markdown_filename(ts, slug),
                        BULK_ORIGIN,
                        now,
                    )
                )
                properties = {
                    "name": f"Memory: {ts}",
                    "timestamp": ts,
                    "importance": 5,
                    "semanticVectorId": key,
                }
                node_rows.append((key, ts, json.dumps(properties)))
                edge_rows.append((key,))
                delivery_rows.extend((key, sink, now, now, now) for sink in sinks)
            conn.executemany(_RECORD, record_rows)
            conn.execute(_FTS, (last_seq,))
            conn.executemany(_NODE, node_rows)
            conn.executemany(_EDGE, edge_rows)
            conn.executemany(_DELIVERY, delivery_rows)
            conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    return time.perf_counter() - began
