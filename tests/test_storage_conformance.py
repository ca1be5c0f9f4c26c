"""One storage contract, two backends: every test here runs on SQLite and on PostgreSQL.

The dispatcher's guarantees rest on a handful of properties of ``Storage`` (a claim leases only
due rows and never the same row twice, a settle only lands for the lease's owner, dead letters
and pruning touch only what they should). They are checked here through the public storage
interface and ``Outbox`` on a real SQLite file and a real PostgreSQL server, so a dialect
difference shows up as a failing test instead of a lost or doubled memory in production.

Times are passed explicitly (``now=``) wherever the interface takes them, so no assertion
depends on how fast the machine is.
"""

from __future__ import annotations

import multiprocessing
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, inspect, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from outbox import Outbox, Settings, load_settings
from outbox.dispatch.dispatcher import Dispatcher
from outbox.dispatch.retry import RetryPolicy
from outbox.record import build_record
from outbox.store import migrate
from outbox.store.engine import make_engine
from outbox.store.schema import (
    FRONTIER_NODE_ID,
    SCHEMA_REVISION,
    deliveries,
    graph_edges,
    graph_nodes,
    records,
)
from outbox.store.storage import (
    DEAD,
    DELIVERED,
    DISCARDED,
    LEASED,
    PENDING,
    STATES,
    Claim,
    Storage,
)
from tests.pg import fresh_database

FAULTY = "outbox.testing.sinks:FaultySink"
NOOP = "outbox.testing.sinks:NoopSink"
SINKS = (FAULTY, NOOP)
LEASE = 3600.0

BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgresql", id="postgresql", marks=pytest.mark.postgres),
]


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A new, empty database on the backend under test."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'outbox.db'}"
        return
    with fresh_database() as url:
        yield url


@pytest.fixture
def backend_settings(db_url: str, tmp_path: Path) -> Settings:
    return load_settings(
        env={},
        db_url=db_url,
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks=",".join(SINKS),
    )


@pytest.fixture
def ob(backend_settings: Settings) -> Iterator[Outbox]:
    with Outbox.open(backend_settings) as opened:
        yield opened


@pytest.fixture
def storage(ob: Outbox) -> Storage:
    return ob.storage


# -- helpers ----------------------------------------------------------------------------------


def seed(
    storage: Storage, count: int, *, sinks: tuple[str, ...] = SINKS, now: float, prefix: str = "m"
) -> list[str]:
    """Insert ``count`` records (one transaction) straight through the storage interface."""
    keys: list[str] = []
    with storage.engine.begin() as conn:
        for number in range(count):
            record = build_record(
                f"{prefix} memory number {number}", timestamp="2026-11-29T08:00:00Z"
            )
            seq = storage.insert_record(
                conn,
                record,
                sinks=sinks,
                markdown_name=f"{prefix}-{number}.md",
                origin="conformance",
                now=now,
            )
            assert seq is not None
            keys.append(record.key)
    return keys


def rows_by_id(engine: Engine) -> dict[int, Any]:
    with engine.connect() as conn:
        return {row.id: row for row in conn.execute(select(deliveries))}


def table_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            table.name: int(conn.execute(select(func.count()).select_from(table)).scalar_one())
            for table in (records, graph_nodes, graph_edges, deliveries)
        }


def ids(claims: list[Claim]) -> list[int]:
    return [claim.delivery_id for claim in claims]


# -- migrations and the write -----------------------------------------------------------------


def test_open_migrates_to_head_once(ob: Outbox, backend: str) -> None:
    assert migrate.current_revision(ob.engine) == SCHEMA_REVISION
    assert migrate.upgrade(ob.engine) is False, "an up-to-date database must not migrate again"
    names = set(inspect(ob.engine).get_table_names())
    assert {"records", "graph_nodes", "graph_edges", "deliveries", "mirror_state"} <= names
    with ob.engine.connect() as conn:
        anchor = conn.execute(select(graph_nodes).where(graph_nodes.c.id == FRONTIER_NODE_ID)).one()
        if backend == "postgresql":
            index_sql = conn.execute(
                text("SELECT indexdef FROM pg_indexes WHERE indexname = :name"),
                {"name": "ix_deliveries_mirror_pending"},
            ).scalar_one()
        else:
            index_sql = conn.execute(
                text("SELECT sql FROM sqlite_master WHERE name = :name"),
                {"name": "ix_deliveries_mirror_pending"},
            ).scalar_one()
    assert anchor.label == "SYSTEM_ANCHOR"
    assert anchor.properties["name"] == "Active Context Frontier"
    assert "WHERE" in index_sql.upper() and "mirror_pending = 1" in index_sql


