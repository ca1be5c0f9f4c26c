"""How long ``outbox rebuild`` takes to bring a lost or corrupt database back (issue 13's goal:
100,000 records in under a minute on this machine).

The store is made the way a user makes one: ``add_many`` through the library (records, JSONL
lines, markdown files), then a drain to the no-op sink, so most records have a ``delivered``
line and the rest stay pending. Then, for each case, the database is lost (file deleted) or
corrupted (its first pages overwritten), and the real command runs in a child process: the time
is that process's wall time. ``outbox verify`` must pass afterwards, and the counts must match
the store before the loss.

    python -m benchmarks.rebuild                 # 100,000 records
    python -m benchmarks.rebuild --count 10000   # a quick run
    python -m benchmarks.rebuild --pg-url postgresql+psycopg://user@host:port/db --count 20000

With ``--pg-url`` the store lives on PostgreSQL and "lost" means an empty new database (two
scratch databases are created on that server and dropped afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from benchmarks.common import bench_settings, memories, open_outbox, outbox_environ, write_result
from outbox import Settings

RESULTS = Path(__file__).with_name("results") / "rebuild.json"
CHUNK = 1000  # records per add_many call while building


def build_store(
    folder: Path, count: int, pending_share: float, db_url: str | None = None
) -> tuple[Settings, dict[str, Any]]:
    """A store of ``count`` records, all but ``pending_share`` of them delivered."""
    settings = replace(bench_settings(folder, synchronous="NORMAL"), batch_size=1000)
    if db_url:
        settings = replace(settings, db_url=db_url)
    texts = memories(count, seed=13)
    delivered = count - int(count * pending_share)
    began = time.perf_counter()
    with open_outbox(settings) as outbox:
        for start in range(0, delivered, CHUNK):
            outbox.add_many(texts[start : min(start + CHUNK, delivered)])
        outbox.drain(timeout=3600)
        for start in range(delivered, count, CHUNK):
            outbox.add_many(texts[start : min(start + CHUNK, count)])
        status = outbox.status()
        verified = outbox.verify()
    if not verified.ok:
        raise RuntimeError(f"the store did not verify before the loss: {verified.problems[:3]}")
    return settings, {
        "records": status["records"],
        "sinks": status["sinks"],
        "build_seconds": round(time.perf_counter() - began, 1),
        "jsonl_bytes": settings.jsonl_path.stat().st_size,
    }


def _run(settings: Settings, *args: str) -> tuple[float, dict[str, Any]]:
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "outbox", *args, "--json"],
        env=outbox_environ(settings),
        cwd=settings.home.parent,
        capture_output=True,
        check=False,
    )
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"outbox {args[0]} failed: {done.stderr.decode()[-500:]}")
    return seconds, json.loads(done.stdout)


def _lose(database: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)


def _corrupt(database: Path) -> None:
    with database.open("r+b") as handle:
        handle.write(os.urandom(8192))


def _states(sinks: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Each sink's row count per state (ages and last errors left out)."""
    names = ("pending", "leased", "delivered", "dead", "discarded")
    return {sink: {name: counts.get(name, 0) for name in names} for sink, counts in sinks.items()}


@contextmanager
def scratch_databases(server: str, count: int) -> Iterator[list[str]]:
    """``count`` new, empty databases on the PostgreSQL server, dropped afterwards."""
    admin = create_engine(make_url(server), isolation_level="AUTOCOMMIT")
    names = [f"outbox_bench_{uuid.uuid4().hex[:12]}" for _ in range(count)]
    try:
        with admin.connect() as conn:
            for name in names:
                conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE template0'))
        yield [
            make_url(server).set(database=name).render_as_string(hide_password=False)
            for name in names
        ]
    finally:
        with admin.connect() as conn:
            for name in names:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def measure(settings: Settings, before: dict[str, Any], case: str) -> dict[str, Any]:
    database = settings.home / "outbox.db"
    if case == "lost":
        _lose(database)
    elif case == "corrupt":
        _corrupt(database)
    seconds, report = _run(settings, "rebuild")
    verify_seconds, verified = _run(settings, "verify")
    _, status = _run(settings, "status")
    if not verified["ok"] or status["records"] != before["records"]:
        raise RuntimeError(f"{case}: rebuilt store differs ({verified['problems'][:3]})")
    if _states(status["sinks"]) != _states(before["sinks"]):
        raise RuntimeError(f"{case}: delivery counts differ: {status['sinks']}")
    for path in report["moved_aside"]:  # keep the scratch folder small for the next case
        Path(path).unlink()
    return {
        "case": case,
        "records": report["restored"],
        "delivered": report["delivered"],
        "pending": report["pending"],
        "rebuild_seconds": round(seconds, 2),
        "records_per_second": round(report["restored"] / seconds),
        "verify_seconds": round(verify_seconds, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--pending-share", type=float, default=0.2)
    parser.add_argument("--keep", action="store_true", help="keep the scratch store")
    parser.add_argument("--pg-url", help="a PostgreSQL server to run the store on instead")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="outbox-rebuild-bench-"))
    try:
        if args.pg_url:
            with scratch_databases(args.pg_url, 2) as (first, empty):
                settings, before = build_store(folder, args.count, args.pending_share, first)
                runs = [
                    measure(replace(settings, db_url=empty), before, "postgresql, new database")
                ]
        else:
            settings, before = build_store(folder, args.count, args.pending_share)
            runs = [measure(settings, before, case) for case in ("lost", "corrupt")]
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    result = {"count": args.count, "store": before, "runs": runs, "cpus": os.cpu_count()}
    name = "rebuild-postgresql.json" if args.pg_url else RESULTS.name
    write_result(RESULTS.parent / name, result)
    print(f"store: {before['records']} records, built in {before['build_seconds']}s")
    print("| case | records | delivered | pending | rebuild | records/s | verify after |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for run in runs:
        print(
            f"| {run['case']} | {run['records']} | {run['delivered']} | {run['pending']} | "
            f"{run['rebuild_seconds']} s | {run['records_per_second']} | "
            f"{run['verify_seconds']} s |"
        )


if __name__ == "__main__":
    main()
