"""What each row and index one ``add`` commits costs: the bare-sqlite3 floor of the outbox's
own rows, then the same with one row left out or one index dropped, beside ``add`` and the
same-work floor of issue 24 (a node row, an outbox row and an FTS5 entry of the content, on
a database of just those three tables), all at WAL and the same ``synchronous``, in
alternating rounds in one process.

``python -m benchmarks.write_rows`` prints the table and writes ``results/write-rows-full.json``
(``--synchronous NORMAL``: ``write-rows-normal.json``, where no fsync hides the rows' own cost).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    NOOP_SINK,
    alternate,
    bench_settings,
    head_commit,
    load_average,
    memories,
    open_outbox,
    write_result,
)
from benchmarks.writepath import _FLOOR_ROWS, same_work_floor
from outbox.core.keys import canonical_timestamp
from outbox.store.sqlite_writes import sqlite_path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"  # write-rows-full.json, write-rows-normal.json
ROWS = ("records", "records_fts", "graph_nodes", "graph_edges", "deliveries")
# Each index and unique constraint a write maintains, with what reads it.
INDEXES = {
    "ix_records_origin_seq": "mirror repair and rebuild walk a machine's records in order",
    "ix_records_redaction_pending": "forget's unfinished work (partial: empty for a write)",
    "ix_records_markdown_name": "a file's record found by name (fallback import, verify)",
    "ix_graph_nodes_label_ts": "recent memories by label (recall's recent leg, browse)",
    "ix_graph_nodes_session_ts": "a session's memories in order (session filters)",
    "ix_graph_edges_source": "the edges out of a node (graph reads, forget's cascade)",
    "ix_deliveries_due": "claim: the due rows of a sink",
    "ix_deliveries_sink_state_created": "the oldest undelivered row per sink (visibility)",
    "ix_deliveries_mirror_pending": "outcomes still to mirror (partial: empty for a write)",
}


def _connect(path: Path, synchronous: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def floor_without(
    template: Path, folder: Path, synchronous: str, texts: list[str], skip: str | None
) -> Callable[[int], None]:
    """The floor of ``add``'s own rows on a copy of the migrated schema, leaving out the row
    ``skip`` names or dropping the index it names."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "floor.db"
    shutil.copy(template, path)
    conn = _connect(path, synchronous)
    if skip in INDEXES:
        conn.execute(f"DROP INDEX {skip}")
    record_sql, fts_sql, node_sql, edge_sql, delivery_sql = _FLOOR_ROWS

    def call(number: int) -> None:
        content = f"{number} {texts[number % len(texts)]}"
        ts = canonical_timestamp()
        key = hashlib.sha256(content.encode() + b"\n" + ts.encode()).hexdigest()
        now = time.time()
        conn.execute("BEGIN IMMEDIATE")
        (seq,) = conn.execute(
            record_sql,
            (key, ts, content, 7, '["decision"]', "{}", key[:16], f"{key[:16]}.md", "f", now),
        ).fetchone()
        if skip != "records_fts":
            conn.execute(fts_sql, (seq, content))
        properties = json.dumps({"timestamp": ts, "importance": 7, "semanticVectorId": key})
        if skip != "graph_nodes":
            conn.execute(node_sql, (key, ts, properties))
        if skip not in ("graph_nodes", "graph_edges"):  # the edge needs its node
            conn.execute(edge_sql, (key,))
        if skip != "deliveries":
            conn.execute(delivery_sql, (key, NOOP_SINK, now, now, now))
        conn.execute("COMMIT")

    return call


def run(folder: Path, synchronous: str, calls: int, rounds: int) -> dict[str, Any]:
    texts = memories(500, seed=31)
    settings = bench_settings(folder / "add", synchronous=synchronous)
    outbox = open_outbox(settings)
    template = sqlite_path(settings.db_url)
    assert template is not None
    pristine = folder / "template.db"
    with sqlite3.connect(template) as source, sqlite3.connect(pristine) as copy:
        source.backup(copy)

    def add(number: int) -> None:
        outbox.add(f"{number} {texts[number % len(texts)]}", tags=["decision"])

    contenders: dict[str, Callable[[int], Any]] = {
        "add": add,
        "same-work floor": same_work_floor(folder / "same", synchronous, texts),
        "floor, every row": floor_without(pristine, folder / "all", synchronous, texts, None),
    }
    for skip in (*ROWS[1:], *INDEXES):
        contenders[f"floor without {skip}"] = floor_without(
            pristine, folder / skip, synchronous, texts, skip
        )
    try:
        timed = alternate(contenders, calls, rounds)
    finally:
        outbox.close()
    medians = {name: statistics.median(samples) * 1e6 for name, (samples, _) in timed.items()}
    full = medians["floor, every row"]
    return {
        "synchronous": synchronous,
        "calls": calls,
        "rounds": rounds,
        "median_us": medians,
        "saved_us": {
            name.removeprefix("floor without "): full - value
            for name, value in medians.items()
            if name.startswith("floor without ")
        },
        "add_over_same_work": medians["add"] / medians["same-work floor"],
        "needs": INDEXES,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--synchronous", default="FULL")
    args = parser.parse_args(argv)
    before = load_average()
    with tempfile.TemporaryDirectory() as scratch:
        result = run(Path(scratch), args.synchronous, args.calls, args.rounds)
    result.update(commit=head_commit(), load_before=before, load_after=load_average())
    write_result(RESULTS / f"write-rows-{args.synchronous.lower()}.json", result)
    for name, value in result["median_us"].items():
        saved = result["saved_us"].get(name.removeprefix("floor without "))
        extra = f"  (saves {saved:6.1f})" if saved is not None else ""
        print(f"{name:45s} {value:8.1f} µs{extra}")
    print(f"add / same-work floor: {result['add_over_same_work']:.2f}x; load {before[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
