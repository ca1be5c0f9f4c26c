"""The delivery sync rewrites front matter in place (``markdown.overwrite``), not through a
temporary file: a dispatcher SIGKILLed at random moments while it mirrors outcomes leaves
files that the next open puts right, and nothing a reader could mistake for a record."""

from __future__ import annotations

import logging
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outbox import Outbox, load_settings
from outbox.core.errors import RecordFileError
from outbox.core.states import REASON_DELIVERED
from outbox.mirror import markdown, repair
from tests.helpers.checks import split_markdown
from tests.helpers.subproc import child_env

SINK = "outbox.testing.sinks:NoopSink"
TOTAL = 240
KILLS = 12


def _delivered(db: Path) -> tuple[int, int]:
    """(rows delivered, outcomes settled but not yet mirrored), read without opening the
    outbox (an open would repair what the test means to leave for the last one)."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        delivered, owed = conn.execute(
            "SELECT count(*) FILTER (WHERE state = 'delivered'), sum(mirror_pending)"
            " FROM deliveries"
        ).fetchone()
    return int(delivered), int(owed or 0)


def test_dispatchers_killed_mid_sync_leave_no_torn_file(tmp_path: Path) -> None:
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "notes", sinks=SINK
    )
    rng = random.Random(20261202)
    # Bodies of one to three pages: a file rewritten in place spans pages, so a kill can
    # land between them, and a front matter that grows moves every byte after it.
    contents = [
        f"memory {i}: "
        + " ".join(f"word{rng.randrange(10_000)}" for _ in range(rng.randrange(450, 1400)))
        for i in range(TOTAL)
    ]
    with Outbox.open(settings) as ob:
        receipts = ob.add_many(contents)
    keys = [receipt.key for receipt in receipts]
    paths = {receipt.key: receipt.markdown_path for receipt in receipts}
    db = settings.home / "outbox.db"
    env = child_env(
        settings.home,
        markdown_dir=str(settings.markdown_dir),
        sinks=SINK,
        batch_size="8",
        lease_seconds="1",
    )
    kills = owed_after_kill = 0
    while kills < KILLS:
        before, _ = _delivered(db)
        if before == TOTAL:
            break
        child = subprocess.Popen(
            [sys.executable, "-m", "outbox", "drain"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            # Kill just after a settle it committed: its sync of those outcomes follows.
            while _delivered(db)[0] == before and child.poll() is None:
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.005))
            child.send_signal(signal.SIGKILL)
        finally:
            child.wait(timeout=60)
        kills += 1
        owed_after_kill += _delivered(db)[1] > 0
    with Outbox.open(settings) as ob:  # the open repairs what a killed sync left
        ob.drain(timeout=120)
        report = ob.verify()
        assert report.ok, report.problems
        for key, content in zip(keys, contents, strict=True):
            matter, body = split_markdown(Path(paths[key]))
            assert body == content.encode(), key[:12]
            assert matter["key"] == key and matter["reason"] == REASON_DELIVERED, key[:12]
    assert _delivered(db) == (TOTAL, 0)
    assert kills >= 3, "the drain outran the kills: no sync was interrupted"
    # No temporary copy was made, so none was left behind.
    assert not [p for p in settings.markdown_dir.iterdir() if p.name.endswith(".tmp")]
    # At least one kill left outcomes settled but unmirrored for the open to finish.
    assert owed_after_kill, f"{kills} kills, none between a settle and its mirror sync"


def test_a_torn_in_place_rewrite_is_restored_from_the_database(tmp_path: Path) -> None:
    """What a kill between pages leaves (the new front matter whole, then the old bytes
    shifted), with the outcome still owed: the next sync restores the body."""
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "notes", sinks=SINK
    )
    content = "a long memory " * 800
    with Outbox.open(settings) as ob:
        receipt = ob.add(content)
        ob.wait_mirrored(30)
        path = Path(receipt.markdown_path)
        old = path.read_bytes()
        ob.drain(timeout=30)
        new = path.read_bytes()
        assert new != old and new.endswith(content.encode())
        # Put the file back as a kill after the first page would have left it, and owe the
        # outcome again, as a sync killed before its clearing commit leaves it.
        path.write_bytes(new[: markdown._PAGE] + old[markdown._PAGE :])
        with ob.storage.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE deliveries SET mirror_pending = 1")
        ob.mirrors.sync_deliveries()
        assert path.read_bytes() == new


def test_one_file_that_refuses_its_update_holds_back_only_its_own_outcome(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link in place of one record's file (``O_NOFOLLOW`` refuses it): the other records'
    outcomes are mirrored, that one stays owed without a line, and once the file is back
    the next sync writes its front matter and its one line."""
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "notes", sinks=SINK
    )
    other = tmp_path / "someone-elses-notes.md"
    other.write_bytes(b"not a record\n")
    with Outbox.open(settings) as ob:
        receipts = ob.add_many([f"memory {i} whose outcome is mirrored" for i in range(5)])
        assert ob.wait_mirrored(30)
        held = Path(receipts[2].markdown_path)
        original = held.read_bytes()
        held.unlink()
        held.symlink_to(other)
        ob.drain(timeout=30)
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any(
            f"record {receipts[2].key[:12]}: cannot update its markdown file" in line
            for line in warned
        ), warned
        assert not any("whose outcome" in line or held.name in line for line in warned)
        delivered = [
            line.event["key"]
            for line in ob.mirrors.jsonl.lines()
            if line.event.get("event") == "delivered"
        ]
        assert sorted(delivered) == sorted(r.key for i, r in enumerate(receipts) if i != 2)
        for i, receipt in enumerate(receipts):
            if i != 2:
                assert split_markdown(Path(receipt.markdown_path))[0]["reason"] == "delivered"
        owed = ob.storage.mirror_state.mirror_pending(settings.mirror_id)
        assert [row.key for row in owed] == [receipts[2].key]
        assert other.read_bytes() == b"not a record\n"  # never written through the link
        held.unlink()
        held.write_bytes(original)
        ob.mirrors.sync_deliveries()
        assert split_markdown(held)[0]["reason"] == "delivered"
        delivered = [
            line.event["key"]
            for line in ob.mirrors.jsonl.lines()
            if line.event.get("event") == "delivered"
        ]
        assert sorted(delivered) == sorted(r.key for r in receipts)  # each exactly once
        assert ob.verify().ok