def test_add_writes_record_node_edge_and_one_delivery_per_sink(ob: Outbox) -> None:
    metadata = {"session_id": "s-1", "agent": "neo", "nested": {"n": [1, 2.5, None, True]}}
    receipt = ob.add(
        "Chose PostgreSQL for the shared deployment — «naïve» quotes ' \" kept",
        importance=8,
        tags=["decision", "storage", "ünïcode"],
        metadata=metadata,
    )
    assert receipt.status == "queued" and not receipt.duplicate
    stored = ob.storage.get_record(receipt.key)
    assert stored is not None
    assert stored.record.content.startswith("Chose PostgreSQL")
    assert stored.record.tags == ("decision", "storage", "ünïcode")
    assert stored.record.metadata == metadata
    assert stored.record.importance == 8
    with ob.engine.connect() as conn:
        node = conn.execute(select(graph_nodes).where(graph_nodes.c.id == receipt.key)).one()
        edges = conn.execute(select(graph_edges).where(graph_edges.c.target == receipt.key)).all()
    assert node.label == "AGENT_MEMORY"
    assert (node.session_id, node.agent, node.ts) == ("s-1", "neo", receipt.timestamp)
    assert node.properties["semanticVectorId"] == receipt.key
    assert node.properties["importance"] == 8
    assert [(e.source, e.type, e.weight) for e in edges] == [
        (FRONTIER_NODE_ID, "SPAWNED_MEMORY", 0.8)
    ]
    rows = ob.storage.deliveries_for([receipt.key])[receipt.key]
    assert sorted(row.sink for row in rows) == sorted(SINKS)
    assert all(row.state == PENDING and row.attempts == 0 for row in rows)


def test_duplicate_key_writes_nothing(ob: Outbox) -> None:
    first = ob.add("the same memory twice", timestamp="2026-11-29T08:00:00Z")
    before = table_counts(ob.engine)
    again = ob.add("the same memory twice", timestamp="2026-11-29T09:00:00+01:00")
    assert again.duplicate and again.key == first.key
    assert table_counts(ob.engine) == before
    # The storage call itself reports the conflict and adds no node, edge or delivery.
    record = ob.prepare("the same memory twice", timestamp="2026-11-29T08:00:00Z")
    with ob.engine.begin() as conn:
        seq = ob.storage.insert_record(
            conn, record, sinks=SINKS, markdown_name="other.md", origin="x", now=time.time()
        )
    assert seq is None
    assert table_counts(ob.engine) == before


def test_enqueue_commits_and_rolls_back_with_the_callers_transaction(ob: Outbox) -> None:
    class CallerAbort(Exception):
        pass

    with pytest.raises(CallerAbort), ob.engine.begin() as conn:
        ob.enqueue(conn, "rolled back with the caller")
        raise CallerAbort
    assert ob.storage.count_records() == 0
    with ob.engine.begin() as conn:
        receipt = ob.enqueue(conn, "committed with the caller")
    assert ob.storage.get_record(receipt.key) is not None
    assert len(ob.storage.deliveries_for([receipt.key])[receipt.key]) == len(SINKS)


def test_reads_keep_order_and_float_times_exactly(storage: Storage) -> None:
    now = 1_764_403_200.123456
    keys = seed(storage, 5, now=now)
    after = storage.records_after("conformance", 0, limit=3)
    assert [item.record.key for item in after] == keys[:3]
    rest = storage.records_after("conformance", after[-1].seq)
    assert [item.record.key for item in rest] == keys[3:]
    assert [item.record.key for item in storage.iter_records("conformance", batch=2)] == keys
    assert storage.count_records() == 5
    rows = storage.deliveries_for(keys)
    assert all(
        row.available_at == now and row.created_at == now for r in rows.values() for row in r
    )
    assert storage.next_due_at([FAULTY]) == now


# -- claims and leases ------------------------------------------------------------------------


