"""The write path beside its floor and its rivals, at one ``synchronous`` level.

- **floor**: a bare ``sqlite3`` connection on a database migrated to the outbox schema (same
  tables, indexes, FTS5 table), WAL, ``BEGIN IMMEDIATE``, inserting the rows a write makes
  (record, FTS entry, graph node, frontier edge, one delivery), ``COMMIT``. Only the key and
  timestamp are computed; nothing else of the library runs.
- **mission floor**: the mission's own floor, a bare ``sqlite3`` connection on a database of
  two small tables, WAL, ``BEGIN IMMEDIATE``, one node row and one outbox row, ``COMMIT``.
- **add**: ``Outbox.add``, one record per call (its JSONL line and markdown file follow on the
  mirror writer's thread; the time from commit to written mirrors is reported as the lag);
  **add_many**: 100 records per call, per record.
- **persist-queue** ``SQLiteAckQueue.put`` (auto-commit) and its consumer ``get`` + ``ack``;
  **litequeue** ``put`` and ``pop`` + ``done``. Both get ``PRAGMA synchronous`` set on their
  own connection to the level under test (persist-queue sets none and runs at SQLite's
  default, litequeue sets NORMAL), read back and reported, so every contender fsyncs alike.
- The outbox's consumer side: ``storage.deliveries.claim`` + ``settle`` in batches of 64.

Contenders run in alternating rounds (see ``common.alternate``).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import litequeue
import persistqueue

from benchmarks.common import (
    NOOP_SINK,
    alternate,
    bench_settings,
    lag_summary,
    memories,
    open_outbox,
    quiet_gc,
    summarize,
    time_calls,
)
from outbox.core.keys import canonical_timestamp
from outbox.store.sqlite_writes import sqlite_path

_FLOOR_ROWS = (
    (
        "INSERT INTO records (key, ts, content, importance, tags, meta, slug, markdown_name,"
        " origin, created_at) VALUES (?,?,?,?,?,?,?,?,?,?) RETURNING seq"
    ),
    "INSERT INTO records_fts (rowid, content) VALUES (?, ?)",
    (
        "INSERT INTO graph_nodes (id, label, session_id, agent, ts, properties)"
        " VALUES (?, 'AGENT_MEMORY', NULL, NULL, ?, ?)"
    ),
    (
        "INSERT INTO graph_edges (source, target, type, weight, properties)"
        " VALUES ('frontier', ?, 'SPAWNED_MEMORY', 0.8, '{}')"
    ),
    (
        "INSERT INTO deliveries (record_key, sink, state, attempts, available_at,"
        " mirror_pending, created_at, updated_at) VALUES (?, ?, 'pending', 0, ?, 0, ?, ?)"
    ),
)

TAGS = ["decision", "storage"]
CLAIM_BATCH = 64

_MISSION_SCHEMA = (
    "CREATE TABLE node (id TEXT PRIMARY KEY, label TEXT NOT NULL, ts TEXT NOT NULL,"
    " properties TEXT NOT NULL)",
    "CREATE TABLE outbox (id INTEGER PRIMARY KEY, node_id TEXT NOT NULL, sink TEXT NOT NULL,"
    " state TEXT NOT NULL, created_at REAL NOT NULL)",
)
# The outbox's own tokenizer (stemming for recall): the same work, not a cheaper index.
_FTS_SCHEMA = (
    "CREATE VIRTUAL TABLE node_fts USING fts5("
    "content, tokenize='porter unicode61 remove_diacritics 2')"
)


def mission_floor_writer(folder: Path, synchronous: str, texts: list[str]) -> Callable[[int], None]:
    """The mission's floor: one node row and one outbox row in one WAL transaction."""
    return _bare_floor(folder / "mission.db", synchronous, texts, fts=False)


def same_work_floor(folder: Path, synchronous: str, texts: list[str]) -> Callable[[int], None]:
    """Issue 24's floor: a node row, an outbox row and an FTS5 entry, one transaction."""
    return _bare_floor(folder / "same-work.db", synchronous, texts, fts=True)


