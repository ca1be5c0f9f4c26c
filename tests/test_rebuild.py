"""``outbox rebuild`` brings a lost or corrupt database back from the store's own files
(issue 13, point 7), through the real command and the files it leaves.

Each store is made by the library and delivered by ``outbox drain`` to the fault-injection
sink (one record refused for good, so one dead letter); the database is then deleted,
corrupted, replaced by an old copy or killed mid-rebuild. Afterwards ``outbox verify`` exits 0
and the records and every sink's state (with its id) are what they were.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from outbox import Outbox, Settings, load_settings
from outbox.core.record import build_record
from outbox.operations.rebuild import MARKER_NAME
from outbox.operations.rebuild_evidence import Evidence
from outbox.write.fallback import FallbackQueue
from tests.conftest import FAULTY
from tests.helpers.checks import jsonl_events
from tests.helpers.subproc import child_env, run_cli
from tests.pg import fresh_database

POISON = "poison-pill"
TS = "2026-03-0{day}T08:00:00Z"


def _env(settings: Settings, **extra: str) -> dict[str, str]:
    return child_env(
        settings.home,
        db_url=settings.db_url,
        markdown_dir=str(settings.markdown_dir),
        faulty_db=str(settings.home.parent / "sink.db"),
        faulty_reject=POISON,
        **extra,
    )


def _cli(settings: Settings, *args: str, **extra: str) -> subprocess.CompletedProcess[bytes]:
    return run_cli(list(args), cwd=settings.home.parent, env=_env(settings, **extra), timeout=300)


def _json(settings: Settings, *args: str) -> dict[str, Any]:
    done = _cli(settings, *args, "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert isinstance(payload, dict)
    return payload


def _state(settings: Settings) -> dict[str, Any]:
    """Every record (its fields) and every delivery (state, id, reason), as the database
    holds them, read by the library's own façade."""
    with Outbox.open(settings, repair=False) as ob:
        stored = list(ob.storage.records.iter_records())
        rows = ob.deliveries_of(item.record.key for item in stored)
    return {
        item.record.key: (
            item.record.content,
            item.record.timestamp,
            item.record.importance,
            item.record.tags,
            dict(item.record.metadata),
            item.markdown_name,
            sorted((r.sink, r.state, r.sink_id, r.error_class) for r in rows[item.record.key]),
        )
        for item in stored
    }


def _sink_deliveries(settings: Settings) -> dict[str, int]:
    with closing(sqlite3.connect(settings.home.parent / "sink.db")) as conn:
        return dict(conn.execute("SELECT key, deliveries FROM delivered").fetchall())


def _checkpoint(settings: Settings) -> None:
    """Move everything from the WAL into the database file itself."""
    with closing(sqlite3.connect(settings.home / "outbox.db")) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _lose(settings: Settings) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{settings.home / 'outbox.db'}{suffix}").unlink(missing_ok=True)


@pytest.fixture
def store(settings: Settings) -> Settings:
    """Six records delivered, one dead letter, two pending: made by the library and drained
    by the real command."""
    with Outbox.open(settings) as ob:
        for day in range(1, 7):
            ob.add(
                f"decision {day}: keep the audit trail in two places",
                importance=day,
                tags=["decision", f"day-{day}"],
                timestamp=TS.format(day=day),
                metadata={"session_id": f"s-{day}", "nested": {"n": [day, None, True]}},
            )
        ob.add(f"a memory the sink refuses: {POISON}", timestamp=TS.format(day=7))
    drained = _cli(settings, "drain")
    assert drained.returncode == 1, drained.stdout  # the poison pill is a dead letter
    with Outbox.open(settings) as ob:
        ob.add("written after the drain, still pending", tags=["late"])
        ob.add("another pending one", timestamp=TS.format(day=8))
    return settings


def test_a_deleted_database_comes_back_with_every_delivery_state(store: Settings) -> None:
    before = _state(store)
    sink_before = _sink_deliveries(store)
    _lose(store)
    # Any open now makes an empty database in its place; rebuild takes that in its stride.
    assert _json(store, "status")["records"] == 0

    done = _cli(store, "rebuild", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["restored"], report["from_log"], report["from_markdown"]) == (9, 9, 0)
    assert (report["delivered"], report["dead"], report["pending"]) == (6, 1, 2)
    assert report["moved_aside"] == [] and report["resumed"] is False
    assert "rebuild: restoring records 9/9" in done.stderr.decode("utf-8")  # progress

    verified = _cli(store, "verify")
    assert verified.returncode == 0, verified.stdout
    assert _state(store) == before  # records, files, states, sink ids and reasons
    # The delivered ones are not sent again; the pending ones go now, once each.
    assert _cli(store, "drain").returncode == 1  # the dead letter stays dead
    after = _sink_deliveries(store)
    assert {key: after[key] for key in sink_before} == sink_before
    assert len(after) == len(sink_before) + 2 and set(after.values()) == {1}
    assert _cli(store, "verify").returncode == 0