def test_claim_takes_due_rows_only_and_respects_limit(storage: Storage) -> None:
    t0 = 1_000_000.0
    seed(storage, 10, sinks=(FAULTY,), now=t0)
    first = storage.claim(FAULTY, "a", limit=4, lease_seconds=LEASE, now=t0)
    assert len(first) == 4
    assert all(claim.sink == FAULTY and claim.attempts == 1 for claim in first)
    assert storage.claim(NOOP, "a", limit=100, lease_seconds=LEASE, now=t0) == []
    # Push two rows into the future, as a retry would.
    failed = [(i, "boom", "transport_closed", t0 + 500.0) for i in ids(first[:2])]
    assert storage.settle("a", [], failed, now=t0) == ([], ids(first[:2]))
    rest = storage.claim(FAULTY, "b", limit=100, lease_seconds=LEASE, now=t0 + 1)
    assert len(rest) == 6, "only pending rows past their retry time, never live leases"
    assert not set(ids(rest)) & set(ids(first))
    assert storage.claim(FAULTY, "b", limit=100, lease_seconds=LEASE, now=t0 + 499) == []
    later = storage.claim(FAULTY, "b", limit=100, lease_seconds=LEASE, now=t0 + 500)
    assert sorted(ids(later)) == sorted(ids(first[:2]))
    assert all(claim.attempts == 2 for claim in later)


def test_claim_skips_live_leases_and_retakes_expired_ones(storage: Storage) -> None:
    t0 = 2_000_000.0
    seed(storage, 3, sinks=(FAULTY,), now=t0)
    taken = storage.claim(FAULTY, "a", limit=10, lease_seconds=LEASE, now=t0)
    assert len(taken) == 3
    assert storage.claim(FAULTY, "b", limit=10, lease_seconds=LEASE, now=t0 + LEASE - 1) == []
    retaken = storage.claim(FAULTY, "b", limit=10, lease_seconds=LEASE, now=t0 + LEASE + 1)
    assert sorted(ids(retaken)) == sorted(ids(taken))
    assert all(claim.attempts == 2 for claim in retaken), "a lost lease still counts an attempt"
    rows = rows_by_id(storage.engine)
    assert {rows[i].lease_owner for i in ids(retaken)} == {"b"}
    assert {rows[i].state for i in ids(retaken)} == {LEASED}


def test_renew_extends_only_the_owners_rows(storage: Storage) -> None:
    seed(storage, 4, sinks=(FAULTY,), now=time.time())
    mine = storage.claim(FAULTY, "a", limit=2, lease_seconds=5.0)
    theirs = storage.claim(FAULTY, "b", limit=2, lease_seconds=5.0)
    before = rows_by_id(storage.engine)
    assert storage.renew("a", ids(mine) + ids(theirs), lease_seconds=3600.0) == 2
    assert storage.renew("c", ids(mine), lease_seconds=3600.0) == 0
    assert storage.renew("a", [], lease_seconds=3600.0) == 0
    after = rows_by_id(storage.engine)
    for i in ids(mine):
        assert after[i].lease_expires_at > before[i].lease_expires_at + 3000
        assert after[i].available_at == after[i].lease_expires_at
    for i in ids(theirs):
        assert after[i].lease_expires_at == before[i].lease_expires_at
        assert after[i].lease_owner == "b"


def test_settle_is_guarded_by_lease_ownership(storage: Storage) -> None:
    """River#1373: a dispatcher whose lease expired must not overwrite the new owner's row."""
    t0 = 3_000_000.0
    seed(storage, 2, sinks=(FAULTY,), now=t0)
    slow = storage.claim(FAULTY, "slow", limit=2, lease_seconds=10.0, now=t0)
    fresh = storage.claim(FAULTY, "fresh", limit=2, lease_seconds=10.0, now=t0 + 11)
    assert sorted(ids(fresh)) == sorted(ids(slow))
    one, two = sorted(ids(slow))
    late = storage.settle(
        "slow", [(one, "late-id")], [(two, "late error", "unknown", None)], now=t0 + 12
    )
    assert late == ([], [])
    rows = rows_by_id(storage.engine)
    assert {rows[i].state for i in (one, two)} == {LEASED}
    assert {rows[i].lease_owner for i in (one, two)} == {"fresh"}
    assert rows[one].sink_id is None and rows[two].last_error is None
    done = storage.settle(
        "fresh",
        [(one, "sink-1")],
        [(two, "Transport closed", "transport_closed", t0 + 60)],
        t0 + 13,
    )
    assert done == ([one], [two])
    rows = rows_by_id(storage.engine)
    assert (rows[one].state, rows[one].sink_id, rows[one].delivered_at) == (
        DELIVERED,
        "sink-1",
        t0 + 13,
    )
    assert rows[one].lease_owner is None and rows[one].mirror_pending == 1
    assert (rows[two].state, rows[two].available_at, rows[two].error_class) == (
        PENDING,
        t0 + 60,
        "transport_closed",
    )
    assert rows[two].attempts == 2 and rows[two].lease_owner is None
    # Settling a delivered row again (a duplicate settle) changes nothing.
    assert storage.settle("fresh", [(one, "sink-2")], [], t0 + 14) == ([], [])
    assert rows_by_id(storage.engine)[one].sink_id == "sink-1"


