"""What the storage conformance suite builds its cases from: records inserted through the
store, the rows it wrote, and claims run from several threads or processes at once.

Kept apart from the suite so other tests can seed and inspect a store the same way.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, func, select

from outbox.core.config import load_settings
from outbox.core.record import build_record
from outbox.core.states import DeliveryState
from outbox.store.deliveries import Claim
from outbox.store.engine import make_engine
from outbox.store.schema import deliveries, graph_edges, graph_nodes, records
from outbox.store.storage import Storage

# Sink names are only names to the store: nothing is delivered here.
FIRST, SECOND = SINKS = ("sink-first", "sink-second")
LEASE = 3600.0
ORIGIN = "conformance"


def seed(
    storage: Storage,
    count: int,
    *,
    sinks: Sequence[str] = SINKS,
    now: float,
    prefix: str = "m",
    origin: str = ORIGIN,
) -> list[str]:
    """Insert ``count`` records (one transaction) straight through the storage interface."""
    keys: list[str] = []
    with storage.engine.begin() as conn:
        for number in range(count):
            record = build_record(
                f"{prefix} memory number {number}", timestamp="2026-11-29T08:00:00Z"
            )
            seq = storage.records.insert_record(
                conn,
                record,
                sinks=sinks,
                markdown_name=f"{prefix}-{number}.md",
                origin=origin,
                now=now,
            )
            assert seq is not None
            keys.append(record.key)
    return keys


def rows_by_id(engine: Engine) -> dict[int, Any]:
    """Every ``deliveries`` row with all its columns (the lease ones too), by id."""
    with engine.connect() as conn:
        return {row.id: row for row in conn.execute(select(deliveries))}


def table_counts(engine: Engine) -> dict[str, int]:
    """Rows per table of what one insert writes."""
    with engine.connect() as conn:
        return {
            table.name: int(conn.execute(select(func.count()).select_from(table)).scalar_one())
            for table in (records, graph_nodes, graph_edges, deliveries)
        }


def ids(claims: list[Claim]) -> list[int]:
    return [claim.delivery_id for claim in claims]


def engine_like(storage: Storage, home: Path) -> Engine:
    """A new engine, with its own pool, on the database ``storage`` uses."""
    url = storage.engine.url.render_as_string(hide_password=False)
    return make_engine(load_settings(env={}, db_url=url, home=home))


def kill(storage: Storage, sink: str, count: int, now: float) -> list[Claim]:
    claims = storage.deliveries.claim(sink, "killer", limit=count, lease_seconds=LEASE, now=now)
    failed = [(c.delivery_id, "rejected", "rejected", None) for c in claims]
    assert storage.deliveries.settle("killer", [], failed, now=now)[1] == ids(claims)
    return claims


def claim_all(storage: Storage, owner: str, start: Any, limit: int = 8) -> list[int]:
    start.wait(60)
    got: list[int] = []
    while claims := storage.deliveries.claim(FIRST, owner, limit, 600.0):
        got.extend(ids(claims))
    return got


def assert_partitioned(engine: Engine, parts: list[list[int]], total: int) -> None:
    claimed = [i for part in parts for i in part]
    assert len(claimed) == len(set(claimed)), "a row was claimed twice"
    assert len(claimed) == total, "some due rows were never claimed"
    rows = rows_by_id(engine)
    assert set(claimed) == set(rows)
    assert {row.attempts for row in rows.values()} == {1}
    assert {row.state for row in rows.values()} == {DeliveryState.LEASED}


def claim_process(db_url: str, home: str, owner: str, start: Any, out: Any) -> None:
    """Runs in a spawned process: its own engine, pool and connections."""
    try:
        engine = make_engine(load_settings(env={}, db_url=db_url, home=Path(home)))
        try:
            out.put((owner, claim_all(Storage(engine), owner, start)))
        finally:
            engine.dispose()
    except BaseException as exc:
        out.put((owner, f"{type(exc).__name__}: {exc}"))


def run_processes(target: Callable[..., None], args: list[tuple[Any, ...]]) -> list[Any]:
    """Start one spawned process per argument tuple, release them together, collect results.

    ``target`` is called as ``target(*args, start, out)``: it waits on ``start`` and puts one
    ``(name, result)`` on ``out``, a string result meaning it failed.
    """
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    out = context.Queue()
    processes = [context.Process(target=target, args=(*a, start, out)) for a in args]
    for process in processes:
        process.start()
    try:
        start.set()
        results = [out.get(timeout=180) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    failures = [r for r in results if isinstance(r[1], str)]
    assert not failures, failures
    return results
