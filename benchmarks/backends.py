"""SQLite beside PostgreSQL on the two hot paths: ``Outbox.add`` and claim + settle.

    python benchmarks/backends.py [--pg-url postgresql+psycopg://user@host:port/db]
                                  [--adds 1000] [--rows 1000] [--batch 64] [--json]

The PostgreSQL URL defaults to ``OUTBOX_TEST_PG_URL``; without one only SQLite runs. The
script creates a scratch database on that server and drops it afterwards. ``add`` is the
whole durable write (validation, one transaction, JSONL and markdown mirrors), one record per
call, into a new database. Claim + settle leases ``--rows`` due rows ``--batch`` at a time and
marks each batch delivered, as the dispatcher does with a sink that answers at once.

The server's own durability settings (``fsync``, ``synchronous_commit``) are printed with the
figures: a server started with fsync off for tests is not a fair comparison with SQLite's
``synchronous=FULL``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from outbox import Outbox, Settings, load_settings
from outbox.core.record import build_record
from outbox.store.storage import Storage

SINK = "outbox.testing.sinks:NoopSink"


@contextlib.contextmanager
def scratch_postgres(server_url: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A new database on the server (dropped afterwards) and the server's durability settings."""
    base = make_url(server_url)
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    name = f"outbox_bench_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
            durability = {
                setting: str(conn.execute(text(f"SHOW {setting}")).scalar_one())
                for setting in ("fsync", "synchronous_commit", "server_version")
            }
        try:
            yield base.set(database=name).render_as_string(hide_password=False), durability
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def settings_for(db_url: str, folder: Path) -> Settings:
    return load_settings(
        env={}, db_url=db_url, home=folder / ".outbox", markdown_dir=folder / "md", sinks=SINK
    )


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))
    return ordered[index]


def bench_add(settings: Settings, count: int) -> dict[str, float]:
    """Latency of ``add`` one record at a time, in milliseconds."""
    with Outbox.open(settings) as outbox:
        outbox.add("warm-up: the first write pays for imports and connections")
        samples: list[float] = []
        for number in range(count):
            content = f"benchmark memory {number}: chose the backend by measuring it"
            started = time.perf_counter()
            outbox.add(content, tags=["bench"])
            samples.append((time.perf_counter() - started) * 1000.0)
    return {
        "calls": count,
        "median_ms": statistics.median(samples),
        "p99_ms": percentile(samples, 0.99),
        "max_ms": max(samples),
    }


def bench_claim_settle(settings: Settings, rows: int, batch: int) -> dict[str, float]:
    """Lease ``rows`` due rows ``batch`` at a time and settle each batch as delivered."""
    with Outbox.open(settings) as outbox:
        storage: Storage = outbox.storage
        now = time.time() - 1
        with storage.engine.begin() as conn:
            for number in range(rows):
                record = build_record(f"claim benchmark row {number}")
                storage.records.insert_record(
                    conn,
                    record,
                    sinks=(SINK,),
                    markdown_name=f"bench-{number}.md",
                    origin="bench",
                    now=now,
                )
        batches: list[float] = []
        done = 0
        started = time.perf_counter()
        while True:
            tick = time.perf_counter()
            claims = storage.deliveries.claim(SINK, "bench", batch, 60.0)
            if not claims:
                break
            delivered = [(claim.delivery_id, f"id-{claim.delivery_id}") for claim in claims]
            settled, _ = storage.deliveries.settle("bench", delivered, [])
            done += len(settled)
            batches.append((time.perf_counter() - tick) * 1000.0)
        elapsed = time.perf_counter() - started
    if done != rows:
        raise RuntimeError(f"settled {done} rows of {rows}")
    return {
        "rows": rows,
        "batch": batch,
        "total_s": elapsed,
        "rows_per_s": rows / elapsed,
        "batch_median_ms": statistics.median(batches),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg-url", default=os.environ.get("OUTBOX_TEST_PG_URL"))
    parser.add_argument("--adds", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="outbox-bench-") as folder:
        sqlite_add = f"sqlite:///{Path(folder) / 'add.db'}"
        sqlite_claim = f"sqlite:///{Path(folder) / 'claim.db'}"
        results["sqlite"] = {
            "add": bench_add(settings_for(sqlite_add, Path(folder) / "a"), args.adds),
            "claim_settle": bench_claim_settle(
                settings_for(sqlite_claim, Path(folder) / "c"), args.rows, args.batch
            ),
            "settings": {
                "synchronous": settings_for(sqlite_add, Path(folder)).synchronous,
                "journal_mode": "wal",
            },
        }
        if args.pg_url:
            with scratch_postgres(args.pg_url) as (url, durability):
                add = bench_add(settings_for(url, Path(folder) / "pa"), args.adds)
            with scratch_postgres(args.pg_url) as (url, _):
                claim = bench_claim_settle(
                    settings_for(url, Path(folder) / "pc"), args.rows, args.batch
                )
            results["postgresql"] = {"add": add, "claim_settle": claim, "settings": durability}

    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"add: {args.adds} calls, one record each (ms)")
    print(f"{'backend':<12}{'median':>10}{'p99':>10}{'max':>10}")
    for backend, result in results.items():
        add = result["add"]
        print(f"{backend:<12}{add['median_ms']:>10.2f}{add['p99_ms']:>10.2f}{add['max_ms']:>10.2f}")
    print(f"\nclaim + settle: {args.rows} rows in batches of {args.batch}")
    print(f"{'backend':<12}{'total s':>10}{'rows/s':>10}{'batch ms':>10}")
    for backend, result in results.items():
        claim = result["claim_settle"]
        print(
            f"{backend:<12}{claim['total_s']:>10.3f}{claim['rows_per_s']:>10.0f}"
            f"{claim['batch_median_ms']:>10.2f}"
        )
    print()
    for backend, result in results.items():
        print(f"{backend} settings: {result['settings']}")


if __name__ == "__main__":
    main()