def test_records_only_in_markdown_or_the_fallback_queue_come_back(store: Settings) -> None:
    """The log lost its last line (an unsynced tail), one body was edited by hand, a fallback
    file never got in, and a legacy file without a key waits for replay."""
    log = store.jsonl_path.read_bytes().splitlines(keepends=True)
    last = json.loads(log[-1])
    assert last["event"] == "accepted"
    store.jsonl_path.write_bytes(b"".join(log[:-1]))
    edited = next(e for e in jsonl_events(store.jsonl_path) if e["event"] == "accepted")
    edited_path = store.markdown_dir / edited["markdown"]
    edited_path.write_bytes(edited_path.read_bytes().replace(b"decision 1:", b"decision ONE:"))
    queued = build_record("a write that fell back and was never imported", tags=["queued"])
    fallback_path, _ = FallbackQueue(store.markdown_dir, (FAULTY,)).write(queued, "db_busy")
    legacy = store.markdown_dir / "2026-01-01-legacy.md"
    legacy.write_text(
        "---\nintended_brain_store: true\ntimestamp: '2026-01-01T00:00:00Z'\nchunk_id:\n---\n"
        "an old memory for outbox replay",
        encoding="utf-8",
    )
    before = _state(store)
    _lose(store)

    report = _json(store, "rebuild")
    assert (report["from_log"], report["from_markdown"]) == (8, 2)
    assert report["unkeyed_files"] == 1
    assert report["files_written"] >= 1  # the edited body, given back from the log
    verified = _cli(store, "verify")
    assert verified.returncode == 0, verified.stdout
    rebuilt = _state(store)
    assert {key: rebuilt[key] for key in before} == before
    assert rebuilt[queued.key][0] == queued.content
    assert rebuilt[queued.key][5] == fallback_path.name  # the fallback file is its mirror
    assert edited_path.read_bytes().endswith(edited["content"].encode("utf-8"))
    accepted = [e["key"] for e in jsonl_events(store.jsonl_path) if e["event"] == "accepted"]
    assert sorted(accepted) == sorted(rebuilt)  # the lost line and the queued one appended
    assert "legacy.md" not in json.dumps(report)  # files are named by digest, never by name


def test_a_corrupt_database_is_moved_aside_never_destroyed(store: Settings) -> None:
    before = _state(store)
    database = store.home / "outbox.db"
    _checkpoint(store)  # everything in the main file, then damage it
    with database.open("r+b") as handle:
        handle.write(b"this is not a database any more" * 300)
    damaged = database.read_bytes()

    report = _json(store, "rebuild")
    (aside,) = [Path(path) for path in report["moved_aside"] if not path.endswith(("-wal", "-shm"))]
    assert aside.parent == database.parent and aside.name.startswith("outbox.db.corrupt-")
    assert aside.read_bytes() == damaged  # kept byte for byte
    assert _cli(store, "verify").returncode == 0
    assert _state(store) == before


def test_a_healthy_database_with_records_is_refused_unless_merging(store: Settings) -> None:
    """An old copy of the database put back: it holds records, so plain rebuild refuses and
    changes nothing; ``--merge`` adds what the log has and the copy lacks."""
    database = store.home / "outbox.db"
    _checkpoint(store)
    backup = store.home.parent / "backup.db"
    shutil.copyfile(database, backup)
    with Outbox.open(store) as ob:
        ob.add("written after the backup was taken")
    before = _state(store)
    _lose(store)
    shutil.copyfile(backup, database)
    copy = database.read_bytes()

    refused = _cli(store, "rebuild")
    assert refused.returncode == 1
    lines = refused.stderr.decode("utf-8").splitlines()
    assert len(lines) == 1 and "already holds records" in lines[0] and "--merge" in lines[0]
    assert database.read_bytes() == copy and not (store.home / MARKER_NAME).exists()

    report = _json(store, "rebuild", "--merge")
    assert (report["restored"], report["already_there"]) == (1, 9)
    assert _cli(store, "verify").returncode == 0
    assert _state(store) == before


def _bulk_store(settings: Settings, count: int) -> None:
    with Outbox.open(settings) as ob:
        for start in range(0, count, 1000):
            ob.add_many(
                [f"bulk memory number {n}, for a long rebuild" for n in range(start, start + 1000)]
            )


