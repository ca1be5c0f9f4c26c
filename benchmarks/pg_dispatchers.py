"""Drain throughput into the no-op sink with 1, 2 and 4 dispatcher processes on PostgreSQL.

    python benchmarks/pg_dispatchers.py [--pg-url …] [--records 4000] [--json]

Each round starts N ``outbox run`` processes on a scratch database, lets them go idle, writes
``--records`` records in one transaction (its NOTIFY wakes them) and times until every row is
delivered. The no-op sink answers at once, so what is
measured is the outbox's own claim / settle / mirror cost and how it scales across processes
(FOR UPDATE SKIP LOCKED claims, LISTEN/NOTIFY wake-ups).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.backends import scratch_postgres
from outbox import Outbox, load_settings

SINK = "outbox.testing.sinks:NoopSink"


def one_round(url: str, dispatchers: int, records: int, folder: Path) -> float:
    settings = load_settings(
        env={},
        db_url=url,
        home=folder,
        markdown_dir=folder / "md",
        sinks=SINK,
        mirror_id=f"bench-{dispatchers}",
    )
    env = dict(
        os.environ,
        OUTBOX_DB_URL=url,
        OUTBOX_SINKS=SINK,
        OUTBOX_BATCH_SIZE="64",
        OUTBOX_POLL_INTERVAL="0.05",
        OUTBOX_HOME=str(folder),
        OUTBOX_MARKDOWN_DIR=str(folder / "md"),
    )
    with Outbox.open(settings) as ob:
        # Start the dispatchers first and let them go idle, so start-up is not timed.
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "outbox", "run"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for _ in range(dispatchers)
        ]
        try:
            time.sleep(4.0)
            ob.add_many(f"round {dispatchers} record {i}" for i in range(records))
            started = time.perf_counter()  # the commit's NOTIFY has just woken them
            while ob.storage.deliveries.counts()[SINK]["delivered"] < records:
                time.sleep(0.02)
            elapsed = time.perf_counter() - started
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.wait(timeout=60)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg-url", default=os.environ.get("OUTBOX_TEST_PG_URL"))
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not args.pg_url:
        raise SystemExit("pass --pg-url or set OUTBOX_TEST_PG_URL")
    results = {}
    for count in (1, 2, 4):
        with (
            scratch_postgres(args.pg_url) as (url, durability),
            tempfile.TemporaryDirectory() as tmp,
        ):
            elapsed = one_round(url, count, args.records, Path(tmp))
        results[count] = {
            "seconds": round(elapsed, 2),
            "records_per_s": round(args.records / elapsed),
        }
    if args.json:
        print(json.dumps({"durability": durability, "results": results}))
        return
    print(
        f"PostgreSQL {durability['server_version']} (fsync={durability['fsync']}), "
        f"{args.records} records into the no-op sink"
    )
    base = results[1]["records_per_s"]
    for count, row in results.items():
        print(
            f"  {count} dispatcher(s): {row['records_per_s']:>6} records/s "
            f"({row['seconds']} s, x{row['records_per_s'] / base:.2f})"
        )


if __name__ == "__main__":
    main()
