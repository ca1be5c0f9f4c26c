"""Does the write or the dispatcher slow down as the outbox grows?

One outbox per size, filled by ``bulk.bulk_insert`` (the rows ``add`` writes, through the
library's own insert, all pending for one sink: the worst case for the claim, a backlog of
that size). Then, in
alternating rounds over the sizes (so a noisy neighbour hits every size alike): ``add``
latency, the claim and the settle of a 64-row batch, and the FTS lookup of the pending
overlay (every bulk row is pending, so the overlay holds them all).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.bulk import bulk_insert
from benchmarks.common import (
    NOOP_SINK,
    bench_settings,
    memories,
    open_outbox,
    quiet_gc,
    summarize,
    time_calls,
)
from outbox import Outbox
from outbox.store.sqlite_writes import sqlite_path

QUERIES = (
    "why did we choose sqlite for the durable write",
    "dispatcher lease retry after a crash",
    "embedding model onnx tokenizer",
    "markdown mirror repair torn line",
)
ROUNDS = 5


class _Sized:
    """One outbox of a given size and the samples taken on it."""

    def __init__(self, folder: Path, rows: int) -> None:
        self.rows = rows
        settings = bench_settings(folder / f"rows-{rows}", synchronous="FULL")
        self.outbox: Outbox = open_outbox(settings)
        self.db = sqlite_path(settings.db_url)
        assert self.db is not None
        self.build_s = bulk_insert(self.db, rows, sinks=settings.sinks)
        self.texts = memories(500, seed=31)
        self._written = 0
        self.reset()

    def reset(self) -> None:
        self.add_samples: list[float] = []
        self.add_wall = 0.0
        self.claims: list[float] = []
        self.settles: list[float] = []
        self.lookups: list[float] = []
        self.lookup_wall = 0.0

    def add(self, number: int) -> None:
        text = self.texts[number % len(self.texts)]
        self.outbox.add(f"scale {self.rows} {number} {text}", tags=["scale"])

    def round(self, adds: int, claims: int, lookups: int) -> None:
        with quiet_gc():
            samples, wall = time_calls(self.add, adds, start=self._written)
        self._written += adds
        self.add_samples += samples
        self.add_wall += wall
        storage = self.outbox.storage
        with quiet_gc():
            for _ in range(claims):
                tick = time.perf_counter()
                batch = storage.deliveries.claim(NOOP_SINK, "scale", 64, 60.0)
                middle = time.perf_counter()
                storage.deliveries.settle("scale", [(c.delivery_id, c.key) for c in batch], [])
                self.claims.append(middle - tick)
                self.settles.append(time.perf_counter() - middle)
                if len(batch) != 64:
                    raise RuntimeError(f"claimed {len(batch)} rows at {self.rows}, expected 64")

        recall = storage.recall

        def lookup(number: int) -> None:
            query = QUERIES[number % len(QUERIES)]
            recall.pending_matches(query, vector_sink=NOOP_SINK, limit=10)

        with quiet_gc():
            samples, wall = time_calls(lookup, lookups, start=len(self.lookups))
        self.lookups += samples
        self.lookup_wall += wall

    def summary(self) -> dict[str, Any]:
        assert self.db is not None
        return {
            "rows": self.rows,
            "build_s": self.build_s,
            "db_mib": self.db.stat().st_size / 2**20,
            "add": summarize(self.add_samples, self.add_wall),
            "claim": summarize(self.claims, sum(self.claims)),
            "settle": summarize(self.settles, sum(self.settles)),
            "pending_matches": summarize(self.lookups, self.lookup_wall),
        }


def run(
    folder: Path, sizes: list[int], adds: int, claims: int, lookups: int
) -> list[dict[str, Any]]:
    """``adds``, ``claims`` and ``lookups`` are totals per size, spread over the rounds."""
    outboxes = [_Sized(folder, rows) for rows in sizes]
    try:
        for sized in outboxes:  # warm-up: connections, page cache, compiled statements
            sized.round(10, 1, 1)
            sized.reset()
        for _ in range(ROUNDS):
            for sized in outboxes:
                sized.round(
                    max(1, adds // ROUNDS), max(1, claims // ROUNDS), max(1, lookups // ROUNDS)
                )
        return [sized.summary() for sized in outboxes]
    finally:
        for sized in outboxes:
            sized.outbox.close()