def _rebuild_until_restoring(settings: Settings) -> subprocess.Popen[bytes]:
    """A rebuild in a child process, returned once its first batch of records is in."""
    child = subprocess.Popen(
        [sys.executable, "-m", "outbox", "rebuild"],
        cwd=settings.home.parent,
        env=_env(settings),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert child.stderr is not None
    for line in child.stderr:
        if line.startswith(b"rebuild: restoring records"):
            return child
    raise AssertionError(f"the rebuild ended without restoring: {child.wait()}")


def test_a_rebuild_killed_mid_way_goes_on_when_run_again(settings: Settings) -> None:
    _bulk_store(settings, 6000)
    before = _state(settings)
    _lose(settings)
    child = _rebuild_until_restoring(settings)  # its first batch of 2000 is committed
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=120) == -signal.SIGKILL
    assert (settings.home / MARKER_NAME).exists()  # it knows it did not finish
    with closing(sqlite3.connect(settings.home / "outbox.db")) as conn:
        half = conn.execute("SELECT count(*) FROM records").fetchone()[0]
    assert 0 < half < 6000

    report = _json(settings, "rebuild")  # not refused, though the database holds records
    assert report["resumed"] is True
    assert report["already_there"] == half and report["restored"] == 6000 - half
    assert not (settings.home / MARKER_NAME).exists()
    assert _cli(settings, "verify").returncode == 0
    assert _state(settings) == before


def test_a_second_rebuild_is_refused_while_the_first_runs(settings: Settings) -> None:
    """Two rebuilds of one store would insert and mirror the same records side by side: while
    the first (here stopped mid-run) holds the rebuild lock, a second process is refused at
    once with one line, and the first, let go on, finishes as if alone."""
    _bulk_store(settings, 6000)
    before = _state(settings)
    _lose(settings)
    first = _rebuild_until_restoring(settings)
    first.send_signal(signal.SIGSTOP)
    try:
        # Refused at once; without the lock it would wait on the stopped run's mirror lock.
        second = run_cli(["rebuild"], cwd=settings.home.parent, env=_env(settings), timeout=60)
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=120) == 0
    assert second.returncode == 1
    (line,) = second.stderr.decode("utf-8").splitlines()
    assert "another outbox rebuild of this store is running" in line
    assert _cli(settings, "verify").returncode == 0
    assert _state(settings) == before


def test_a_write_during_a_rebuild_falls_back_and_comes_in_after(settings: Settings) -> None:
    """The rebuild holds the mirror lock (here: stopped while holding it), so a write goes
    to the fallback queue within its bound, and the first open after the rebuild imports it."""
    _bulk_store(settings, 6000)
    _lose(settings)
    child = _rebuild_until_restoring(settings)
    child.send_signal(signal.SIGSTOP)
    try:
        added = _cli(settings, "add", "written while the rebuild ran", "--json", busy_timeout="0.3")
    finally:
        child.send_signal(signal.SIGCONT)
    assert child.wait(timeout=120) == 0
    assert added.returncode == 0, added.stderr
    receipt = json.loads(added.stdout)
    # Held off by the rebuild's mirror lock, or by the half-filled database lacking what the
    # log names (``mirror/gap.py``): either way the fallback queue, never the database.
    assert receipt["status"] == "fallback" and receipt["reason"] in ("db_busy", "db_missing")
    assert _json(settings, "status")["records"] == 6001  # imported by this open
    verified = _cli(settings, "verify")
    assert verified.returncode == 0, verified.stdout


def test_a_forgotten_record_comes_back_only_as_its_tombstone(store: Settings) -> None:
    """``outbox forget`` blanks the record's log line and appends a ``forgotten`` line: the
    rebuild puts back a tombstone (key, instant, no content) with the sink deletes the log
    recorded, so the key stays forgotten, its content is nowhere, and verify passes."""
    forgotten = next(e for e in jsonl_events(store.jsonl_path) if e["event"] == "accepted")
    done = _cli(store, "forget", forgotten["key"][:12])
    assert done.returncode == 0, done.stderr
    _cli(store, "drain")  # the sink's delete, with its log line (other records stay dead)
    assert any(
        e["event"] == "deleted" and e["key"] == forgotten["key"]
        for e in jsonl_events(store.jsonl_path)
    )
    _lose(store)
    report = _json(store, "rebuild")
    assert (report["forgotten_left_out"], report["tombstones"], report["restored"]) == (1, 1, 8)
    assert report["problems"] == []
    content, timestamp, *_ = _state(store)[forgotten["key"]]
    assert (content, timestamp) == ("", forgotten["timestamp"])
    with Outbox.open(store, repair=False) as ob:
        item = ob.storage.records.get_record(forgotten["key"])
        assert item is not None and item.forgotten
        (row,) = ob.deliveries_of([forgotten["key"]])[forgotten["key"]]
        assert (row.op, row.state) == ("delete", "forgotten")
    files = [store.home / name for name in ("outbox.db", "outbox.db-wal")]
    database = b"".join(path.read_bytes() for path in files if path.exists())
    assert b"decision 2: keep the audit trail" in database  # the search can find words...
    assert forgotten["content"].encode("utf-8") not in database  # ...and these are gone
    verified = _cli(store, "verify")
    assert verified.returncode == 0, verified.stdout