def test_release_returns_rows_without_counting_the_attempt(storage: Storage) -> None:
    t0 = time.time()  # release() stamps the wall clock, so the leases must be real ones
    seed(storage, 4, sinks=(FAULTY,), now=t0)
    mine = storage.claim(FAULTY, "a", limit=3, lease_seconds=LEASE, now=t0)
    theirs = storage.claim(FAULTY, "b", limit=3, lease_seconds=LEASE, now=t0)
    assert len(mine) == 3 and len(theirs) == 1
    assert storage.release("a", [mine[0].delivery_id]) == 1
    assert storage.release("c") == 0
    assert storage.release("a") == 2
    rows = rows_by_id(storage.engine)
    for i in ids(mine):
        assert (rows[i].state, rows[i].attempts, rows[i].lease_owner) == (PENDING, 0, None)
    (other,) = ids(theirs)
    assert (rows[other].state, rows[other].attempts) == (LEASED, 1)
    again = storage.claim(FAULTY, "c", limit=10, lease_seconds=LEASE)
    assert sorted(ids(again)) == sorted(ids(mine))
    assert all(claim.attempts == 1 for claim in again)


# -- dead letters, pruning, status ------------------------------------------------------------


def _kill(storage: Storage, sink: str, count: int, now: float) -> list[Claim]:
    claims = storage.claim(sink, "killer", limit=count, lease_seconds=LEASE, now=now)
    failed = [(c.delivery_id, "rejected", "rejected", None) for c in claims]
    assert storage.settle("killer", [], failed, now=now)[1] == ids(claims)
    return claims


def test_dead_letters_requeue_and_discard(storage: Storage) -> None:
    t0 = 5_000_000.0
    keys = seed(storage, 3, now=t0)
    dead_faulty = _kill(storage, FAULTY, 3, t0)
    dead_noop = _kill(storage, NOOP, 3, t0)
    assert {row.delivery_id for row in storage.list_deliveries(DEAD)} == set(
        ids(dead_faulty) + ids(dead_noop)
    )
    assert storage.claim(FAULTY, "a", limit=10, lease_seconds=LEASE, now=t0 + 10**6) == []
    assert storage.requeue_dead([keys[0]], sink=FAULTY) == 1
    assert storage.requeue_dead(None, sink=NOOP) == 3
    assert storage.requeue_dead([keys[0]], sink=FAULTY) == 0, "no longer dead"
    rows = {(r.key, r.sink): r for rs in storage.deliveries_for(keys).values() for r in rs}
    assert (rows[keys[0], FAULTY].state, rows[keys[0], FAULTY].attempts) == (PENDING, 0)
    assert rows[keys[1], FAULTY].state == DEAD
    assert all(rows[key, NOOP].state == PENDING for key in keys)
    assert storage.discard_dead(None) == 2
    assert storage.list_deliveries(DEAD) == []
    assert len(storage.list_deliveries(DISCARDED, sink=FAULTY)) == 2
    assert storage.requeue_dead(None) == 0, "discarded letters stay discarded"
    claimed = storage.claim(FAULTY, "a", limit=10, lease_seconds=LEASE)
    assert [claim.key for claim in claimed] == [keys[0]]


def test_prune_deletes_only_mirrored_delivered_rows_past_the_cutoff(storage: Storage) -> None:
    t0 = 6_000_000.0
    keys = seed(storage, 4, now=t0)
    claims = {c.key: c for c in storage.claim(FAULTY, "a", limit=4, lease_seconds=LEASE, now=t0)}
    old_done, old_unmirrored, new_done, _still_pending = keys
    storage.settle("a", [(claims[old_done].delivery_id, "x")], [], now=t0 + 1)
    storage.settle("a", [(claims[old_unmirrored].delivery_id, "y")], [], now=t0 + 1)
    storage.settle("a", [(claims[new_done].delivery_id, "z")], [], now=t0 + 100)
    storage.release("a")
    noop = storage.claim(NOOP, "a", limit=1, lease_seconds=LEASE, now=t0)
    storage.settle("a", [(noop[0].delivery_id, "n")], [], now=t0 + 1)
    mirrored = [claims[old_done].delivery_id, claims[new_done].delivery_id, noop[0].delivery_id]
    storage.clear_mirror_pending(mirrored)
    assert storage.prune_delivered([FAULTY], older_than=t0 + 50) == 1
    remaining = {(r.key, r.sink) for rs in storage.deliveries_for(keys).values() for r in rs}
    assert (old_done, FAULTY) not in remaining
    assert {(old_unmirrored, FAULTY), (new_done, FAULTY), (keys[3], FAULTY)} <= remaining
    assert (noop[0].key, NOOP) in remaining, "a sink not named is not pruned"
    assert storage.get_record(old_done) is not None, "the record itself stays"
    assert storage.prune_delivered([FAULTY, NOOP], older_than=t0 + 50) == 1
    assert storage.prune_delivered([FAULTY, NOOP], older_than=t0 + 50) == 0