def test_more_refusing_files_than_a_page_hold_back_no_other_outcome(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sync pages past the records whose file refuses (links in their place): with
    more of them than a page holds, and older, every other outcome is still written in the
    same sync, and each refusing record is tried once."""
    monkeypatch.setattr(repair, "MIRROR_BATCH", 3)
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "notes", sinks=SINK
    )
    other = tmp_path / "someone-elses-notes.md"
    other.write_bytes(b"not a record\n")
    tried: list[str] = []
    opened = markdown.Opened.__init__

    def counted(self: markdown.Opened, path: Path | str) -> None:
        tried.append(Path(path).name)
        opened(self, path)

    monkeypatch.setattr(markdown.Opened, "__init__", counted)
    with Outbox.open(settings) as ob:
        receipts = ob.add_many([f"memory {i} behind the refusing files" for i in range(8)])
        assert ob.wait_mirrored(30)
        refusing = receipts[:5]  # the oldest outcomes: the first pages are all theirs
        for receipt in refusing:
            Path(receipt.markdown_path).unlink()
            Path(receipt.markdown_path).symlink_to(other)
        ob.drain(timeout=30)
        for receipt in receipts[5:]:
            assert split_markdown(Path(receipt.markdown_path))[0]["reason"] == "delivered"
        owed = ob.storage.mirror_state.mirror_pending(settings.mirror_id)
        assert sorted(row.key for row in owed) == sorted(r.key for r in refusing)
        tried.clear()
        with pytest.raises(RecordFileError):
            ob.mirrors.sync_deliveries()
        names = [Path(r.markdown_path).name for r in refusing]
        assert sorted(tried) == sorted(names)  # each refusing file once, nothing else
        assert other.read_bytes() == b"not a record\n"


def test_a_record_moved_off_a_taken_name_after_its_batch_read_it_gets_its_update(
    tmp_path: Path,
) -> None:
    """The batch read a record, then the mirror writer moved it to its ``-<key8>`` name (a
    fallback file took the first): the sync finds the file at its new name, and leaves the
    other key's file alone."""
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "notes", sinks=SINK
    )
    with Outbox.open(settings) as ob:
        receipt = ob.add("a memory whose file name another key took")
        assert ob.wait_mirrored(30)
        key = receipt.key
        read_by_the_batch = ob.storage.records.get_records([key])
        first = Path(receipt.markdown_path)
        moved = first.with_name(first.stem + f"-{key[:8]}.md")
        with ob.storage.engine.begin() as conn:
            ob.storage.records.rename_markdown(conn, key, moved.name)
        first.rename(moved)
        foreign = b"---\nkey: someone-else\n---\nanother memory\n"
        first.write_bytes(foreign)
        (claim,) = ob.storage.deliveries.claim(SINK, "test", 10, 60.0)
        ob.storage.deliveries.settle("test", [(claim.delivery_id, key)], [])
        report = ob.mirrors.sync_deliveries(read_by_the_batch)
        assert report.problems == []
        assert split_markdown(moved)[0]["reason"] == REASON_DELIVERED
        assert first.read_bytes() == foreign
        assert split_markdown(moved)[1] == b"a memory whose file name another key took"
