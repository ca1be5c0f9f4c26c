"""The outbox on both backends: every test here runs on SQLite and on PostgreSQL, or on
PostgreSQL alone where it is about PostgreSQL's own behaviour.

Where ``test_storage_conformance.py`` checks the storage parts alone, these go through
``Outbox`` and the dispatcher: the write and its transaction, delivery through a faulty sink,
two dispatcher processes, concurrent first opens, and what a PostgreSQL URL, a locked, read-only
or stopped server, and ``NOTIFY`` do.
"""

from __future__ import annotations

import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, inspect, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from outbox import Outbox, Settings, load_settings
from outbox.core.states import DeliveryState
from outbox.dispatch.retry import RetryPolicy
from outbox.store import migrate
from outbox.store.engine import make_engine
from outbox.store.schema import (
    FRONTIER_NODE_ID,
    SCHEMA_REVISION,
    deliveries,
    graph_edges,
    graph_nodes,
)
from outbox.testing.storage_helpers import ids, run_processes, seed, table_counts
from tests.pg import NOOP_SINK, new_database

FAULTY = "outbox.testing.sinks:FaultySink"
NOOP = NOOP_SINK
SINKS = (FAULTY, NOOP)
LEASE = 3600.0

PENDING, LEASED = DeliveryState.PENDING, DeliveryState.LEASED
DELIVERED, DEAD, DISCARDED = DeliveryState.DELIVERED, DeliveryState.DEAD, DeliveryState.DISCARDED


# -- fixtures: all on either_backend's database -----------------------------------------------


@pytest.fixture
def backend(either_backend: Outbox) -> str:
    return either_backend.engine.dialect.name


@pytest.fixture
def backend_settings(either_backend: Outbox) -> Settings:
    """The database under test, delivering to the fault-injection sink and the no-op sink."""
    return replace(either_backend.settings, sinks=SINKS)


@pytest.fixture
def ob(backend_settings: Settings) -> Iterator[Outbox]:
    with Outbox.open(backend_settings) as opened:
        yield opened


@pytest.fixture
def db_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """Another new, empty database on the backend under test: for a first open."""
    with new_database(backend, tmp_path / "first-open") as url:
        yield url


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
    stored = ob.storage.records.get_record(receipt.key)
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
    rows = ob.storage.deliveries.deliveries_for([receipt.key])[receipt.key]
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
        seq = ob.storage.records.insert_record(
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
    assert ob.storage.records.count_records() == 0
    with ob.engine.begin() as conn:
        receipt = ob.enqueue(conn, "committed with the caller")
    assert ob.storage.records.get_record(receipt.key) is not None
    assert len(ob.storage.deliveries.deliveries_for([receipt.key])[receipt.key]) == len(SINKS)


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
        with opened.dispatcher(policy=fast_retries, batch_size=16) as dispatcher:
            for _ in range(200):
                remaining = dispatcher.drain(timeout=60).remaining[FAULTY]
                if remaining[PENDING] == 0 and remaining[LEASED] == 0:
                    break
                time.sleep(0.05)  # let the backoff of the transient failures pass
        assert remaining == {
            PENDING: 0,
            LEASED: 0,
            DELIVERED: 40,
            DEAD: 1,
            DISCARDED: 0,
            DeliveryState.FORGOTTEN: 0,
        }
        rows = opened.storage.deliveries.deliveries_for([r.key for r in good])
        assert max(row.attempts for rs in rows.values() for row in rs) > 1, "no fault injected"
        (dead,) = opened.storage.deliveries.deliveries_for([poison.key])[poison.key]
        assert (dead.state, dead.error_class, dead.attempts) == (DEAD, "rejected", 1)
        copies = _faulty_copies(faulty_db)
        assert set(copies) == {r.key for r in good}
        assert opened.verify().problems == []
        status = opened.status()
        assert status["records"] == 41 and status["dead_letters"] == 1


def _drain_process(db_url: str, home: str, markdown: str, owner: str, start: Any, out: Any) -> None:
    try:
        settings = load_settings(
            env={}, db_url=db_url, home=Path(home), markdown_dir=Path(markdown), sinks=FAULTY
        )
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
    # The dispatchers run on the writer's machine: the same home and mirrors.
    url, home, md = ob.settings.db_url, str(ob.settings.home), str(ob.settings.markdown_dir)
    results = run_processes(
        _drain_process, [(url, home, md, "drain-0"), (url, home, md, "drain-1")]
    )
    assert sum(delivered for _owner, (delivered,) in results) == total
    copies = _faulty_copies(faulty_db)
    assert len(copies) == total and set(copies.values()) == {1}, "a record was delivered twice"
    counts = ob.storage.deliveries.counts()[FAULTY]
    assert counts[DELIVERED] == total
    with ob.engine.connect() as conn:
        attempts = set(conn.execute(select(deliveries.c.attempts)).scalars())
    assert attempts == {1}


def _open_process(db_url: str, home: str, owner: str, start: Any, out: Any) -> None:
    try:
        start.wait(60)
        # Each process is a machine of its own (its own home and mirrors) on one database.
        settings = load_settings(
            env={}, db_url=db_url, home=Path(home), sinks=FAULTY, mirror_id=owner
        )
        with Outbox.open(settings, sinks=FAULTY) as opened:
            out.put((owner, [migrate.current_revision(opened.engine) or ""]))
    except BaseException as exc:
        out.put((owner, f"{type(exc).__name__}: {exc}"))


def test_concurrent_first_opens_migrate_once(db_url: str, tmp_path: Path) -> None:
    args = [(db_url, str(tmp_path / f"home-{n}"), f"open-{n}") for n in range(3)]
    results = run_processes(_open_process, args)
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
            claims = storage.deliveries.claim(FAULTY, "other", limit=100, lease_seconds=LEASE)
            holder.rollback()
        assert len(claims) == 6
        assert not set(ids(claims)) & locked_ids
        rest = storage.deliveries.claim(FAULTY, "other", limit=100, lease_seconds=LEASE)
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
        assert opened.storage.records.get_record(receipt.key) is not None
        status = opened.status()
        assert "s3cret-pw" not in str(status)
        assert status["database"].startswith("postgresql+psycopg://postgres:***@")


@pytest.mark.postgres
@pytest.mark.parametrize("trouble", ["locked", "read_only", "down"])
def test_postgres_trouble_falls_back_then_imports(
    pg_url: str, tmp_path: Path, trouble: str
) -> None:
    """A write never fails, on PostgreSQL too: a locked table (``lock_timeout``), a read-only
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
        assert recovered.storage.records.get_record(receipt.key) is not None
        assert recovered.drain(timeout=60).ok
        (row,) = recovered.storage.deliveries.deliveries_for([receipt.key])[receipt.key]
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
        dispatcher = served.dispatcher()
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
                (row,) = writer.storage.deliveries.deliveries_for([receipt.key])[receipt.key]
                if row.state == DELIVERED:
                    break
                time.sleep(0.1)
            assert row is not None and row.state == DELIVERED
        finally:
            stop.set()
            runner.join(60)
            dispatcher.close()
        assert not runner.is_alive()


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