def test_counts_and_oldest_pending(storage: Storage) -> None:
    assert storage.counts() == {} and storage.oldest_pending() == {}
    seed(storage, 3, now=100.0)
    seed(storage, 2, sinks=(FAULTY,), now=200.0, prefix="late")
    claims = storage.claim(FAULTY, "a", limit=2, lease_seconds=LEASE, now=300.0)
    storage.settle("a", [(claims[0].delivery_id, "id")], [], now=300.0)
    counts = storage.counts()
    assert set(counts) == set(SINKS)
    assert all(set(per_state) == set(STATES) for per_state in counts.values())
    assert counts[FAULTY] == {PENDING: 3, LEASED: 1, DELIVERED: 1, DEAD: 0, DISCARDED: 0}
    assert counts[NOOP][PENDING] == 3
    assert storage.oldest_pending() == {FAULTY: 100.0, NOOP: 100.0}
    everything = storage.claim(NOOP, "a", limit=10, lease_seconds=LEASE, now=300.0)
    storage.settle("a", [(c.delivery_id, "id") for c in everything], [], now=300.0)
    assert storage.oldest_pending() == {FAULTY: 100.0}


def test_mirror_watermark_round_trip(storage: Storage) -> None:
    assert storage.mirror_watermark("host-a") == (0, 0, None)
    storage.set_mirror_watermark("host-a", 5, 1234, "ab" * 32)
    assert storage.mirror_watermark("host-a") == (5, 1234, "ab" * 32)
    big = (2**40, 2**33 + 7, None)  # past 32 bits: BIGINT on PostgreSQL
    storage.set_mirror_watermark("host-a", *big)
    assert storage.mirror_watermark("host-a") == big
    assert storage.mirror_watermark("host-b") == (0, 0, None)


# -- concurrency ------------------------------------------------------------------------------


def _claim_all(storage: Storage, owner: str, start: Any, limit: int = 8) -> list[int]:
    start.wait(60)
    got: list[int] = []
    while claims := storage.claim(FAULTY, owner, limit, 600.0):
        got.extend(ids(claims))
    return got


def _assert_partitioned(engine: Engine, parts: list[list[int]], total: int) -> None:
    claimed = [i for part in parts for i in part]
    assert len(claimed) == len(set(claimed)), "a row was claimed twice"
    assert len(claimed) == total, "some due rows were never claimed"
    rows = rows_by_id(engine)
    assert set(claimed) == set(rows)
    assert {row.attempts for row in rows.values()} == {1}
    assert {row.state for row in rows.values()} == {LEASED}


def test_two_threads_never_claim_the_same_row(storage: Storage, backend_settings: Settings) -> None:
    total = 400
    seed(storage, total, sinks=(FAULTY,), now=time.time() - 1)
    engines = [make_engine(backend_settings) for _ in range(2)]
    start = threading.Barrier(2)
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def work(owner: str, engine: Engine) -> None:
        try:
            results[owner] = _claim_all(Storage(engine), owner, start)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(f"thread-{n}", engine))
        for n, engine in enumerate(engines)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for engine in engines:
        engine.dispose()
    assert not errors, errors
    _assert_partitioned(storage.engine, list(results.values()), total)


def _claim_process(db_url: str, home: str, owner: str, start: Any, out: Any) -> None:
    """Runs in a spawned process: its own engine, pool and connections."""
    try:
        engine = make_engine(load_settings(env={}, db_url=db_url, home=Path(home)))
        try:
            out.put((owner, _claim_all(Storage(engine), owner, start)))
        finally:
            engine.dispose()
    except BaseException as exc:
        out.put((owner, f"{type(exc).__name__}: {exc}"))