@pytest.fixture
def pg_store(settings: Settings) -> Iterator[tuple[Settings, str]]:
    """A store on PostgreSQL, and the URL of a second, empty database to rebuild into."""
    with fresh_database() as first, fresh_database() as second:
        yield (
            load_settings(
                env={},
                db_url=first,
                home=settings.home,
                markdown_dir=settings.markdown_dir,
                sinks=FAULTY,
            ),
            second,
        )


@pytest.mark.postgres
def test_postgres_rebuilds_into_a_new_database(pg_store: tuple[Settings, str]) -> None:
    settings, empty = pg_store
    with Outbox.open(settings) as ob:
        ob.add_many([f"memory {n} kept on the shared server" for n in range(30)])
        ob.add(f"refused by the sink: {POISON}")
    assert _cli(settings, "drain").returncode == 1
    before = _state(settings)
    lost = load_settings(
        env={}, db_url=empty, home=settings.home, markdown_dir=settings.markdown_dir, sinks=FAULTY
    )

    report = _json(lost, "rebuild")
    assert (report["restored"], report["delivered"], report["dead"]) == (31, 30, 1)
    assert "***" in report["database"] or "@" in report["database"]  # a URL, never a password
    assert _cli(lost, "verify").returncode == 0
    assert _state(lost) == before
    refused = _cli(lost, "rebuild")
    assert refused.returncode == 1 and b"--merge" in refused.stderr


def test_nothing_to_rebuild_from_is_an_error_that_creates_nothing(tmp_path: Path) -> None:
    done = run_cli(["rebuild"], cwd=tmp_path, env=child_env())
    assert done.returncode == 1
    (line,) = done.stderr.decode("utf-8").splitlines()
    assert "nothing to rebuild from" in line and str(tmp_path / ".outbox" / "outbox.jsonl") in line
    assert list(tmp_path.iterdir()) == []  # no store made out of nothing


def test_evidence_trusts_a_line_only_when_its_content_gives_its_key() -> None:
    """Pure: an edited line is no evidence (its key is looked for in the files); the last
    outcome per sink wins; a delivery without the sink's id proves nothing."""
    good = build_record("a memory whose line is intact", timestamp=TS.format(day=1))
    bad = build_record("a memory whose line was edited", timestamp=TS.format(day=2))
    evidence = Evidence(("sink",))

    def accepted(record: Any, content: str) -> dict[str, Any]:
        return {
            "event": "accepted",
            "key": record.key,
            "timestamp": record.timestamp,
            "content": content,
            "importance": 5,
            "tags": [],
            "metadata": {},
            "sinks": ["sink"],
            "markdown": f"{record.key[:8]}.md",
        }

    evidence.add_line(1, accepted(good, good.content))
    evidence.add_line(2, accepted(bad, bad.content + " (edited)"))
    evidence.add_line(3, {"event": "dead", "key": good.key, "sink": "sink", "reason": "unknown"})
    evidence.add_line(4, {"event": "delivered", "key": good.key, "sink": "sink", "sink_id": "x"})
    evidence.add_line(5, {"event": "delivered", "key": bad.key, "sink": "sink", "sink_id": None})
    evidence.add_line(6, {})
    assert [item.record.key for item in evidence.records()] == [good.key]
    assert len(evidence.problems) == 2 and "line 2" in evidence.problems[0]
    assert bad.content not in " ".join(evidence.problems)
    (outcome,) = evidence.outcomes_for(evidence.records()[0])
    assert (outcome.state, outcome.sink_id) == ("delivered", "x")
    assert bad.key not in evidence.outcomes
    matter = {"key": bad.key, "timestamp": bad.timestamp, "importance": 3}
    evidence.add_file("2026-03-02-edited.md", matter, bad.content.encode("utf-8"))
    assert [item.record.key for item in evidence.records()] == [good.key, bad.key]
    assert evidence.records()[1].record.importance == 3
    assert os.path.basename(evidence.records()[1].markdown_name) == "2026-03-02-edited.md"
