"""The dispatcher's per-batch queries, in the forms that keep them cheap at any size.

Runs on SQLite and on PostgreSQL. The batched settle (one ownership read, one executemany)
answers row by row as the per-row form did: a batch mixes rows this owner still holds with
rows whose lease was taken over and rows already delivered, repeats an id, and crosses the
500-id chunk of the ownership read. On SQLite, ``mirror_pending`` walks the partial index of
pending rows instead of every record, and ``pending_summary`` the age index instead of every
pending row (what they return is in ``outbox.testing.storage``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from outbox import Outbox, Settings, load_settings
from outbox.core.states import DeliveryState
from outbox.store.storage import Storage
from outbox.testing.storage_helpers import rows_by_id, seed
from tests.pg import NOOP_SINK

SINK = NOOP_SINK


@pytest.fixture
def storage(either_backend: Outbox) -> Storage:
    return either_backend.storage


def test_batched_settle_lands_only_on_rows_the_owner_holds(storage: Storage) -> None:
    t0 = 5_000_000.0
    seed(storage, 600, sinks=(SINK,), now=t0)
    ours = storage.deliveries.claim(SINK, "a", limit=600, lease_seconds=10.0, now=t0)
    assert len(ours) == 600
    already = ours[0]
    assert storage.deliveries.settle("a", [(already.delivery_id, "first")], [], now=t0 + 1)[0] == [
        already.delivery_id
    ]
    # Three expired leases are taken over by "b"; the rest, expired too, are still "a"'s.
    stolen = storage.deliveries.claim(SINK, "b", limit=3, lease_seconds=10.0, now=t0 + 11)
    taken = {c.delivery_id for c in stolen}
    assert len(taken) == 3 and already.delivery_id not in taken
    batch = [(c.delivery_id, f"id-{c.delivery_id}") for c in ours]
    mine = [c.delivery_id for c in ours[1:] if c.delivery_id not in taken]
    batch.append((mine[0], "repeat"))

    done, failed = storage.deliveries.settle("a", batch, [], now=t0 + 12)

    assert failed == []
    assert done == mine
    rows = rows_by_id(storage.engine)
    for delivery_id in mine:
        row = rows[delivery_id]
        assert (row.state, row.sink_id, row.delivered_at) == (
            DeliveryState.DELIVERED,
            f"id-{delivery_id}",
            t0 + 12,
        )
        assert row.lease_owner is None and row.lease_expires_at is None
        assert row.mirror_pending == 1 and row.available_at == t0 + 12
    for delivery_id in taken:
        row = rows[delivery_id]
        assert (row.state, row.lease_owner, row.sink_id) == (DeliveryState.LEASED, "b", None)
    first = rows[already.delivery_id]
    assert (first.state, first.sink_id, first.delivered_at) == (
        DeliveryState.DELIVERED,
        "first",
        t0 + 1,
    )


def _sqlite_plan(tmp_path: Path, run: Callable[[Storage, Settings], object]) -> list[str]:
    """SQLite's plan of the one statement ``run`` sends to the reader."""
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "md", sinks=SINK
    )
    with Outbox.open(settings) as ob:
        seen: list[tuple[str, Any]] = []

        def capture(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
            seen.append((statement, params))

        event.listen(ob.storage.reader, "before_cursor_execute", capture)
        run(ob.storage, settings)
        ((statement, params),) = seen
        with ob.storage.reader.connect() as conn:
            explained = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params)
            return [str(row[-1]) for row in explained]


def test_mirror_pending_walks_the_pending_index_not_every_record(tmp_path: Path) -> None:
    """Joined to records, SQLite drove the query from every record of the origin (all of
    them, on one machine), so each dispatcher batch cost grew with the outbox."""

    def run(storage: Storage, settings: Settings) -> object:
        return storage.mirror_state.mirror_pending(settings.mirror_id)

    plan = " / ".join(_sqlite_plan(tmp_path, run))
    assert "ix_deliveries_mirror_pending" in plan, plan
    assert "ix_records_origin_seq" not in plan, plan


def test_pending_summary_reads_the_age_index_not_every_pending_row(tmp_path: Path) -> None:
    """Without the index the oldest row needed a scan of every pending row, on every
    add_memory, however long the backlog."""

    def run(storage: Storage, _settings: Settings) -> object:
        return storage.deliveries.pending_summary(SINK)

    plan = _sqlite_plan(tmp_path, run)
    searches = [step for step in plan if "ix_deliveries_sink_state_created" in step]
    assert len(searches) >= 2, plan  # one step per undelivered state
    assert not any(step.startswith("SCAN deliveries") for step in plan), plan
