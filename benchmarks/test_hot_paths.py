"""pytest-benchmark for the hot paths, one function each.

Run: ``.venv/bin/python -m pytest benchmarks --benchmark-only``. Outside ``testpaths``, so
the normal test run never times anything. Side-by-side comparisons (floor, rivals, dispatcher
processes, scale) are in ``python -m benchmarks.compare``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bulk import bulk_insert
from benchmarks.common import NOOP_SINK, bench_settings, memories, open_outbox
from outbox import Outbox
from outbox.core.keys import canonical_timestamp, idempotency_key
from outbox.core.record import build_record
from outbox.core.slugs import derive_slug, markdown_filename
from outbox.store.sqlite_writes import sqlite_path

TEXTS = memories(200, seed=51)
CONTENT = TEXTS[0]
TS = "2026-11-29T08:00:00.000000Z"
CLAIM_ROUNDS = 100
CLAIM_BATCH = 64


@pytest.fixture
def outbox(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Outbox]:
    synchronous = getattr(request, "param", "FULL")
    with open_outbox(bench_settings(tmp_path, synchronous=synchronous)) as opened:
        yield opened


@pytest.fixture
def backlog(tmp_path: Path) -> Iterator[Outbox]:
    """An outbox with enough pending rows for every claim round (bulk rows, see bulk.py)."""
    settings = bench_settings(tmp_path)
    with open_outbox(settings) as opened:
        path = sqlite_path(settings.db_url)
        assert path is not None
        bulk_insert(path, CLAIM_ROUNDS * CLAIM_BATCH + 1000, sinks=settings.sinks)
        yield opened


def _numbers() -> Iterator[int]:
    return itertools.count()


def test_idempotency_key(benchmark: Any) -> None:
    assert len(benchmark(idempotency_key, CONTENT, TS)) == 64


def test_canonical_timestamp(benchmark: Any) -> None:
    assert benchmark(canonical_timestamp, "2026-11-29T09:00:00+01:00") == TS


def test_derive_slug(benchmark: Any) -> None:
    assert benchmark(derive_slug, CONTENT).startswith("note-0")


def test_markdown_filename(benchmark: Any) -> None:
    slug = derive_slug(CONTENT)
    assert benchmark(markdown_filename, TS, slug).endswith(".md")


def test_build_record(benchmark: Any) -> None:
    """Validation, canonical timestamp, key and slug: everything before the transaction."""
    record = benchmark(build_record, CONTENT, importance=7, tags=["decision", "storage"])
    assert record.key


@pytest.mark.parametrize("outbox", ["FULL", "NORMAL"], indirect=True)
def test_add(benchmark: Any, outbox: Outbox) -> None:
    """One durable write with both mirrors."""
    numbers = _numbers()

    def add() -> str:
        number = next(numbers)
        return outbox.add(f"{number} {TEXTS[number % len(TEXTS)]}", tags=["bench"]).status

    assert benchmark(add) == "queued"


def test_add_many(benchmark: Any, outbox: Outbox) -> None:
    """100 records in one transaction (the benchmark's figure is per call, not per record)."""
    numbers = _numbers()

    def add_many() -> int:
        number = next(numbers)
        items = [f"{number}-{item} {TEXTS[item % len(TEXTS)]}" for item in range(100)]
        return len(outbox.add_many(items))

    assert benchmark.pedantic(add_many, rounds=30, iterations=1, warmup_rounds=1) == 100


def test_claim_settle(benchmark: Any, backlog: Outbox) -> None:
    """Lease 64 due rows and mark them delivered: the dispatcher's bookkeeping per batch."""
    storage = backlog.storage

    def claim_settle() -> int:
        claims = storage.deliveries.claim(NOOP_SINK, "bench", CLAIM_BATCH, 60.0)
        done, _ = storage.deliveries.settle("bench", [(c.delivery_id, c.key) for c in claims], [])
        return len(done)

    assert benchmark.pedantic(claim_settle, rounds=CLAIM_ROUNDS, iterations=1) == CLAIM_BATCH


def test_pending_matches(benchmark: Any, backlog: Outbox) -> None:
    """The FTS lookup behind read-after-write recall, over a few thousand pending records."""
    hits = benchmark(
        backlog.pending_matches,
        "why did the dispatcher retry the lease after a crash",
        vector_sink=NOOP_SINK,
        limit=10,
    )
    assert len(hits) == 10