def _run_processes(target: Any, args: list[tuple[Any, ...]]) -> list[Any]:
    """Start one spawned process per argument tuple, release them together, collect results."""
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


def test_two_processes_never_claim_the_same_row(
    storage: Storage, backend_settings: Settings
) -> None:
    total = 600
    seed(storage, total, sinks=(FAULTY,), now=time.time() - 1)
    url, home = backend_settings.db_url, str(backend_settings.home)
    results = _run_processes(_claim_process, [(url, home, "proc-0"), (url, home, "proc-1")])
    _assert_partitioned(storage.engine, [got for _owner, got in results], total)


@pytest.mark.postgres
def test_postgres_claim_skips_locked_rows_instead_of_waiting(pg_url: str, tmp_path: Path) -> None:
    """With another transaction holding row locks, a claim takes the other rows at once; if
    it waited instead, ``lock_timeout`` (the busy timeout) would raise."""
    settings = load_settings(env={}, db_url=pg_url, home=tmp_path / ".outbox", busy_timeout=2)
    with Outbox.open(settings, sinks=FAULTY) as opened:
        storage = opened.storage
        seed(storage, 10, sinks=(FAULTY,), now=time.time() - 1)
        with opened.engine.connect() as holder:
            setting = holder.execute(
                text("SELECT setting FROM pg_settings WHERE name = 'lock_timeout'")
            ).scalar_one()
            assert setting == "2000", "the busy timeout must become lock_timeout"
            locked = holder.execute(
                select(deliveries.c.id).order_by(deliveries.c.id).limit(4).with_for_update()
            ).scalars()
            locked_ids = set(locked)
            claims = storage.claim(FAULTY, "other", limit=100, lease_seconds=LEASE)
            holder.rollback()
        assert len(claims) == 6
        assert not set(ids(claims)) & locked_ids
        rest = storage.claim(FAULTY, "other", limit=100, lease_seconds=LEASE)
        assert set(ids(rest)) == locked_ids


