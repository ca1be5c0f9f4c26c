"""The storage contract as a test suite any backend can run: subclass ``StorageConformance``.

The dispatcher's guarantees rest on a handful of properties of ``Storage``: a claim leases
only due rows and never the same row twice, a settle only lands for the lease's owner, dead
letters and pruning touch only what they should, and a record is found by the lexical recall
as soon as it is written. Every test here checks one of them through the storage parts alone.

    class TestMyBackend(StorageConformance):
        @pytest.fixture
        def storage(self) -> Iterator[Storage]:
            ...  # a Storage over a new, migrated, empty database

The subclass (or a conftest) provides the ``storage`` fixture; the tests also use pytest's
``tmp_path``. This module does not import pytest itself, so the library never does either.
Times are passed explicitly (``now=``) wherever the interface takes them, so no assertion
depends on how fast the machine is.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sqlalchemy import Engine, select

from outbox.core.record import build_record
from outbox.core.states import DeliveryState
from outbox.store.heartbeats import Heartbeat
from outbox.store.schema import FRONTIER_NODE_ID, deliveries, graph_edges, graph_nodes, records
from outbox.store.storage import Storage
from outbox.testing.storage_helpers import (
    FIRST,
    LEASE,
    ORIGIN,
    SECOND,
    SINKS,
    assert_partitioned,
    claim_all,
    claim_process,
    engine_like,
    ids,
    kill,
    rows_by_id,
    run_processes,
    seed,
    table_counts,
)

PENDING, LEASED = DeliveryState.PENDING, DeliveryState.LEASED
DELIVERED, DEAD, DISCARDED = DeliveryState.DELIVERED, DeliveryState.DEAD, DeliveryState.DISCARDED


class StorageConformance:
    """The storage contract. Subclasses provide a ``storage`` fixture: a ``Storage`` over a
    new, migrated, empty database (which may already hold the frontier anchor node)."""

    # -- the write path ---------------------------------------------------------------------

    def test_insert_writes_record_node_edge_and_one_delivery_per_sink(
        self, storage: Storage
    ) -> None:
        metadata = {"session_id": "s-1", "agent": "neo", "nested": {"n": [1, 2.5, None, True]}}
        record = build_record(
            "Chose PostgreSQL for the shared deployment — «naïve» quotes ' \" kept",
            importance=8,
            tags=["decision", "storage", "ünïcode"],
            metadata=metadata,
        )
        with storage.engine.begin() as conn:
            seq = storage.records.insert_record(
                conn, record, sinks=SINKS, markdown_name="a.md", origin=ORIGIN, now=10.5
            )
        stored = storage.records.get_record(record.key)
        assert stored is not None and stored.seq == seq
        assert stored.record == record
        assert (stored.markdown_name, stored.origin, stored.created_at) == ("a.md", ORIGIN, 10.5)
        with storage.engine.connect() as conn:
            node = conn.execute(select(graph_nodes).where(graph_nodes.c.id == record.key)).one()
            edges = conn.execute(select(graph_edges).where(graph_edges.c.target == record.key))
            edge_rows = edges.all()
        assert node.label == "AGENT_MEMORY"
        assert (node.session_id, node.agent, node.ts) == ("s-1", "neo", record.timestamp)
        assert node.properties["semanticVectorId"] == record.key
        assert node.properties["importance"] == 8
        assert [(e.source, e.type, e.weight) for e in edge_rows] == [
            (FRONTIER_NODE_ID, "SPAWNED_MEMORY", 0.8)
        ]
        rows = storage.deliveries.deliveries_for([record.key])[record.key]
        assert sorted(row.sink for row in rows) == sorted(SINKS)
        assert all(row.state == PENDING and row.attempts == 0 for row in rows)

    def test_duplicate_key_writes_nothing(self, storage: Storage) -> None:
        (key,) = seed(storage, 1, now=1.0)
        before = table_counts(storage.engine)
        record = build_record("m memory number 0", timestamp="2026-11-29T09:00:00+01:00")
        assert record.key == key, "the same instant in another notation is the same key"
        with storage.engine.begin() as conn:
            seq = storage.records.insert_record(
                conn, record, sinks=SINKS, markdown_name="other.md", origin="x", now=2.0
            )
        assert seq is None
        assert table_counts(storage.engine) == before

    def test_lookup_finds_the_key_and_a_name_another_key_owns(self, storage: Storage) -> None:
        first, second = seed(storage, 2, now=1.0)
        with storage.engine.begin() as conn:
            assert storage.records.lookup(conn, first, "m-0.md") == (True, False)
            assert storage.records.lookup(conn, first, "m-1.md") == (True, True)
            assert storage.records.lookup(conn, "0" * 64, "m-1.md") == (False, True)
            assert storage.records.lookup(conn, "0" * 64, "new.md") == (False, False)
            storage.records.rename_markdown(conn, second, "renamed.md")
            assert storage.records.lookup(conn, "0" * 64, "m-1.md") == (False, False)
        renamed = storage.records.get_record(second)
        assert renamed is not None and renamed.markdown_name == "renamed.md"

    def test_reads_keep_order_and_float_times_exactly(self, storage: Storage) -> None:
        now = 1_764_403_200.123456
        keys = seed(storage, 5, now=now)
        after = storage.records.records_after(ORIGIN, 0, limit=3)
        assert [item.record.key for item in after] == keys[:3]
        rest = storage.records.records_after(ORIGIN, after[-1].seq)
        assert [item.record.key for item in rest] == keys[3:]
        assert [item.record.key for item in storage.records.iter_records(ORIGIN, batch=2)] == keys
        assert set(storage.records.get_records([*keys, "unknown"])) == set(keys)
        assert storage.records.count_records() == 5
        rows = storage.deliveries.deliveries_for(keys)
        assert all(
            row.available_at == now and row.created_at == now for r in rows.values() for row in r
        )
        assert storage.deliveries.next_due_at([FIRST]) == now

    def test_an_inserted_record_is_found_by_the_lexical_recall(self, storage: Storage) -> None:
        """On SQLite the insert writes the record's FTS row; PostgreSQL's expression index
        needs none. The pending overlay finds the record until its vector sink has it, the
        lexical leg always."""
        seed(storage, 3, sinks=(SECOND,), now=1.0)
        record = build_record("the heron nests by the quarry lake")
        with storage.engine.begin() as conn:
            storage.records.insert_record(
                conn, record, sinks=(FIRST,), markdown_name="heron.md", origin=ORIGIN, now=1.0
            )
        recall = storage.recall
        for vector_sink in (FIRST, None):
            hits = recall.pending_matches("heron quarry", vector_sink=vector_sink, limit=5)
            assert [key for key, _score in hits] == [record.key]
        (claim,) = storage.deliveries.claim(FIRST, "a", limit=10, lease_seconds=LEASE, now=2.0)
        settled = storage.deliveries.settle(
            "a", [(claim.delivery_id, "vector-id")], [], now=3.0, purge_search_index=True
        )
        assert settled == ([claim.delivery_id], [])
        assert recall.pending_matches("heron", vector_sink=FIRST, limit=5) == []
        # The lexical leg searches every record: delivery leaves the search index alone.
        assert [key for key, _ in recall.lexical("heron", limit=5).hits] == [record.key]

    # -- claims and leases ------------------------------------------------------------------

    def test_claim_takes_due_rows_only_and_respects_limit(self, storage: Storage) -> None:
        t0 = 1_000_000.0
        seed(storage, 10, sinks=(FIRST,), now=t0)
        claim = storage.deliveries.claim
        first = claim(FIRST, "a", limit=4, lease_seconds=LEASE, now=t0)
        assert len(first) == 4
        assert all(c.sink == FIRST and c.attempts == 1 for c in first)
        assert claim(SECOND, "a", limit=100, lease_seconds=LEASE, now=t0) == []
        # Push two rows into the future, as a retry would.
        failed = [(i, "boom", "transport_closed", t0 + 500.0) for i in ids(first[:2])]
        assert storage.deliveries.settle("a", [], failed, now=t0) == ([], ids(first[:2]))
        rest = claim(FIRST, "b", limit=100, lease_seconds=LEASE, now=t0 + 1)
        assert len(rest) == 6, "only pending rows past their retry time, never live leases"
        assert not set(ids(rest)) & set(ids(first))
        assert claim(FIRST, "b", limit=100, lease_seconds=LEASE, now=t0 + 499) == []
        later = claim(FIRST, "b", limit=100, lease_seconds=LEASE, now=t0 + 500)
        assert sorted(ids(later)) == sorted(ids(first[:2]))
        assert all(c.attempts == 2 for c in later)

    def test_claim_skips_live_leases_and_retakes_expired_ones(self, storage: Storage) -> None:
        t0 = 2_000_000.0
        seed(storage, 3, sinks=(FIRST,), now=t0)
        claim = storage.deliveries.claim
        taken = claim(FIRST, "a", limit=10, lease_seconds=LEASE, now=t0)
        assert len(taken) == 3
        assert claim(FIRST, "b", limit=10, lease_seconds=LEASE, now=t0 + LEASE - 1) == []
        retaken = claim(FIRST, "b", limit=10, lease_seconds=LEASE, now=t0 + LEASE + 1)
        assert sorted(ids(retaken)) == sorted(ids(taken))
        assert all(c.attempts == 2 for c in retaken), "a lost lease still counts an attempt"
        rows = rows_by_id(storage.engine)
        assert {rows[i].lease_owner for i in ids(retaken)} == {"b"}
        assert {rows[i].state for i in ids(retaken)} == {LEASED}

    def test_renew_extends_only_the_owners_rows(self, storage: Storage) -> None:
        seed(storage, 4, sinks=(FIRST,), now=time.time())
        mine = storage.deliveries.claim(FIRST, "a", limit=2, lease_seconds=5.0)
        theirs = storage.deliveries.claim(FIRST, "b", limit=2, lease_seconds=5.0)
        before = rows_by_id(storage.engine)
        renew = storage.deliveries.renew
        assert renew("a", ids(mine) + ids(theirs), lease_seconds=3600.0) == 2
        assert renew("c", ids(mine), lease_seconds=3600.0) == 0
        assert renew("a", [], lease_seconds=3600.0) == 0
        after = rows_by_id(storage.engine)
        for i in ids(mine):
            assert after[i].lease_expires_at > before[i].lease_expires_at + 3000
            assert after[i].available_at == after[i].lease_expires_at
        for i in ids(theirs):
            assert after[i].lease_expires_at == before[i].lease_expires_at
            assert after[i].lease_owner == "b"

    def test_settle_is_guarded_by_lease_ownership(self, storage: Storage) -> None:
        """A dispatcher whose lease expired must not overwrite the new owner's row."""
        t0 = 3_000_000.0
        seed(storage, 2, sinks=(FIRST,), now=t0)
        slow = storage.deliveries.claim(FIRST, "slow", limit=2, lease_seconds=10.0, now=t0)
        fresh = storage.deliveries.claim(FIRST, "fresh", limit=2, lease_seconds=10.0, now=t0 + 11)
        assert sorted(ids(fresh)) == sorted(ids(slow))
        one, two = sorted(ids(slow))
        settle = storage.deliveries.settle
        late = settle("slow", [(one, "late-id")], [(two, "late error", "unknown", None)], t0 + 12)
        assert late == ([], [])
        rows = rows_by_id(storage.engine)
        assert {rows[i].state for i in (one, two)} == {LEASED}
        assert {rows[i].lease_owner for i in (one, two)} == {"fresh"}
        assert rows[one].sink_id is None and rows[two].last_error is None
        failed = [(two, "Transport closed", "transport_closed", t0 + 60)]
        assert settle("fresh", [(one, "sink-1")], failed, t0 + 13) == ([one], [two])
        rows = rows_by_id(storage.engine)
        done = rows[one]
        assert (done.state, done.sink_id, done.delivered_at) == (DELIVERED, "sink-1", t0 + 13)
        assert done.lease_owner is None and done.mirror_pending == 1
        retry = rows[two]
        assert (retry.state, retry.available_at, retry.error_class) == (
            PENDING,
            t0 + 60,
            "transport_closed",
        )
        assert retry.attempts == 2 and retry.lease_owner is None
        # Settling a delivered row again (a duplicate settle) changes nothing.
        assert settle("fresh", [(one, "sink-2")], [], t0 + 14) == ([], [])
        assert rows_by_id(storage.engine)[one].sink_id == "sink-1"

    def test_release_returns_rows_without_counting_the_attempt(self, storage: Storage) -> None:
        t0 = time.time()  # release() stamps the wall clock, so the leases must be real ones
        seed(storage, 4, sinks=(FIRST,), now=t0)
        mine = storage.deliveries.claim(FIRST, "a", limit=3, lease_seconds=LEASE, now=t0)
        theirs = storage.deliveries.claim(FIRST, "b", limit=3, lease_seconds=LEASE, now=t0)
        assert len(mine) == 3 and len(theirs) == 1
        assert storage.deliveries.release("a", [mine[0].delivery_id]) == 1
        assert storage.deliveries.release("c") == 0
        assert storage.deliveries.release("a") == 2
        rows = rows_by_id(storage.engine)
        for i in ids(mine):
            assert (rows[i].state, rows[i].attempts, rows[i].lease_owner) == (PENDING, 0, None)
        (other,) = ids(theirs)
        assert (rows[other].state, rows[other].attempts) == (LEASED, 1)
        again = storage.deliveries.claim(FIRST, "c", limit=10, lease_seconds=LEASE)
        assert sorted(ids(again)) == sorted(ids(mine))
        assert all(claim.attempts == 1 for claim in again)

    # -- dead letters, pruning, status ------------------------------------------------------

    def test_dead_letters_requeue_and_discard(self, storage: Storage) -> None:
        t0 = 5_000_000.0
        keys = seed(storage, 3, now=t0)
        dead = ids(kill(storage, FIRST, 3, t0)) + ids(kill(storage, SECOND, 3, t0))
        store = storage.deliveries
        assert {row.delivery_id for row in store.list_deliveries(DEAD)} == set(dead)
        assert store.claim(FIRST, "a", limit=10, lease_seconds=LEASE, now=t0 + 10**6) == []
        assert store.requeue_dead([keys[0]], sink=FIRST) == 1
        assert store.requeue_dead(None, sink=SECOND) == 3
        assert store.requeue_dead([keys[0]], sink=FIRST) == 0, "no longer dead"
        rows = {(r.key, r.sink): r for rs in store.deliveries_for(keys).values() for r in rs}
        assert (rows[keys[0], FIRST].state, rows[keys[0], FIRST].attempts) == (PENDING, 0)
        assert rows[keys[1], FIRST].state == DEAD
        assert all(rows[key, SECOND].state == PENDING for key in keys)
        assert store.discard_dead(None) == 2
        assert store.list_deliveries(DEAD) == []
        assert len(store.list_deliveries(DISCARDED, sink=FIRST)) == 2
        assert store.requeue_dead(None) == 0, "discarded letters stay discarded"
        claimed = store.claim(FIRST, "a", limit=10, lease_seconds=LEASE)
        assert [claim.key for claim in claimed] == [keys[0]]

    def test_prune_deletes_only_mirrored_delivered_rows_past_the_cutoff(
        self, storage: Storage
    ) -> None:
        t0 = 6_000_000.0
        keys = seed(storage, 4, now=t0)
        store = storage.deliveries
        claims = {c.key: c for c in store.claim(FIRST, "a", limit=4, lease_seconds=LEASE, now=t0)}
        old_done, old_unmirrored, new_done, _still_pending = keys
        store.settle("a", [(claims[old_done].delivery_id, "x")], [], now=t0 + 1)
        store.settle("a", [(claims[old_unmirrored].delivery_id, "y")], [], now=t0 + 1)
        store.settle("a", [(claims[new_done].delivery_id, "z")], [], now=t0 + 100)
        store.release("a")
        (second,) = store.claim(SECOND, "a", limit=1, lease_seconds=LEASE, now=t0)
        store.settle("a", [(second.delivery_id, "n")], [], now=t0 + 1)
        mirrored = {claims[old_done].delivery_id, claims[new_done].delivery_id, second.delivery_id}
        storage.mirror_state.clear_mirror_pending(
            [
                row
                for row in storage.mirror_state.mirror_pending(ORIGIN)
                if row.delivery_id in mirrored
            ]
        )
        assert store.prune_delivered([FIRST], older_than=t0 + 50) == 1
        remaining = {(r.key, r.sink) for rs in store.deliveries_for(keys).values() for r in rs}
        assert (old_done, FIRST) not in remaining
        assert {(old_unmirrored, FIRST), (new_done, FIRST), (keys[3], FIRST)} <= remaining
        assert (second.key, SECOND) in remaining, "a sink not named is not pruned"
        assert storage.records.get_record(old_done) is not None, "the record itself stays"
        assert store.prune_delivered([FIRST, SECOND], older_than=t0 + 50) == 1
        assert store.prune_delivered([FIRST, SECOND], older_than=t0 + 50) == 0

    def test_counts_and_oldest_pending(self, storage: Storage) -> None:
        store = storage.deliveries
        assert store.counts() == {} and store.oldest_pending() == {}
        seed(storage, 3, now=100.0)
        seed(storage, 2, sinks=(FIRST,), now=200.0, prefix="late")
        claims = store.claim(FIRST, "a", limit=2, lease_seconds=LEASE, now=300.0)
        store.settle("a", [(claims[0].delivery_id, "id")], [], now=300.0)
        counts = store.counts()
        assert set(counts) == set(SINKS)
        assert all(set(per_state) == set(DeliveryState) for per_state in counts.values())
        assert counts[FIRST] == {
            PENDING: 3,
            LEASED: 1,
            DELIVERED: 1,
            DEAD: 0,
            DISCARDED: 0,
            DeliveryState.FORGOTTEN: 0,
        }
        assert counts[SECOND][PENDING] == 3
        assert store.oldest_pending() == {FIRST: 100.0, SECOND: 100.0}
        everything = store.claim(SECOND, "a", limit=10, lease_seconds=LEASE, now=300.0)
        store.settle("a", [(c.delivery_id, "id") for c in everything], [], now=300.0)
        assert store.oldest_pending() == {FIRST: 100.0}

    def test_pending_summary_counts_to_its_cap_and_finds_the_oldest(self, storage: Storage) -> None:
        """The count stops at the cap; the oldest undelivered row (pending or leased) is
        found whatever lies between."""
        t0 = 7_000_000.0
        seed(storage, 30, sinks=(FIRST,), now=t0, prefix="old")
        seed(storage, 40, sinks=(FIRST,), now=t0 + 100, prefix="new")
        store = storage.deliveries
        assert store.pending_summary(FIRST, cap=25) == (25, t0)
        assert store.pending_summary(FIRST, cap=1000) == (70, t0)
        claimed = store.claim(FIRST, "me", limit=30, lease_seconds=60, now=t0 + 200)
        assert len(claimed) == 30
        assert store.pending_summary(FIRST) == (70, t0)  # leased rows are still undelivered
        store.settle("me", [(row.delivery_id, "id") for row in claimed], [], now=t0 + 300)
        assert store.pending_summary(FIRST) == (40, t0 + 100)
        assert store.pending_summary("another-sink") == (0, None)

    # -- mirrors ----------------------------------------------------------------------------

    def test_mirror_watermark_round_trip(self, storage: Storage) -> None:
        state = storage.mirror_state
        assert state.mirror_watermark("host-a") == (0, 0, None)
        state.set_mirror_watermark("host-a", 5, 1234, "ab" * 32)
        assert state.mirror_watermark("host-a") == (5, 1234, "ab" * 32)
        big = (2**40, 2**33 + 7, None)  # past 32 bits: BIGINT on PostgreSQL
        state.set_mirror_watermark("host-a", *big)
        assert state.mirror_watermark("host-a") == big
        assert state.mirror_watermark("host-b") == (0, 0, None)

    def test_mirror_pending_returns_the_origins_rows_oldest_first(self, storage: Storage) -> None:
        t0 = 6_000_000.0
        seed(storage, 6, sinks=(FIRST,), now=t0, prefix="here", origin="here")
        seed(storage, 6, sinks=(FIRST,), now=t0, prefix="elsewhere", origin="elsewhere")
        claims = storage.deliveries.claim(FIRST, "a", limit=12, lease_seconds=60.0, now=t0)
        storage.deliveries.settle("a", [(c.delivery_id, "id") for c in claims], [], now=t0 + 1)
        with storage.engine.connect() as conn:
            here = list(
                conn.execute(
                    select(deliveries.c.id)
                    .join(records, records.c.key == deliveries.c.record_key)
                    .where(records.c.origin == "here")
                    .order_by(deliveries.c.id)
                ).scalars()
            )
        state = storage.mirror_state
        assert [row.delivery_id for row in state.mirror_pending("here")] == here
        assert [row.delivery_id for row in state.mirror_pending("here", limit=4)] == here[:4]
        state.clear_mirror_pending(state.mirror_pending("here", limit=2))
        state.clear_mirror_pending([])
        assert [row.delivery_id for row in state.mirror_pending("here")] == here[2:]

    def test_owed_reads_the_owed_outcomes_with_every_row_of_their_records(
        self, storage: Storage
    ) -> None:
        """The delivery sync's one read: the origin's owed outcomes as ``mirror_pending``
        pages them, and each of their records' rows, settled, leased or pending alike."""
        t0 = 6_500_000.0
        keys = seed(storage, 4, now=t0, prefix="here", origin="here")
        seed(storage, 2, now=t0, prefix="elsewhere", origin="elsewhere")
        store, state = storage.deliveries, storage.mirror_state
        firsts = store.claim(FIRST, "a", limit=6, lease_seconds=LEASE, now=t0)
        store.settle("a", [(c.delivery_id, f"id-{c.key}") for c in firsts], [], now=t0 + 1)
        store.claim(SECOND, "b", limit=1, lease_seconds=LEASE, now=t0 + 2)  # one leased row
        owed, rows = state.owed("here")
        assert owed == state.mirror_pending("here")
        assert {row.key for row in owed} == set(keys) == set(rows)
        assert rows == store.deliveries_for(keys)
        assert all([row.sink for row in rows[key]] == [FIRST, SECOND] for key in keys), (
            "the other sink's row comes too"
        )
        page, page_rows = state.owed("here", limit=2)
        assert page == state.mirror_pending("here", limit=2)
        assert set(page_rows) == {row.key for row in page}
        rest, _ = state.owed("here", after=max(row.delivery_id for row in page))
        assert rest == [row for row in owed if row.key not in page_rows], "the page past it"
        state.clear_mirror_pending(owed)
        assert state.owed("here") == ([], {})

    def test_an_outcome_settled_again_while_being_mirrored_keeps_its_flag(
        self, storage: Storage
    ) -> None:
        """The mirror sync reads a row, a dispatcher settles it again (another attempt),
        then the sync clears what it read: the newer outcome must still get its line."""
        (key,) = seed(storage, 1, sinks=(FIRST,), now=100.0)
        store = storage.deliveries
        (claim,) = store.claim(FIRST, "a", limit=1, lease_seconds=LEASE, now=101.0)
        store.settle("a", [], [(claim.delivery_id, "busy", "db_busy", 102.0)], now=101.5)
        (read,) = storage.mirror_state.mirror_pending(ORIGIN)
        assert (read.state, read.attempts) == (PENDING, 1)
        (again,) = store.claim(FIRST, "b", limit=1, lease_seconds=LEASE, now=103.0)
        store.settle("b", [(again.delivery_id, "id-2")], [], now=104.0)
        storage.mirror_state.clear_mirror_pending([read])
        (left,) = storage.mirror_state.mirror_pending(ORIGIN)
        assert (left.key, left.state, left.attempts) == (key, DELIVERED, 2)
        storage.mirror_state.clear_mirror_pending([left])
        assert storage.mirror_state.mirror_pending(ORIGIN) == []

    # -- concurrency ------------------------------------------------------------------------

    def test_two_threads_never_claim_the_same_row(self, storage: Storage, tmp_path: Path) -> None:
        total = 400
        seed(storage, total, sinks=(FIRST,), now=time.time() - 1)
        engines = [engine_like(storage, tmp_path / f"thread-{n}") for n in range(2)]
        start = threading.Barrier(2)
        results: dict[str, list[int]] = {}
        errors: list[BaseException] = []

        def work(owner: str, engine: Engine) -> None:
            try:
                results[owner] = claim_all(Storage(engine), owner, start)
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
        assert_partitioned(storage.engine, list(results.values()), total)

    def test_two_processes_never_claim_the_same_row(self, storage: Storage, tmp_path: Path) -> None:
        total = 600
        seed(storage, total, sinks=(FIRST,), now=time.time() - 1)
        url = storage.engine.url.render_as_string(hide_password=False)
        args = [(url, str(tmp_path / f"proc-{n}"), f"proc-{n}") for n in range(2)]
        results = run_processes(claim_process, args)
        assert_partitioned(storage.engine, [got for _owner, got in results], total)

    # -- dispatcher heartbeats --------------------------------------------------------------

    def test_heartbeats_replace_their_owners_row_and_tell_alive_gone_and_stopped(
        self, storage: Storage
    ) -> None:
        def beat(owner: str, at: float, delivered: int) -> Heartbeat:
            return Heartbeat(
                owner=owner,
                host="box",
                pid=7,
                sinks=("chroma", "brainlayer"),
                started_at=100.0,
                beat_at=at,
                gone_after=20.0,
                last_batch_at=at - 0.5,
                delivered=delivered,
                failed=1,
                records_per_second=12.5,
            )

        storage.heartbeats.beat(beat("a", 110.0, 5))
        storage.heartbeats.beat(beat("a", 115.25, 9))  # the same owner: one row, replaced
        storage.heartbeats.beat(beat("b", 112.0, 0))
        found = {hb.owner: hb for hb in storage.heartbeats.all()}
        assert found["a"] == beat("a", 115.25, 9), "every field comes back exactly"
        assert [hb.state(133.0) for hb in (found["a"], found["b"])] == ["alive", "gone"]
        storage.heartbeats.stop("a", 140.0)
        stopped = {hb.owner: hb for hb in storage.heartbeats.all()}["a"]
        assert (stopped.stopped_at, stopped.state(500.0)) == (140.0, "stopped")
        assert storage.heartbeats.prune(before=113.0) == 1  # b's last beat is older
        assert [hb.owner for hb in storage.heartbeats.all()] == ["a"]

    # -- where each machine's mirrors live --------------------------------------------------

    def test_locations_are_recorded_once_per_mirror_and_replaced_only_on_purpose(
        self, storage: Storage, tmp_path: Path
    ) -> None:
        from outbox.store.steady import MirrorPlaces

        first = MirrorPlaces(tmp_path / "a" / "outbox.jsonl", tmp_path / "a" / "md")
        second = MirrorPlaces(tmp_path / "b" / "outbox.jsonl", tmp_path / "b" / "md")
        places = storage.locations
        assert places.recorded("machine-1") is None
        places.record("machine-1", first)
        places.record("machine-1", second)  # a later open never overwrites the first one's
        places.record("machine-2", second)
        assert places.recorded("machine-1") == first
        assert places.recorded("machine-2") == second
        places.record("machine-1", second, replace=True)  # a store moved whole
        assert places.recorded("machine-1") == second

    # -- forget -----------------------------------------------------------------------------

    def test_forget_tombstones_the_record_and_turns_each_row_into_a_delete(
        self, storage: Storage
    ) -> None:
        from outbox.core.states import DeliveryOp
        from outbox.store.steady import MIRRORS_DUE, PURGE_DUE

        delivered_key, untried_key = seed(storage, 2, now=100.0, prefix="forget")
        claimed = [
            claim
            for sink in SINKS
            for claim in storage.deliveries.claim(sink, "d1", 10, LEASE, now=101.0)
        ]
        mine = [(c.delivery_id, "id-1") for c in claimed if c.key == delivered_key]
        storage.deliveries.settle("d1", mine, [], 102.0)
        storage.deliveries.release("d1")  # the untried record's rows: never sent
        plan = storage.forgetting.forget(delivered_key, [*SINKS, "extra"], now=103.0)
        assert plan is not None and not plan.already
        assert (plan.deletes, plan.never_sent) == (sorted([*SINKS, "extra"]), [])
        untried = storage.forgetting.forget(untried_key, SINKS, now=103.5)
        assert untried is not None and (untried.deletes, untried.never_sent) == ([], sorted(SINKS))
        again = storage.forgetting.forget(delivered_key, SINKS, now=104.0)
        assert again is not None and again.already and again.deletes == []
        assert storage.forgetting.forget("0" * 64, SINKS) is None
        counts = storage.records.counts()  # forgotten ones are not records any more
        assert (counts.live, counts.forgotten) == (0, 2) and storage.records.count_records() == 0
        item = storage.records.get_record(delivered_key)
        assert item is not None and item.forgotten and item.forgotten_at == 103.0
        assert (item.record.content, item.record.tags, item.record.metadata) == ("", (), {})
        with storage.engine.connect() as conn:
            node = conn.execute(select(graph_nodes).where(graph_nodes.c.id == delivered_key))
            assert node.first() is None
        rows = storage.deliveries.deliveries_for([delivered_key, untried_key])
        assert {(r.sink, r.op, r.state, r.attempts) for r in rows[delivered_key]} == {
            (sink, DeliveryOp.DELETE, PENDING, 0) for sink in [*SINKS, "extra"]
        }
        assert {(r.op, r.state, r.attempts) for r in rows[untried_key]} == {
            (DeliveryOp.DELETE, DeliveryState.FORGOTTEN, 0)
        }
        # A delete is claimed like a delivery and settled as forgotten, its line still due.
        deletes = storage.deliveries.claim(FIRST, "d2", 10, LEASE, now=105.0)
        assert [(c.key, c.op) for c in deletes] == [(delivered_key, DeliveryOp.DELETE)]
        done, _ = storage.deliveries.settle("d2", [], [], 106.0, deleted=ids(deletes))
        assert done == ids(deletes)
        (row,) = [
            r
            for r in storage.deliveries.deliveries_for([delivered_key])[delivered_key]
            if r.sink == FIRST
        ]
        assert (row.state, row.mirror_pending) == (DeliveryState.FORGOTTEN, True)
        # What the forget still owes: the mirrors, then the purge.
        due = storage.forgetting.mirrors_due(ORIGIN)
        assert sorted(i.record.key for i in due) == sorted([delivered_key, untried_key])
        assert {i.markdown_name for i in due} == {"forget-0.md", "forget-1.md"}
        storage.forgetting.mirrors_done([delivered_key, untried_key])
        assert storage.forgetting.mirrors_due(ORIGIN) == []
        assert storage.records.get_record(delivered_key).markdown_name == ""  # type: ignore[union-attr]
        assert storage.forgetting.purge_due() == 2
        result = storage.forgetting.purge()
        assert (result.records, result.complete) == (2, True)
        assert storage.forgetting.purge_due() == 0
        assert (MIRRORS_DUE, PURGE_DUE) == (1, 2)

    def test_a_forget_takes_a_leased_row_from_its_dispatcher(self, storage: Storage) -> None:
        (key,) = seed(storage, 1, now=100.0, prefix="race")
        leased = storage.deliveries.claim(FIRST, "slow", 10, LEASE, now=101.0)
        storage.forgetting.forget(key, SINKS, now=102.0)
        # The dispatcher comes back with a delivery: the row is no longer its to settle.
        done, _ = storage.deliveries.settle("slow", [(c.delivery_id, "late") for c in leased], [])
        assert done == []
        (row,) = [r for r in storage.deliveries.deliveries_for([key])[key] if r.sink == FIRST]
        assert (row.op, row.state, row.sink_id) == ("delete", PENDING, None)
