"""``outbox drain --timeout S`` waits, up to S, for rows another dispatcher holds (issue 22,
point 11): a holder SIGKILLed mid-batch has its rows taken back once its heartbeat shows it
gone, long before its lease would run out; a live holder that keeps them past S is exit 1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from outbox import Outbox, Settings
from outbox.store.heartbeats import ALIVE
from tests.conftest import FAULTY
from tests.helpers.subproc import child_env, run_cli

RECORDS = 12
# Leases far longer than the drain's timeout: only the heartbeat can free the rows in time.
HOLDER = {
    "lease_seconds": "120",
    "heartbeat_interval": "1",
    "batch_size": "100",
    "faulty_hang": "600",  # the holder's sink never answers: it keeps its rows leased
    "sink_timeout": "600",
    "run_nice": "0",  # its heartbeat keeps time on a busy machine: a live holder stays alive
}


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.fixture
def holder(settings: Settings, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """An ``outbox run`` holding every record's row, with its heartbeat on record."""
    with Outbox.open(settings) as ob:
        ob.add_many(f"memory {number} that another dispatcher holds" for number in range(RECORDS))
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox", "run"],
        cwd=tmp_path,
        env=child_env(**HOLDER),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with Outbox.open(settings, repair=False) as ob:

            def holding() -> bool:
                leased = ob.storage.deliveries.counts().get(FAULTY, {}).get("leased", 0)
                beats = ob.storage.heartbeats.all()
                return leased == RECORDS and any(b.state(time.time()) == ALIVE for b in beats)

            wait_for(holding)
        yield process
    finally:
        process.kill()
        process.wait(timeout=30)


def drain(tmp_path: Path, *options: str) -> tuple[int, dict[str, object]]:
    done = run_cli(["drain", *options, "--json"], cwd=tmp_path, env=child_env())
    assert done.stderr == b"", done.stderr
    payload: dict[str, object] = json.loads(done.stdout)
    return done.returncode, payload


def test_drain_takes_back_the_rows_of_a_killed_dispatcher_once_its_heartbeat_stops(
    settings: Settings, tmp_path: Path, holder: subprocess.Popen[bytes]
) -> None:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    code, report = drain(tmp_path, "--timeout", "30")
    assert code == 0, report
    assert (report["ok"], report["delivered"], report["timed_out"]) == (True, RECORDS, False)
    assert isinstance(report["elapsed"], float) and report["elapsed"] < 30
    with Outbox.open(settings, repair=False) as ob:
        counts = ob.storage.deliveries.counts()[FAULTY]
    assert (counts["delivered"], counts["leased"], counts["pending"]) == (RECORDS, 0, 0)


def test_drain_gives_up_with_exit_1_when_a_live_holder_keeps_its_rows_past_the_timeout(
    settings: Settings, tmp_path: Path, holder: subprocess.Popen[bytes]
) -> None:
    code, report = drain(tmp_path, "--timeout", "3")
    assert code == 1
    assert (report["ok"], report["delivered"], report["timed_out"]) == (False, 0, True)
    assert isinstance(report["elapsed"], float) and report["elapsed"] >= 3
    sinks = report["sinks"]
    assert isinstance(sinks, dict)
    assert sinks[FAULTY]["remaining"]["leased"] == RECORDS
    assert holder.poll() is None  # the holder lived throughout: nothing was taken from it


def test_drain_without_a_timeout_takes_back_a_gone_dispatchers_rows_at_once(
    settings: Settings, tmp_path: Path, holder: subprocess.Popen[bytes]
) -> None:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    with Outbox.open(settings, repair=False) as ob:
        wait_for(lambda: all(b.state(time.time()) != ALIVE for b in ob.storage.heartbeats.all()))
    code, report = drain(tmp_path)  # its leases have most of their 120 s left
    assert (code, report["ok"], report["delivered"]) == (0, True, RECORDS)