def _bare_floor(
    path: Path, synchronous: str, texts: list[str], *, fts: bool
) -> Callable[[int], None]:
    """A node row and an outbox row in one WAL transaction, and with ``fts`` the content's
    FTS5 entry (keyed by the outbox row's id, as the outbox keys its own by ``seq``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    for statement in (*_MISSION_SCHEMA, *((_FTS_SCHEMA,) if fts else ())):
        conn.execute(statement)
    outbox_row = (
        "INSERT INTO outbox (node_id, sink, state, created_at) VALUES (?, ?, 'pending', ?)"
        + (" RETURNING id" if fts else "")
    )

    def call(number: int) -> None:
        content = f"{number} {texts[number % len(texts)]}"
        ts = canonical_timestamp()
        key = hashlib.sha256(content.encode() + b"\n" + ts.encode()).hexdigest()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO node (id, label, ts, properties) VALUES (?, 'AGENT_MEMORY', ?, ?)",
            (key, ts, json.dumps({"timestamp": ts, "importance": 7})),
        )
        inserted = conn.execute(outbox_row, (key, NOOP_SINK, time.time()))
        if fts:
            (rowid,) = inserted.fetchone()
            conn.execute("INSERT INTO node_fts (rowid, content) VALUES (?, ?)", (rowid, content))
        conn.execute("COMMIT")

    return call


def floor_writer(
    folder: Path, synchronous: str, texts: list[str], per_call: int
) -> Callable[[int], None]:
    """The bare-sqlite3 floor: the outbox's rows on the outbox's schema, nothing else."""
    settings = bench_settings(folder, synchronous=synchronous)
    open_outbox(settings).close()  # migrate: the very same schema
    path = sqlite_path(settings.db_url)
    assert path is not None
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA foreign_keys=ON")
    record_sql, fts_sql, node_sql, edge_sql, delivery_sql = _FLOOR_ROWS

    def call(number: int) -> None:
        conn.execute("BEGIN IMMEDIATE")
        for item in range(number * per_call, (number + 1) * per_call):
            content = f"{item} {texts[item % len(texts)]}"
            ts = canonical_timestamp()
            key = hashlib.sha256(content.encode() + b"\n" + ts.encode()).hexdigest()
            now = time.time()
            (seq,) = conn.execute(
                record_sql,
                (
                    key,
                    ts,
                    content,
                    7,
                    '["decision","storage"]',
                    "{}",
                    key[:16],
                    f"{ts[:10]}-{key[:16]}.md",
                    "floor",
                    now,
                ),
            ).fetchone()
            conn.execute(fts_sql, (seq, content))
            properties = json.dumps({"timestamp": ts, "importance": 7, "semanticVectorId": key})
            conn.execute(node_sql, (key, ts, properties))
            conn.execute(edge_sql, (key,))
            conn.execute(delivery_sql, (key, NOOP_SINK, now, now, now))
        conn.execute("COMMIT")

    return call


def payload(content: str) -> dict[str, Any]:
    """What a queue carries for one memory: the same fields the outbox stores."""
    return {
        "content": content,
        "timestamp": canonical_timestamp(),
        "importance": 7,
        "tags": TAGS,
    }


def run(
    folder: Path, synchronous: str, calls: int, batch_calls: int, rounds: int
) -> dict[str, Any]:
    """Every contender at ``synchronous``; returns summaries and the pragmas read back."""
    texts = memories(500, seed=11)
    outbox = open_outbox(bench_settings(folder / "add", synchronous=synchronous))
    batch_outbox = open_outbox(bench_settings(folder / "add_many", synchronous=synchronous))

    pq = persistqueue.SQLiteAckQueue(str(folder / "persist-queue"), auto_commit=True)
    pq._putter.execute(f"PRAGMA synchronous={synchronous}")  # its one connection
    lq = litequeue.LiteQueue(str(folder / "litequeue.db"))
    lq.conn.execute(f"PRAGMA synchronous={synchronous}")
    levels = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
    pragmas = {
        "persist-queue": levels[pq._putter.execute("PRAGMA synchronous").fetchone()[0]],
        "litequeue": levels[lq.conn.execute("PRAGMA synchronous").fetchone()[0]],
    }
    with outbox.engine.connect() as conn:
        pragmas["outbox"] = levels[conn.exec_driver_sql("PRAGMA synchronous").scalar_one()]

    def add(number: int) -> None:
        outbox.add(f"{number} {texts[number % len(texts)]}", tags=TAGS, importance=7)

    def pq_put(number: int) -> None:
        pq.put(payload(f"{number} {texts[number % len(texts)]}"))

    def lq_put(number: int) -> None:
        lq.put(json.dumps(payload(f"{number} {texts[number % len(texts)]}")))

    singles = alternate(
        {
            "floor": floor_writer(folder / "floor", synchronous, texts, 1),
            "mission floor": mission_floor_writer(folder / "mission", synchronous, texts),
            "same-work floor": same_work_floor(folder / "same-work", synchronous, texts),
            "add": add,
            "persist-queue put": pq_put,
            "litequeue put": lq_put,
        },
        calls,
        rounds,
    )
    lags = outbox.mirrors.writer.lags()

    per_batch = 100

    def add_many(number: int) -> None:
        batch_outbox.add_many(
            {"content": f"{number}-{item} {texts[(number + item) % len(texts)]}", "tags": TAGS}
            for item in range(per_batch)
        )

    batches = alternate(
        {
            "floor batch": floor_writer(folder / "floor-batch", synchronous, texts, per_batch),
            "add_many": add_many,
        },
        batch_calls,
        max(1, rounds // 2),
    )

    results: dict[str, Any] = {
        name: summarize(samples, wall) for name, (samples, wall) in singles.items()
    }
    for name, (samples, wall) in batches.items():
        results[name] = summarize(samples, wall, per_call=per_batch)

    # Consumers: drain what the producers wrote.
    def pq_ack(_number: int) -> None:
        item = pq.get(block=False, raw=True)
        pq.ack(id=item["pqid"])

    def lq_done(_number: int) -> None:
        message = lq.pop()
        lq.done(message.message_id)

    produced = outbox.storage.records.count_records()
    with quiet_gc():
        results["persist-queue get+ack"] = summarize(*time_calls(pq_ack, produced))
        results["litequeue pop+done"] = summarize(*time_calls(lq_done, produced))
    results["claim+settle (64)"] = _claim_settle(outbox, produced)
    results["pragmas"] = pragmas
    results["mirror_lag"] = lag_summary(lags)
    outbox.close()
    batch_outbox.close()
    pq.close()
    lq.conn.close()
    return results


def _claim_settle(outbox: Any, rows: int) -> dict[str, float]:
    """The outbox's consumer: lease 64 due rows, mark them delivered, per record."""
    storage = outbox.storage
    samples: list[float] = []
    sizes: list[int] = []
    with quiet_gc():
        began = time.perf_counter()
        while True:
            tick = time.perf_counter()
            claims = storage.deliveries.claim(NOOP_SINK, "bench", CLAIM_BATCH, 60.0)
            if not claims:
                break
            storage.deliveries.settle(
                "bench", [(claim.delivery_id, claim.key) for claim in claims], []
            )
            samples.append(time.perf_counter() - tick)
            sizes.append(len(claims))
        wall = time.perf_counter() - began
    if sum(sizes) != rows:
        raise RuntimeError(f"claimed {sum(sizes)} rows, expected {rows}")
    per_item = [sample / size for sample, size in zip(samples, sizes, strict=True)]
    summary = summarize(per_item, wall)
    summary["items"] = rows
    summary["per_s"] = rows / wall
    return summary


