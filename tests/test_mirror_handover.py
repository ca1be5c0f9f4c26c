"""The dispatcher mirroring a batch's outcomes hands the mirror lock to a writer that waits
for it between steps (issue 24): on a busy disk one batch's front matter rewrites held it
for tens of ms, and a write beside a backfill waited that long. Handing over must lose no
outcome and write none twice; nobody waiting, the sync runs in one hold as before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox import Outbox, Settings
from outbox.mirror import repair
from outbox.mirror.repair import SYNC_STEP

RECORDS = SYNC_STEP * 5


@pytest.fixture
def owed(outbox: Outbox, monkeypatch: pytest.MonkeyPatch) -> Iterator[Outbox]:
    """``RECORDS`` records delivered to the fault-injection sink, their outcomes not yet
    mirrored (the dispatcher's own sync left out of the drain)."""
    outbox.add_many(f"record number {n}" for n in range(RECORDS))
    with monkeypatch.context() as patch:
        patch.setattr(outbox.mirrors, "sync_deliveries", lambda: None)
        report = outbox.drain()
    assert report.ok
    mirror_id = outbox.settings.mirror_id
    assert len(outbox.storage.mirror_state.mirror_pending(mirror_id)) == RECORDS
    yield outbox


def delivered_events(settings: Settings) -> list[str]:
    lines = settings.jsonl_path.read_text(encoding="utf-8").splitlines()
    return [event["key"] for event in map(json.loads, lines) if event.get("event") == "delivered"]


def steps_in_order(
    monkeypatch: pytest.MonkeyPatch, on_step: list[Callable[[], None]]
) -> tuple[list[str], list[float]]:
    """Each step of the sync journaled as ``step`` (with its end time); after the first, the
    calls in ``on_step`` run, still inside the hold."""
    journal: list[str] = []
    stamps: list[float] = []
    write = repair.MirrorSync.write_outcomes

    def logged(self: repair.MirrorSync, *args: Any) -> None:
        write(self, *args)
        journal.append("step")
        stamps.append(time.monotonic())
        for call in on_step:
            call()
        on_step.clear()

    monkeypatch.setattr(repair.MirrorSync, "write_outcomes", logged)
    return journal, stamps


def test_a_thread_waiting_for_the_lock_gets_it_between_steps(
    owed: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = owed.mirrors.lock
    on_step: list[Callable[[], None]] = []
    journal, _ = steps_in_order(monkeypatch, on_step)

    def writer() -> None:
        with lock.hold(time.monotonic() + 30, exclusive=False):
            journal.append("writer")

    def start_writer() -> None:  # after the first step: the writer queues behind the sync
        thread = threading.Thread(target=writer)
        thread.start()
        started.append(thread)
        deadline = time.monotonic() + 10
        while not lock.wanted():
            assert time.monotonic() < deadline
            time.sleep(0.001)

    started: list[threading.Thread] = []
    on_step.append(start_writer)
    owed.mirrors.sync_deliveries()
    started[0].join(10)
    assert "writer" in journal
    assert journal.index("writer") < len(journal) - 1, journal  # not after the whole sync
    assert journal.count("step") == RECORDS // SYNC_STEP
    events = delivered_events(owed.settings)
    assert len(events) == len(set(events)) == RECORDS  # none lost, none written twice
    assert owed.storage.mirror_state.mirror_pending(owed.settings.mirror_id) == []


WAITER = """
import sys, time
from pathlib import Path
from outbox.mirror.lock import MirrorLock
lock = MirrorLock(Path(sys.argv[1]))
with lock.hold(time.monotonic() + 30, exclusive=False):
    print(time.monotonic(), flush=True)
"""


def test_another_process_waiting_for_the_lock_gets_it_between_steps(
    owed: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = owed.mirrors.lock
    on_step: list[Callable[[], None]] = []
    _, stamps = steps_in_order(monkeypatch, on_step)
    waiter: list[subprocess.Popen[str]] = []

    def start_waiter() -> None:
        waiter.append(
            subprocess.Popen(
                [sys.executable, "-c", WAITER, str(lock.path)], stdout=subprocess.PIPE, text=True
            )
        )
        deadline = time.monotonic() + 30
        while not lock.wanted():
            assert waiter[0].poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.005)

    on_step.append(start_waiter)
    owed.mirrors.sync_deliveries()
    out, _ = waiter[0].communicate(timeout=30)
    assert waiter[0].returncode == 0
    got_it = float(out.split()[0])
    assert got_it < stamps[-1], (got_it, stamps)  # it had the lock before the last step
    events = delivered_events(owed.settings)
    assert len(events) == len(set(events)) == RECORDS
    assert owed.storage.mirror_state.mirror_pending(owed.settings.mirror_id) == []


def test_with_nobody_waiting_the_sync_takes_one_hold(
    owed: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    holds: list[Path] = []
    hold = owed.mirrors.lock.hold

    def counted(*args: Any, **options: Any) -> Any:
        holds.append(owed.mirrors.lock.path)
        return hold(*args, **options)

    monkeypatch.setattr(owed.mirrors.lock, "hold", counted)
    owed.mirrors.sync_deliveries()
    assert len(holds) == 1
    assert len(delivered_events(owed.settings)) == RECORDS
