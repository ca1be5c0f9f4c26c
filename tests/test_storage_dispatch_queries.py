"""The dispatcher's per-batch queries, in the forms that keep them cheap at any size.

Runs on SQLite and on PostgreSQL. The batched settle (one ownership read, one executemany)
answers row by row as the per-row form did: a batch mixes rows this owner still holds with
rows whose lease was taken over and rows already delivered, repeats an id, and crosses the
500-id chunk of the ownership read. ``mirror_pending`` returns only the origin's rows, oldest
first, and on SQLite walks the partial index of pending rows instead of every record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select

from outbox import Outbox, load_settings
from outbox.record import build_record
from outbox.store.schema import deliveries, records
from outbox.store.storage import DELIVERED, LEASED, Storage
from tests.pg import NOOP_SINK

SINK = NOOP_SINK


@pytest.fixture
def storage(either_backend: Outbox) -> Storage:
    return either_backend.storage


def _seed(storage: Storage, count: int, now: float, origin: str = "t") -> None:
    with storage.engine.begin() as conn:
        for number in range(count):
            record = build_record(f"{origin} {number}", timestamp="2026-11-29T08:00:00Z")
            storage.insert_record(
                conn,
                record,
                sinks=(SINK,),
                markdown_name=f"{origin}-{number}.md",
                origin=origin,
                now=now,
            )


def _rows(storage: Storage) -> dict[int, Any]:
    with storage.engine.connect() as conn:
        return {row.id: row for row in conn.execute(select(deliveries))}


def test_batched_settle_lands_only_on_rows_the_owner_holds(storage: Storage) -> None:
    t0 = 5_000_000.0
    _seed(storage, 600, t0)
    ours = storage.claim(SINK, "a", limit=600, lease_seconds=10.0, now=t0)
    assert len(ours) == 600
    already = ours[0]
    assert storage.settle("a", [(already.delivery_id, "first")], [], now=t0 + 1)[0] == [
        already.delivery_id
    ]
    # Three expired leases are taken over by "b"; the rest, expired too, are still "a"'s.
    taken = {
        c.delivery_id for c in storage.claim(SINK, "b", limit=3, lease_seconds=10.0, now=t0 + 11)
    }
    assert len(taken) == 3 and already.delivery_id not in taken
    batch = [(c.delivery_id, f"id-{c.delivery_id}") for c in ours]
    mine = [c.delivery_id for c in ours[1:] if c.delivery_id not in taken]
    batch.append((mine[0], "repeat"))

    done, failed = storage.settle("a", batch, [], now=t0 + 12)

    assert failed == []
    assert done == mine
    rows = _rows(storage)
    for delivery_id in mine:
        row = rows[delivery_id]
        assert (row.state, row.sink_id, row.delivered_at) == (
            DELIVERED,
            f"id-{delivery_id}",
            t0 + 12,
        )
        assert row.lease_owner is None and row.lease_expires_at is None
        assert row.mirror_pending == 1 and row.available_at == t0 + 12
    for delivery_id in taken:
        row = rows[delivery_id]
        assert (row.state, row.lease_owner, row.sink_id) == (LEASED, "b", None)
    first = rows[already.delivery_id]
    assert (first.state, first.sink_id, first.delivered_at) == (DELIVERED, "first", t0 + 1)


def test_mirror_pending_returns_the_origins_rows_oldest_first(storage: Storage) -> None:
    t0 = 6_000_000.0
    _seed(storage, 6, t0, origin="here")
    _seed(storage, 6, t0, origin="elsewhere")
    claims = storage.claim(SINK, "a", limit=12, lease_seconds=60.0, now=t0)
    storage.settle("a", [(c.delivery_id, "id") for c in claims], [], now=t0 + 1)
    with storage.engine.connect() as conn:
        here = list(
            conn.execute(
                select(deliveries.c.id)
                .join(records, records.c.key == deliveries.c.record_key)
                .where(records.c.origin == "here")
                .order_by(deliveries.c.id)
            ).scalars()
        )
    assert [row.delivery_id for row in storage.mirror_pending("here")] == here
    assert [row.delivery_id for row in storage.mirror_pending("here", limit=4)] == here[:4]
    storage.clear_mirror_pending(here[:2])
    assert [row.delivery_id for row in storage.mirror_pending("here")] == here[2:]


def test_mirror_pending_walks_the_pending_index_not_every_record(tmp_path: Path) -> None:
    """Joined to records, SQLite drove the query from every record of the origin (all of
    them, on one machine), so each dispatcher batch cost grew with the outbox."""
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "md", sinks=SINK
    )
    with Outbox.open(settings) as ob:
        seen: list[tuple[str, Any]] = []

        def capture(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
            if "mirror_pending" in statement:
                seen.append((statement, params))

        event.listen(ob.storage.reader, "before_cursor_execute", capture)
        ob.storage.mirror_pending(settings.mirror_id)
        ((statement, params),) = seen
        with ob.storage.reader.connect() as conn:
            plan = " / ".join(
                str(row[-1])
                for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params)
            )
    assert "ix_deliveries_mirror_pending" in plan, plan
    assert "ix_records_origin_seq" not in plan, plan


def test_pending_summary_counts_to_its_cap_and_finds_the_oldest(storage: Storage) -> None:
    """add_memory reports these on every write: the count stops at the cap, the oldest
    undelivered row (pending or leased) is found whatever lies between."""
    t0 = 7_000_000.0
    _seed(storage, 30, t0, origin="old")
    _seed(storage, 40, t0 + 100, origin="new")
    assert storage.pending_summary(SINK, cap=25) == (25, t0)
    assert storage.pending_summary(SINK, cap=1000) == (70, t0)
    claimed = storage.claim(SINK, "me", limit=30, lease_seconds=60, now=t0 + 200)
    assert len(claimed) == 30
    assert storage.pending_summary(SINK) == (70, t0)  # leased rows are still undelivered
    storage.settle("me", [(row.delivery_id, "id") for row in claimed], [], now=t0 + 300)
    assert storage.pending_summary(SINK) == (40, t0 + 100)
    assert storage.pending_summary("another-sink") == (0, None)


def test_pending_summary_reads_the_age_index_not_every_pending_row(tmp_path: Path) -> None:
    """Without the index the oldest row needed a scan of every pending row: 30 ms per
    add_memory at 100,000 pending, 86 ms at 300,000 (0.4-0.7 ms with it)."""
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "md", sinks=SINK
    )
    with Outbox.open(settings) as ob:
        seen: list[tuple[str, Any]] = []

        def capture(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
            seen.append((statement, params))

        event.listen(ob.storage.reader, "before_cursor_execute", capture)
        ob.storage.pending_summary(SINK)
        ((statement, params),) = seen
        with ob.storage.reader.connect() as conn:
            plan = [
                str(row[-1])
                for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params)
            ]
    searches = [step for step in plan if "ix_deliveries_sink_state_created" in step]
    assert len(searches) >= 2, plan  # one step per undelivered state
    assert not any(step.startswith("SCAN deliveries") for step in plan), plan