def breakdown(folder: Path, synchronous: str, calls: int) -> dict[str, float]:
    """Where one ``add`` spends its time: medians per step, in µs, on a separate outbox.

    The steps are timed by wrapping the library's own functions on this one instance (a
    microsecond or so each); "transaction" is what ``Writer.commit`` spends outside the
    caller's rendering, the statements and the hand-over to the mirror writer: the mirror
    lock, BEGIN IMMEDIATE and the COMMIT with its fsync. The mirror writer's own steps run on
    its thread, off the caller's clock, and are listed after the total.
    """
    from outbox.mirror import markdown

    outbox = open_outbox(bench_settings(folder, synchronous=synchronous))
    texts = memories(500, seed=13)
    spent: dict[str, list[float]] = {}

    def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tick = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - tick)

        return wrapper

    writer = outbox.writer
    mirrors = writer.mirrors
    outbox.prepare = timed("validate + key + slug", outbox.prepare)  # type: ignore[method-assign]
    mirrors.render_new = timed("render the file (mirror thread)", mirrors.render_new)  # type: ignore[method-assign]
    writer.insert_group = timed("lookup + inserts", writer.insert_group)  # type: ignore[method-assign]
    mirrors.defer = timed("queue for the mirror writer", mirrors.defer)  # type: ignore[method-assign]
    writer.commit = timed("commit", writer.commit)  # type: ignore[method-assign]
    mirrors.jsonl.append = timed("JSONL line (mirror thread)", mirrors.jsonl.append)  # type: ignore[method-assign]
    original_write_new = markdown.write_new
    markdown.write_new = timed("create the file (mirror thread)", original_write_new)  # type: ignore[assignment]
    try:

        def add(number: int) -> None:
            outbox.add(f"{number} {texts[number % len(texts)]}", tags=TAGS, importance=7)

        time_calls(add, 20, start=-20)
        outbox.wait_mirrored()
        spent.clear()
        with quiet_gc():
            samples, _ = time_calls(add, calls)
        outbox.wait_mirrored()
    finally:
        markdown.write_new = original_write_new  # type: ignore[assignment]
        outbox.close()
    median = {name: statistics.median(values) * 1e6 for name, values in spent.items()}
    total = statistics.median(samples) * 1e6
    caller = ("lookup + inserts", "queue for the mirror writer")
    steps = {
        "validate + key + slug": median["validate + key + slug"],
        **{name: median[name] for name in caller},
        "transaction (lock, BEGIN, COMMIT + fsync)": median["commit"]
        - sum(median[name] for name in caller),
    }
    steps["rest (receipt, bookkeeping)"] = total - sum(steps.values())
    steps["add (total)"] = total
    for name in (
        "render the file (mirror thread)",
        "JSONL line (mirror thread)",
        "create the file (mirror thread)",
    ):
        steps[name] = median[name]
    return steps
