"""The durable write (contract sections 2, 3, 5): one transaction, idempotent by key, whatever
the interleaving of threads and processes, and file names that never overwrite each other."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from outbox import Outbox, Receipt, Settings, load_settings
from outbox.core.record import build_record
from outbox.core.states import FallbackReason
from outbox.store.schema import deliveries, graph_edges, graph_nodes, records
from tests.conftest import FAULTY
from tests.helpers.subproc import WRITER, child_env

TS = "2026-11-29T08:00:00.000000Z"


def accepted_lines(ob: Outbox) -> list[dict[str, object]]:
    assert ob.wait_mirrored(10)  # a receipt promises the commit; the mirrors follow it
    return [
        line.event for line in ob.mirrors.jsonl.lines() if line.event.get("event") == "accepted"
    ]


def markdown_files(ob: Outbox) -> list[Path]:
    assert ob.wait_mirrored(10)
    return sorted(ob.markdown_dir.glob("*.md")) if ob.markdown_dir.exists() else []


def table_count(ob: Outbox, table: object) -> int:
    with ob.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())  # type: ignore[arg-type]


def assert_exactly_once(ob: Outbox, key: str) -> None:
    """One row, one accepted line, one markdown file, and the mirrors agree."""
    with ob.engine.connect() as conn:
        assert (
            conn.execute(
                select(func.count()).select_from(records).where(records.c.key == key)
            ).scalar_one()
            == 1
        )
    assert [line["key"] for line in accepted_lines(ob)].count(key) == 1
    assert len(markdown_files(ob)) == 1
    report = ob.verify()
    assert report.ok, report.problems


def test_one_add_commits_record_node_edge_and_one_delivery_per_sink(tmp_path: Path) -> None:
    settings = load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks=f"{FAULTY},outbox.testing.sinks:NoopSink",
    )
    with Outbox.open(settings) as ob:
        receipt = ob.add("a memory with two sinks", importance=7, tags=["a", "b"], timestamp=TS)
        assert receipt.status == "queued"
        assert not receipt.duplicate
        assert receipt.text == f"Queued {receipt.key} for FaultySink, NoopSink"
        with ob.engine.connect() as conn:
            row = conn.execute(select(records).where(records.c.key == receipt.key)).one()
            node = conn.execute(select(graph_nodes).where(graph_nodes.c.id == receipt.key)).one()
            edges = conn.execute(
                select(graph_edges).where(graph_edges.c.target == receipt.key)
            ).all()
            sinks = conn.execute(
                select(deliveries.c.sink, deliveries.c.state, deliveries.c.attempts).where(
                    deliveries.c.record_key == receipt.key
                )
            ).all()
        assert (row.content, row.importance, row.tags, row.ts) == (
            "a memory with two sinks",
            7,
            ["a", "b"],
            TS,
        )
        assert node.label == "AGENT_MEMORY"
        assert [(edge.source, edge.type) for edge in edges] == [("frontier", "SPAWNED_MEMORY")]
        assert sorted(sinks) == sorted(
            [(FAULTY, "pending", 0), ("outbox.testing.sinks:NoopSink", "pending", 0)]
        )


def test_repeat_returns_the_existing_record_marked_duplicate(outbox: Outbox) -> None:
    first = outbox.add("remember this once", timestamp="2026-11-29T09:00:00+01:00", tags=["x"])
    again = outbox.add("remember this once", timestamp=TS, importance=9, tags=["other"])
    assert not first.duplicate
    assert again.duplicate
    assert (again.key, again.markdown_path, again.timestamp) == (
        first.key,
        first.markdown_path,
        first.timestamp,
    )
    assert_exactly_once(outbox, first.key)
    stored = outbox.storage.records.get_record(first.key)
    assert stored is not None
    assert (stored.record.importance, stored.record.tags) == (5, ("x",))  # first write wins
    assert table_count(outbox, deliveries) == 1
    assert table_count(outbox, graph_edges) == 1


def check_same_record_receipts(ob: Outbox, receipts: list[Receipt], calls: int) -> None:
    assert len(receipts) == calls
    assert sum(not receipt.duplicate for receipt in receipts) == 1
    assert len({receipt.key for receipt in receipts}) == 1
    assert len({receipt.markdown_path for receipt in receipts}) == 1
    assert_exactly_once(ob, receipts[0].key)
    assert table_count(ob, deliveries) == 1
    assert table_count(ob, graph_nodes) == 2  # the frontier anchor and this memory


@pytest.mark.parametrize("shared", [True, False], ids=["one-outbox", "outbox-per-thread"])
def test_threads_writing_the_same_record(settings: Settings, shared: bool) -> None:
    threads_count, per_thread = 8, 5
    common = Outbox.open(settings)
    barrier = threading.Barrier(threads_count)
    receipts: list[Receipt] = []
    errors: list[BaseException] = []
    guard = threading.Lock()

    def work() -> None:
        ob = common if shared else Outbox.open(settings)
        try:
            barrier.wait()
            for _ in range(per_thread):
                receipt = ob.add("the same memory from many threads", timestamp=TS)
                with guard:
                    receipts.append(receipt)
        except BaseException as exc:
            errors.append(exc)
        finally:
            if not shared:
                ob.close()

    threads = [threading.Thread(target=work) for _ in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    check_same_record_receipts(common, receipts, threads_count * per_thread)
    common.close()


def test_processes_writing_the_same_record_on_a_fresh_database(
    settings: Settings, tmp_path: Path
) -> None:
    """Separate processes that also race to create the database and run the migration."""
    processes_count, per_process = 4, 5
    go = tmp_path / "go"
    env = child_env(
        home=settings.home, markdown_dir=str(settings.markdown_dir), sinks=",".join(settings.sinks)
    )
    content = "the same memory from many processes"
    children = [
        subprocess.Popen(
            [sys.executable, str(WRITER), "same", content, TS, str(per_process), str(go)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(processes_count)
    ]
    time.sleep(0.5)
    go.touch()
    receipts: list[Receipt] = []
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err.decode()
        for line in out.decode().splitlines():
            data = json.loads(line)
            receipts.append(
                Receipt(
                    key=data["key"],
                    status=data["status"],
                    duplicate=data["duplicate"],
                    markdown_path=Path(data["markdown_path"]),
                    timestamp=data["timestamp"],
                )
            )
    with Outbox.open(settings) as ob:
        check_same_record_receipts(ob, receipts, processes_count * per_process)


# A small pool, so that a random program of writes repeats records often.
POOL = [(f"pooled memory number {n}", f"2026-11-{20 + n}T08:00:00Z") for n in range(5)]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    program=st.lists(
        st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=4), min_size=1, max_size=8
    )
)
def test_any_program_of_adds_and_batches_keeps_each_record_once(
    tmp_path_factory: pytest.TempPathFactory, program: list[list[int]]
) -> None:
    root = tmp_path_factory.mktemp("program")
    settings = load_settings(env={}, home=root / ".outbox", markdown_dir=root / "md", sinks=FAULTY)
    seen: dict[int, Receipt] = {}
    with Outbox.open(settings) as ob:
        for step in program:
            items = [{"content": POOL[i][0], "timestamp": POOL[i][1]} for i in step]
            receipts = ob.add_many(items) if len(step) > 1 else [ob.add(**items[0])]
            for index, receipt in zip(step, receipts, strict=True):
                if index in seen:
                    assert receipt.duplicate
                    assert (receipt.key, receipt.markdown_path) == (
                        seen[index].key,
                        seen[index].markdown_path,
                    )
                else:
                    assert not receipt.duplicate
                    seen[index] = receipt
        assert ob.storage.records.count_records() == len(seen)
        keys = [line["key"] for line in accepted_lines(ob)]
        assert sorted(keys) == sorted(receipt.key for receipt in seen.values())
        assert len(markdown_files(ob)) == len(seen)
        assert ob.verify().ok


def test_same_slug_same_day_never_overwrites(outbox: Outbox) -> None:
    first = outbox.add("first decision of the day", slug="Daily Decision", timestamp=TS)
    second = outbox.add(
        "second decision of the day", slug="daily-decision", timestamp="2026-11-29T17:00:00Z"
    )
    assert first.markdown_path is not None and second.markdown_path is not None
    assert first.markdown_path.name == "2026-11-29-daily-decision.md"
    assert second.markdown_path.name == f"2026-11-29-daily-decision-{second.key[:8]}.md"
    assert outbox.wait_mirrored(10)
    assert first.markdown_path.read_bytes().endswith(b"---\nfirst decision of the day")
    assert second.markdown_path.read_bytes().endswith(b"---\nsecond decision of the day")
    # Repeating either one writes no third file.
    assert outbox.add("second decision of the day", slug="x", timestamp="2026-11-29T17:00:00Z")
    assert len(markdown_files(outbox)) == 2
    other_day = outbox.add("third decision", slug="daily decision", timestamp="2026-11-30T01:00Z")
    assert other_day.markdown_path is not None
    assert other_day.markdown_path.name == "2026-11-30-daily-decision.md"
    assert outbox.verify().ok


def test_a_foreign_file_with_the_name_is_left_alone(outbox: Outbox) -> None:
    outbox.markdown_dir.mkdir(parents=True, exist_ok=True)
    foreign = outbox.markdown_dir / "2026-11-29-notes.md"
    foreign.write_text("my own notes, not the library's\n")
    receipt = outbox.add(
        "a memory whose slug collides with a hand-written file", slug="notes", timestamp=TS
    )
    assert foreign.read_text() == "my own notes, not the library's\n"
    assert receipt.markdown_path is not None
    assert receipt.markdown_path.name == f"2026-11-29-notes-{receipt.key[:8]}.md"
    assert outbox.verify().ok


def test_a_waiting_fallback_file_of_the_same_content_keeps_its_name(outbox: Outbox) -> None:
    """A derived name carries the content's hash, so only a fallback file of the same content
    (same day, another instant) can hold it; while one waits, the write looks the name up and
    takes its -<key8> name, as its receipt says."""
    content = "the same words, saved twice on one day"
    parked = build_record(content, timestamp="2026-11-29T08:00:00Z")
    fallback_path, _ = outbox.fallback.write(parked, FallbackReason.DB_BUSY)
    receipt = outbox.add(content, timestamp="2026-11-29T09:00:00Z")

    assert receipt.markdown_path is not None and receipt.markdown_path != fallback_path
    assert receipt.markdown_path.name == fallback_path.name[:-3] + f"-{receipt.key[:8]}.md"
    assert outbox.wait_mirrored(10)
    assert receipt.markdown_path.read_bytes().endswith(content.encode())
    assert outbox.markdown_path(receipt.key) == receipt.markdown_path
    outbox.sync_mirrors()  # imports the parked record under its own name
    assert outbox.markdown_path(parked.key) == fallback_path
    assert outbox.verify().ok


def test_add_many_is_one_transaction_with_per_item_receipts(outbox: Outbox) -> None:
    before = outbox.add("already there", timestamp=TS)
    receipts = outbox.add_many(
        [
            "plain string item",
            {"content": "mapping item", "importance": 9, "tags": ["t"], "timestamp": TS},
            {"content": "already there", "timestamp": TS},
            {"content": "mapping item", "timestamp": TS},
        ]
    )
    assert [receipt.duplicate for receipt in receipts] == [False, False, True, True]
    assert receipts[2].key == before.key
    assert receipts[3].key == receipts[1].key
    assert outbox.storage.records.count_records() == 3
    assert len(accepted_lines(outbox)) == 3
    assert len(markdown_files(outbox)) == 3
    assert outbox.verify().ok


def test_add_many_past_one_statements_rows_writes_every_row_of_every_record(
    tmp_path: Path,
) -> None:
    """The SQLite write path inserts a group's rows with multi-row statements of at most
    ``CHUNK`` rows; a group of more records than that, with two sinks (twice the delivery
    rows) and repeats, still writes each new record's node, edge, search entry and
    deliveries, once."""
    from outbox.store.sqlite_writes import CHUNK

    settings = load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks=f"{FAULTY},outbox.testing.sinks:NoopSink",
    )
    count = CHUNK + 37
    items = [
        {"content": f"bulk memory number {number}", "timestamp": TS} for number in range(count)
    ]
    with Outbox.open(settings) as ob:
        receipts = ob.add_many([*items, items[3], items[CHUNK + 1]])
        assert [receipt.duplicate for receipt in receipts] == [False] * count + [True, True]
        keys = {receipt.key for receipt in receipts}
        assert len(keys) == count
        with ob.engine.connect() as conn:
            node_ids = set(conn.execute(select(graph_nodes.c.id)).scalars())
            edge_targets = conn.execute(
                select(graph_edges.c.target).where(graph_edges.c.source == "frontier")
            ).scalars()
            delivered = conn.execute(select(deliveries.c.record_key, deliveries.c.sink)).all()
            searchable = conn.exec_driver_sql(
                "SELECT r.key FROM records_fts JOIN records r ON r.seq = records_fts.rowid "
                "WHERE records_fts MATCH 'bulk'"
            ).scalars()
            assert node_ids - {"frontier"} == keys
            assert sorted(edge_targets) == sorted(keys)
            assert sorted(searchable) == sorted(keys)
        assert len(delivered) == 2 * count
        assert {key for key, _ in delivered} == keys
        assert ob.verify().ok


def test_enqueue_commits_and_rolls_back_with_the_callers_transaction(outbox: Outbox) -> None:
    class Abort(Exception):
        pass

    with pytest.raises(Abort), outbox.engine.begin() as conn:
        rolled = outbox.enqueue(conn, "written inside a transaction that fails", timestamp=TS)
        raise Abort
    assert outbox.storage.records.get_record(rolled.key) is None
    assert table_count(outbox, deliveries) == 0

    with outbox.engine.begin() as conn:
        kept = outbox.enqueue(conn, "written inside a transaction that commits", timestamp=TS)
    assert outbox.storage.records.get_record(kept.key) is not None
    assert not outbox.verify().ok  # committed, not yet mirrored
    report = outbox.sync_mirrors()
    assert (report.lines_appended, report.files_written) == (1, 1)
    assert_exactly_once(outbox, kept.key)


def test_a_markdown_folder_removed_between_writes_is_made_again(outbox: Outbox) -> None:
    first = outbox.add("written before the folder goes away")
    assert outbox.wait_mirrored(10)
    for path in outbox.markdown_dir.iterdir():
        path.unlink()
    outbox.markdown_dir.rmdir()
    second = outbox.add("written after the folder went away")
    assert outbox.wait_mirrored(10)
    assert second.markdown_path.read_bytes().endswith(b"written after the folder went away")
    assert not first.markdown_path.exists()  # gone with the folder; repair brings it back
    outbox.sync_mirrors(full=True)
    assert first.markdown_path.exists()
