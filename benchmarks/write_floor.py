"""How close ``Outbox.add`` / ``add_many`` come to the floor: a bare ``sqlite3`` transaction.

The floor is one ``BEGIN IMMEDIATE`` ... ``COMMIT`` in WAL mode at ``synchronous=FULL`` that
inserts the rows a write must make (record, graph node, frontier edge, one delivery) into the
same schema, with none of the library around it: no validation, no SQLAlchemy, no mirrors.
Run: ``.venv/bin/python benchmarks/write_floor.py [--calls 2000] [--batch-calls 200]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from outbox import Outbox, load_settings
from outbox.keys import canonical_timestamp
from outbox.store import migrate
from outbox.store.engine import make_engine

SINK = "outbox.testing.sinks:NoopSink"  # never loaded by a write; one delivery row per record
FILLER = (
    "Decided to keep agent memory in an embedded SQLite outbox: the write commits locally and "
    "returns, a dispatcher delivers to Chroma and BrainLayer later with retries and leases. "
) * 4  # about 600 bytes, like a typical memory


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure(
    calls: int, warmup: int, first: Callable[[int], object], second: Callable[[int], object]
) -> tuple[list[float], list[float]]:
    """Microseconds per call of each, after ``warmup`` untimed calls. The two alternate call
    by call, so a busy machine slows both alike and the ratio stays meaningful."""
    for number in range(warmup):
        first(-1 - number)
        second(-1 - number)
    timings: tuple[list[float], list[float]] = ([], [])
    for number in range(calls):
        for call, into in ((first, timings[0]), (second, timings[1])):
            start = time.perf_counter_ns()
            call(number)
            into.append((time.perf_counter_ns() - start) / 1000)
    return timings


def bare_rows(number: int, tag: str) -> tuple[tuple[object, ...], ...]:
    content = f"{tag} {number} {FILLER}"
    ts = canonical_timestamp()
    key = hashlib.sha256(content.encode() + b"\n" + ts.encode()).hexdigest()
    now = time.time()
    return (
        (key, ts, content, 5, "[]", "{}", "slug", f"2026-11-29-{key[:8]}.md", "bench", now),
        (key, "AGENT_MEMORY", ts, json.dumps({"timestamp": ts, "semanticVectorId": key})),
        (key,),
        (key, SINK, now, now, now),
    )


def bare_writer(path: Path, tag: str, per_call: int) -> Callable[[int], object]:
    """A plain sqlite3 connection doing the same inserts, one transaction per call."""
    settings = load_settings(env={}, db_url=f"sqlite:///{path}", home=path.parent)
    engine = make_engine(settings)
    migrate.upgrade(engine)  # the same tables and indexes as the library's database
    engine.dispose()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")

    def call(number: int) -> None:
        batch = [bare_rows(number * per_call + item, tag) for item in range(per_call)]
        conn.execute("BEGIN IMMEDIATE")
        for record, node, edge, delivery in batch:
            conn.execute(
                "INSERT INTO records (key, ts, content, importance, tags, meta, slug,"
                " markdown_name, origin, created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                record,
            )
            conn.execute(
                "INSERT INTO graph_nodes (id, label, ts, properties) VALUES (?,?,?,?)", node
            )
            conn.execute(
                "INSERT INTO graph_edges (source, target, type, weight, properties)"
                " VALUES ('frontier', ?, 'SPAWNED_MEMORY', 0.8, '{}')",
                edge,
            )
            conn.execute(
                "INSERT INTO deliveries (record_key, sink, state, attempts, available_at,"
                " mirror_pending, created_at, updated_at) VALUES (?,?,'pending',0,?,0,?,?)",
                delivery,
            )
        conn.execute("COMMIT")

    return call


def summary(label: str, timings: list[float], per: int) -> tuple[float, float]:
    median = statistics.median(timings) / per
    p99 = percentile(timings, 0.99) / per
    print(f"  {label:<34} median {median:8.1f} µs   p99 {p99:8.1f} µs")
    return median, p99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="single-record calls")
    parser.add_argument("--batch-calls", type=int, default=200, help="add_many calls")
    parser.add_argument("--batch", type=int, default=100, help="records per add_many call")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="write-floor-") as tmp:
        root = Path(tmp)
        settings = load_settings(
            env={}, home=root / "outbox", markdown_dir=root / "md", sinks=SINK, synchronous="FULL"
        )
        ob = Outbox.open(settings)

        def add_one(number: int) -> None:
            ob.add(f"single {number} {FILLER}", tags=["decision", "storage"], importance=7)

        def add_batch(number: int) -> None:
            ob.add_many(
                [
                    {"content": f"batch {number}-{item} {FILLER}", "tags": ["decision"]}
                    for item in range(args.batch)
                ]
            )

        print(f"one record per call, {args.calls} calls, synchronous=FULL")
        lib_t, bare_t = measure(
            args.calls, 50, add_one, bare_writer(root / "bare1.db", "single", 1)
        )
        lib = summary("Outbox.add", lib_t, 1)
        bare = summary("bare sqlite3 (4 rows, BEGIN IMMEDIATE)", bare_t, 1)
        print(f"  ratio: median {lib[0] / bare[0]:.2f}x   p99 {lib[1] / bare[1]:.2f}x")

        print(f"{args.batch} records per call, {args.batch_calls} calls, per record")
        lib_t, bare_t = measure(
            args.batch_calls, 5, add_batch, bare_writer(root / "bare100.db", "batch", args.batch)
        )
        lib = summary("Outbox.add_many", lib_t, args.batch)
        bare = summary("bare sqlite3 (4 rows per record)", bare_t, args.batch)
        print(f"  ratio: median {lib[0] / bare[0]:.2f}x   p99 {lib[1] / bare[1]:.2f}x")
        ob.close()


if __name__ == "__main__":
    main()