@pytest.mark.postgres
def test_postgres_url_options_schema_driver_and_password(pg_url: str, tmp_path: Path) -> None:
    """What a PostgreSQL URL carries is honoured: ``options`` (here a ``search_path`` putting
    the outbox in its own schema) survive the engine's own ``lock_timeout``; a bare
    ``postgresql://`` uses psycopg 3; a zero busy timeout does not become "wait forever";
    the password never shows in ``status()``."""
    admin = make_engine(load_settings(env={}, db_url=pg_url))
    with admin.begin() as conn:
        conn.execute(text("CREATE SCHEMA tenant"))
    admin.dispose()
    url = make_url(pg_url).set(
        drivername="postgresql", password="s3cret-pw", query={"options": "-csearch_path=tenant"}
    )
    settings = load_settings(
        env={},
        db_url=url.render_as_string(hide_password=False),
        home=tmp_path / ".outbox",
        busy_timeout=0,
        sinks=FAULTY,
    )
    with Outbox.open(settings) as opened:
        assert opened.engine.dialect.driver == "psycopg"
        receipt = opened.add("a memory in its own schema")
        with opened.engine.connect() as conn:
            path = conn.execute(text("SHOW search_path")).scalar_one()
            lock_ms = conn.execute(
                text("SELECT setting FROM pg_settings WHERE name = 'lock_timeout'")
            ).scalar_one()
            tenant_tables = set(
                conn.execute(
                    text("SELECT tablename FROM pg_tables WHERE schemaname = 'tenant'")
                ).scalars()
            )
            public_tables = conn.execute(
                text("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
            ).scalar_one()
        assert path == "tenant"
        assert lock_ms == "1"
        assert {"records", "deliveries", "alembic_version"} <= tenant_tables
        assert public_tables == 0
        assert opened.storage.get_record(receipt.key) is not None
        status = opened.status()
        assert "s3cret-pw" not in str(status)
        assert status["database"].startswith("postgresql+psycopg://postgres:***@")


@pytest.mark.postgres
@pytest.mark.parametrize("trouble", ["locked", "read_only", "down"])
def test_postgres_trouble_falls_back_then_imports(
    pg_url: str, tmp_path: Path, trouble: str
) -> None:
    """Contract section 5 on PostgreSQL: a locked table (``lock_timeout``), a read-only
    database or a stopped server sends the write to the fallback file with the right reason;
    the next open on a healthy database imports it, and it is delivered like any other."""
    folders = {"home": tmp_path / ".outbox", "markdown_dir": tmp_path / "md"}
    healthy = load_settings(env={}, db_url=pg_url, sinks=FAULTY, busy_timeout=1, **folders)
    with Outbox.open(healthy):
        pass  # migrated while healthy, so only the write itself meets the trouble
    admin = make_engine(load_settings(env={}, db_url=pg_url, home=tmp_path / "admin"))
    database = make_url(pg_url).database
    if trouble == "down":
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        url = make_url(pg_url).set(port=port).render_as_string(hide_password=False)
        settings = replace(healthy, db_url=url)
    else:
        settings = healthy
    holder = admin.connect()
    try:
        if trouble == "locked":
            holder.execute(text("LOCK TABLE records IN EXCLUSIVE MODE"))
        elif trouble == "read_only":
            holder.execute(
                text(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
            )
            holder.commit()
        with Outbox.open(settings) as troubled:
            receipt = troubled.add(f"written while PostgreSQL is {trouble}")
    finally:
        holder.rollback()
        if trouble == "read_only":
            holder.execute(text(f'ALTER DATABASE "{database}" RESET default_transaction_read_only'))
            holder.commit()
        holder.close()
        admin.dispose()
    reasons = {"locked": "db_busy", "read_only": "readonly", "down": "db_unreachable"}
    expected_reason = reasons[trouble]
    assert (receipt.status, receipt.reason) == ("fallback", expected_reason)
    assert receipt.markdown_path.is_file()
    with Outbox.open(healthy) as recovered:
        assert recovered.storage.get_record(receipt.key) is not None
        assert recovered.drain(timeout=60).ok
        (row,) = recovered.storage.deliveries_for([receipt.key])[receipt.key]
        assert row.state == DELIVERED
        assert recovered.verify().problems == []


@pytest.mark.postgres
def test_postgres_notify_wakes_a_dispatcher_of_another_outbox(pg_url: str, tmp_path: Path) -> None:
    """A write commits a NOTIFY; a dispatcher listening through its own engine (as one in
    another process would) delivers the record long before its 10-minute poll comes round."""
    settings = load_settings(
        env={},
        db_url=pg_url,
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks=FAULTY,
        poll_interval=600,
    )
    with Outbox.open(settings) as served, Outbox.open(settings) as writer:
        stop = threading.Event()
        dispatcher = Dispatcher(served)
        runner = threading.Thread(target=dispatcher.run, args=(stop,), daemon=True)
        runner.start()
        try:
            listening = 0
            for _ in range(300):  # wait until the LISTEN is in place, or the NOTIFY is lost
                with writer.engine.connect() as conn:
                    listening = conn.execute(
                        text(
                            "SELECT count(*) FROM pg_stat_activity"
                            " WHERE datname = current_database() AND query = :q"
                        ),
                        {"q": "LISTEN outbox_records"},
                    ).scalar_one()
                if listening:
                    break
                time.sleep(0.1)
            assert listening == 1
            receipt = writer.add("a write in another outbox wakes the listening dispatcher")
            row = None
            for _ in range(600):  # generous: a missed wake-up would wait for the 600 s poll
                (row,) = writer.storage.deliveries_for([receipt.key])[receipt.key]
                if row.state == DELIVERED:
                    break
                time.sleep(0.1)
            assert row is not None and row.state == DELIVERED
        finally:
            stop.set()
            runner.join(60)
            dispatcher.close()
        assert not runner.is_alive()


def _open_process(db_url: str, home: str, owner: str, start: Any, out: Any) -> None:
    try:
        start.wait(60)
        settings = load_settings(env={}, db_url=db_url, home=Path(home), sinks=FAULTY)
        with Outbox.open(settings, sinks=FAULTY) as opened:
            out.put((owner, [migrate.current_revision(opened.engine) or ""]))
    except BaseException as exc:
        out.put((owner, f"{type(exc).__name__}: {exc}"))


def test_concurrent_first_opens_migrate_once(db_url: str, tmp_path: Path) -> None:
    args = [(db_url, str(tmp_path / f"home-{n}"), f"open-{n}") for n in range(3)]
    results = _run_processes(_open_process, args)
    assert [revision for _owner, revision in results] == [[SCHEMA_REVISION]] * 3
    settings = load_settings(env={}, db_url=db_url, home=tmp_path / "check")
    engine = make_engine(settings)
    try:
        with engine.connect() as conn:
            anchors = conn.execute(
                select(func.count())
                .select_from(graph_nodes)
                .where(graph_nodes.c.id == FRONTIER_NODE_ID)
            ).scalar_one()
    finally:
        engine.dispose()
    assert anchors == 1


# -- end to end with the fault-injection sink -------------------------------------------------


def _faulty_copies(path: Path) -> dict[str, int]:
    with sqlite3.connect(path) as conn:
        return dict(conn.execute("SELECT key, deliveries FROM delivered").fetchall())


def test_add_and_drain_through_a_faulty_sink(
    backend_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faulty_db = tmp_path / "faulty.db"
    monkeypatch.setenv("OUTBOX_FAULTY_DB", str(faulty_db))
    monkeypatch.setenv("OUTBOX_FAULTY_FAIL_RATE", "0.3")
    monkeypatch.setenv("OUTBOX_FAULTY_SEED", "1373")
    monkeypatch.setenv("OUTBOX_FAULTY_REJECT", "POISON")
    settings = replace(backend_settings, sinks=(FAULTY,))
    fast_retries = RetryPolicy(max_retries=100, base=0.01, cap=0.05)
    with Outbox.open(settings) as opened:
        good = [
            opened.add(f"memory {n}: the faulty sink drops some", tags=["e2e"]) for n in range(40)
        ]
        poison = opened.add("this one carries POISON and is refused for good")
        remaining: dict[str, int] = {}
        # One dispatcher (one sink object) for every round, so the seeded faults run on
        # instead of repeating the same sequence each round.
        with Dispatcher(opened, policy=fast_retries, batch_size=16) as dispatcher:
            for _ in range(200):
                remaining = dispatcher.drain(timeout=60).remaining[FAULTY]
                if remaining[PENDING] == 0 and remaining[LEASED] == 0:
                    break
                time.sleep(0.05)  # let the backoff of the transient failures pass
        assert remaining == {PENDING: 0, LEASED: 0, DELIVERED: 40, DEAD: 1, DISCARDED: 0}
        rows = opened.storage.deliveries_for([r.key for r in good])
        assert max(row.attempts for rs in rows.values() for row in rs) > 1, "no fault injected"
        (dead,) = opened.storage.deliveries_for([poison.key])[poison.key]
        assert (dead.state, dead.error_class, dead.attempts) == (DEAD, "rejected", 1)
        copies = _faulty_copies(faulty_db)
        assert set(copies) == {r.key for r in good}
        assert opened.verify().problems == []
        status = opened.status()
        assert status["records"] == 41 and status["dead_letters"] == 1


def _drain_process(db_url: str, home: str, owner: str, start: Any, out: Any) -> None:
    try:
        settings = load_settings(env={}, db_url=db_url, home=Path(home), sinks=FAULTY)
        with Outbox.open(settings) as opened:
            start.wait(60)
            report = opened.drain(timeout=120, batch_size=8)
            out.put((owner, [report.delivered]))
    except BaseException as exc:
        out.put((owner, f"{type(exc).__name__}: {exc}"))


def test_two_dispatcher_processes_deliver_each_record_once(
    ob: Outbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    faulty_db = tmp_path / "faulty.db"
    monkeypatch.setenv("OUTBOX_FAULTY_DB", str(faulty_db))
    total = 300
    seed(ob.storage, total, sinks=(FAULTY,), now=time.time() - 1)
    url, home = ob.settings.db_url, str(ob.settings.home)
    results = _run_processes(_drain_process, [(url, home, "drain-0"), (url, home, "drain-1")])
    assert sum(delivered for _owner, (delivered,) in results) == total
    copies = _faulty_copies(faulty_db)
    assert len(copies) == total and set(copies.values()) == {1}, "a record was delivered twice"
    counts = ob.storage.counts()[FAULTY]
    assert counts[DELIVERED] == total
    with ob.engine.connect() as conn:
        attempts = set(conn.execute(select(deliveries.c.attempts)).scalars())
    assert attempts == {1}


def test_postgres_unreachable_server_is_a_driver_error(tmp_path: Path) -> None:
    """The engine's psycopg connect arguments are accepted, and a closed port surfaces as the
    OperationalError the write path treats as "database unavailable", not as a config bug."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/nothing"
    settings = load_settings(env={}, db_url=url, home=tmp_path / ".outbox", busy_timeout=1)
    engine = make_engine(settings)
    try:
        with pytest.raises(OperationalError), engine.connect() as conn:
            conn.execute(update(deliveries).values(attempts=0))
    finally:
        engine.dispose()
