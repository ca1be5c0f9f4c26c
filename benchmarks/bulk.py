"""Build big outboxes fast: the records ``Outbox.add`` would write, without the rest of a write.

A million ``add`` calls would take most of an hour and leave a million markdown files; the
scale benchmark only needs the database to hold that many records. So each record is built by
the library (``build_record``: the same key, timestamp and slug as ``add``) and inserted by
the storage's own insert (record, FTS entry, graph node, frontier edge, one delivery per
sink), ``chunk`` records per transaction, with ``synchronous=OFF`` while building and no
mirrors. The rows carry their own ``origin``, so the outbox's mirror repair (which works per
origin) leaves them alone.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event

from benchmarks.common import memory_text
from outbox import load_settings
from outbox.core.record import build_record
from outbox.core.slugs import markdown_filename
from outbox.store.engine import make_engine
from outbox.store.storage import Storage

BULK_ORIGIN = "bulk"


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
    engine = make_engine(load_settings(env={}, db_url=f"sqlite:///{db_path}", home=db_path.parent))
    # No fsync while building: after the library's own connection settings, which it runs first.
    event.listen(engine, "connect", _synchronous_off)
    records = Storage(engine).records
    base = time.time() - 3600.0  # due an hour ago: claimable at once
    try:
        for offset in range(0, count, chunk):
            with engine.begin() as conn:
                for number in range(start + offset, start + min(count, offset + chunk)):
                    instant = datetime.fromtimestamp(base + number * 1e-3, UTC)
                    record = build_record(memory_text(number, rng, size), timestamp=instant)
                    records.insert_record(
                        conn,
                        record,
                        sinks=sinks,
                        markdown_name=markdown_filename(record.timestamp, record.slug),
                        origin=BULK_ORIGIN,
                        now=base,
                    )
    finally:
        engine.dispose()
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return time.perf_counter() - began


def _synchronous_off(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.execute("PRAGMA synchronous = OFF")
