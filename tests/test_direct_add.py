"""``outbox add``'s direct write: a store in its steady state is written on the bare driver,
without SQLAlchemy, with the same rows, files and receipt as the full outbox; a store that
needs more (a schema, mirror places, a repair) gets the full outbox's work, and nothing is
lost on either way."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from outbox import Outbox, Settings
from outbox.core.config import load_settings
from outbox.core.record import build_record
from outbox.core.states import FallbackReason, ReceiptStatus
from outbox.write.direct import add
from outbox.write.fallback import FallbackQueue
from tests.helpers.checks import accepted_counts, chain_ok
from tests.helpers.faults import held_write_lock
from tests.helpers.subproc import child_env, run_cli

TS = "2026-12-01T06:00:00.000000Z"


def watermark(settings: Settings) -> tuple[int, int]:
    with sqlite3.connect(settings.home / "outbox.db") as conn:
        seq, offset = conn.execute(
            "SELECT record_seq, jsonl_offset FROM mirror_state WHERE mirror_id = ?",
            (settings.mirror_id,),
        ).fetchone()
    return int(seq), int(offset)


def steady(settings: Settings) -> None:
    """A store in its steady state: created, migrated, one record written and repaired."""
    with Outbox.open(settings) as ob:
        ob.add("the first memory, written through the full outbox")
        ob.wait_mirrored(10)
        ob.sync_mirrors()


def test_a_steady_store_is_written_directly_and_the_repair_is_caught_up(
    settings: Settings,
) -> None:
    steady(settings)
    done = add(settings, build_record("a memory written without the full outbox", timestamp=TS))

    assert done is not None and not done.repair_owed
    receipt = done.receipt
    assert receipt.status == ReceiptStatus.QUEUED and not receipt.duplicate
    assert receipt.markdown_path.read_bytes().endswith(b"a memory written without the full outbox")
    assert watermark(settings) == (2, settings.jsonl_path.stat().st_size)
    with Outbox.open(settings) as ob:
        stored = ob.storage.records.get_record(receipt.key)
        assert stored is not None and stored.markdown_name == receipt.markdown_path.name
        assert [row.state for row in ob.deliveries_of([receipt.key])[receipt.key]] == ["pending"]
        assert ob.last_repair is not None and ob.last_repair.lines_appended == 0
        assert ob.verify().ok
    assert accepted_counts(settings.jsonl_path)[receipt.key] == 1 and chain_ok(settings.jsonl_path)


def test_a_repeat_is_a_duplicate_with_no_second_row(settings: Settings) -> None:
    steady(settings)
    record = build_record("the same memory twice, at the same instant", timestamp=TS)
    first, second = add(settings, record), add(settings, record)

    assert first is not None and second is not None
    assert second.receipt.duplicate and second.receipt.key == first.receipt.key
    assert second.receipt.markdown_path == first.receipt.markdown_path
    assert not second.repair_owed
    with Outbox.open(settings) as ob:
        assert ob.storage.records.count_records() == 2
    assert accepted_counts(settings.jsonl_path)[first.receipt.key] == 1


@pytest.mark.parametrize("why", ["no store yet", "old schema", "other mirror places"])
def test_a_store_that_needs_the_full_open_is_left_untouched(settings: Settings, why: str) -> None:
    record = build_record("a memory for a store that is not ready", timestamp=TS)
    if why != "no store yet":
        steady(settings)
    if why == "old schema":
        with sqlite3.connect(settings.home / "outbox.db") as conn:
            conn.execute("UPDATE alembic_version SET version_num = '0007'")
    elif why == "other mirror places":
        settings = load_settings(
            env={},
            home=settings.home,
            markdown_dir=settings.markdown_dir.parent / "elsewhere",
            sinks=settings.sinks,
        )
    size = settings.jsonl_path.stat().st_size if settings.jsonl_path.exists() else 0

    assert add(settings, record) is None

    assert (settings.jsonl_path.stat().st_size if settings.jsonl_path.exists() else 0) == size
    if why != "no store yet":
        with sqlite3.connect(settings.home / "outbox.db") as conn:
            assert conn.execute("SELECT count(*) FROM records").fetchone() == (1,)


def test_a_crashed_writers_record_makes_the_repair_owed_and_the_command_runs_it(
    settings: Settings, tmp_path: Path
) -> None:
    """A record committed without its mirrors (its writer died, or it was enqueued) is past
    the watermark without a line: the direct write says a repair is owed, and the command
    runs it, so both records end up mirrored."""
    steady(settings)
    with Outbox.open(settings) as ob, ob.engine.begin() as conn:
        enqueued = ob.enqueue(conn, "committed in a caller's transaction, never mirrored")
    assert add(settings, build_record("a direct write after it", timestamp=TS)) is not None
    assert accepted_counts(settings.jsonl_path)[enqueued.key] == 0
    # What `outbox add` does with that answer: the repair, in a real process.
    env = child_env(settings.home, markdown_dir=str(settings.markdown_dir))
    done = run_cli(["add", "the command's own write"], cwd=tmp_path, env=env)

    assert done.returncode == 0, done.stderr.decode()
    counts = accepted_counts(settings.jsonl_path)
    assert counts[enqueued.key] == 1 and len(counts) == 4 and set(counts.values()) == {1}
    with Outbox.open(settings) as ob:
        assert ob.verify().ok
    seq, offset = watermark(settings)
    assert (seq, offset) == (4, settings.jsonl_path.stat().st_size)


def test_a_waiting_fallback_file_makes_the_repair_owed(settings: Settings) -> None:
    steady(settings)
    parked = build_record("a memory parked in the fallback queue earlier", timestamp=TS)
    FallbackQueue(settings.markdown_dir, settings.sinks).write(parked, FallbackReason.DB_BUSY)

    done = add(settings, build_record("a direct write while a fallback file waits"))

    assert done is not None and done.repair_owed
    with Outbox.open(settings) as ob:  # the repair the command then runs
        assert ob.storage.records.get_record(parked.key) is not None
        assert ob.verify().ok


def test_a_locked_database_sends_the_direct_write_to_the_fallback_file(
    settings: Settings,
) -> None:
    steady(settings)
    settings = load_settings(
        env={},
        home=settings.home,
        markdown_dir=settings.markdown_dir,
        sinks=settings.sinks,
        busy_timeout=0.2,
    )
    record = build_record("a memory written while another process holds the lock")
    with held_write_lock(settings.home / "outbox.db"):
        done = add(settings, record)

    assert done is not None and not done.repair_owed
    assert done.receipt.status == ReceiptStatus.FALLBACK
    assert done.receipt.reason == FallbackReason.DB_BUSY
    assert done.receipt.markdown_path.exists()
    with Outbox.open(settings) as ob:  # the next open imports it, once
        assert ob.storage.records.get_record(record.key) is not None
        assert ob.verify().ok
