"""Dispatcher heartbeats with real processes: two ``outbox run`` daemons beat, one is killed
with SIGKILL, and ``outbox status`` shows one alive and one gone; the survivor's SIGTERM is
a clean stop, shown as stopped, never as gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox import Outbox, Settings
from tests.helpers.subproc import child_env, run_cli

INTERVAL = 0.3
BUSY = 1.0
GONE_AFTER = 3 * INTERVAL + BUSY  # the bound the daemons record for themselves


@pytest.fixture
def env(settings: Settings, tmp_path: Path) -> dict[str, str]:
    return child_env(
        settings.home,
        markdown_dir=str(settings.markdown_dir),
        faulty_db=str(tmp_path / "sink.db"),
        heartbeat_interval=str(INTERVAL),
        busy_timeout=str(BUSY),
        poll_interval="0.1",
        faulty_hang="0.05",
    )


@pytest.fixture
def daemons(env: dict[str, str], tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two ``outbox run`` processes; their stderr goes to files (a pipe nobody reads fills)."""
    started = []
    for n in range(2):
        with (tmp_path / f"run-{n}.err").open("wb") as err:
            started.append(
                subprocess.Popen(
                    [sys.executable, "-m", "outbox", "run"],
                    cwd=tmp_path,
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def _status(env: dict[str, str], cwd: Path) -> dict[str, Any]:
    done = run_cli(["status", "--json"], cwd=cwd, env=env)
    assert done.returncode == 0, done.stderr
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def _wait(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_status_shows_one_dispatcher_alive_and_the_killed_one_gone(
    settings: Settings,
    env: dict[str, str],
    tmp_path: Path,
    daemons: list[subprocess.Popen[bytes]],
) -> None:
    with Outbox.open(settings) as ob:
        ob.add_many(f"memory {i} for two beating dispatchers" for i in range(60))
    killed, survivor = daemons

    def by_pid() -> dict[int, dict[str, Any]]:
        return {d["pid"]: d for d in _status(env, tmp_path)["dispatchers"]}

    _wait(lambda: {killed.pid, survivor.pid} <= set(by_pid()), "both daemons recorded a heartbeat")
    _wait(
        lambda: sum(d["delivered"] for d in by_pid().values()) == 60,
        "the two heartbeats never added up to every record delivered",
    )
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait(timeout=30) == -signal.SIGKILL
    killed_at = time.monotonic()
    _wait(lambda: by_pid()[killed.pid]["state"] == "gone", "the killed daemon never showed gone")
    assert time.monotonic() - killed_at >= GONE_AFTER * 0.5, "gone before its bound could pass"

    status = _status(env, tmp_path)
    found = {d["pid"]: d for d in status["dispatchers"]}
    alive, gone = found[survivor.pid], found[killed.pid]
    assert (alive["state"], gone["state"]) == ("alive", "gone")
    assert gone["beat_age"] > gone["gone_after"] == pytest.approx(GONE_AFTER)
    assert alive["beat_age"] < alive["gone_after"]
    assert alive["host"] == gone["host"] and alive["sinks"] == [env["OUTBOX_SINKS"]]
    assert alive["delivered"] + gone["delivered"] == 60, "every record counted once, by one"
    assert alive["started_at"] <= alive["beat_at"]
    # Either daemon may have taken every batch: a last batch exactly when it delivered some.
    assert (alive["last_batch_at"] is not None) == (alive["delivered"] > 0)

    text = run_cli(["status"], cwd=tmp_path, env=env).stdout.decode()
    lines = {pid: line for pid in found for line in text.splitlines() if f":{pid} " in line}
    assert " alive " in lines[survivor.pid] and "records/s" in lines[survivor.pid]
    assert " gone " in lines[killed.pid] and "died without stopping" in lines[killed.pid]
    assert "the next drain or run takes back its leased rows" in lines[killed.pid]

    survivor.send_signal(signal.SIGTERM)
    assert survivor.wait(timeout=60) == 0
    after = {d["pid"]: d for d in _status(env, tmp_path)["dispatchers"]}
    assert after[survivor.pid]["state"] == "stopped"
    assert after[survivor.pid]["stopped_at"] >= after[survivor.pid]["started_at"]
    assert after[killed.pid]["state"] == "gone"
    # By default the daemon says when it starts, from where, into which sinks, and when it stops.
    said = (tmp_path / "run-1.err").read_text()
    assert "running: draining sqlite:///" in said and env["OUTBOX_SINKS"] in said
    assert "dispatcher stopped after" in said


def test_a_busy_dispatcher_reports_its_rate(
    settings: Settings, env: dict[str, str], tmp_path: Path
) -> None:
    with Outbox.open(settings) as ob:
        ob.add_many(f"memory {i} for the rate" for i in range(300))
    with (tmp_path / "run.err").open("wb") as err:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "outbox", "run", "-v"],
            cwd=tmp_path,
            env={**env, "OUTBOX_BATCH_SIZE": "10"},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        rates: list[float] = []

        def delivered_all() -> bool:
            beats = _status(env, tmp_path)["dispatchers"]
            rates.extend(mine["records_per_second"] for mine in beats)
            return bool(beats) and beats[0]["delivered"] == 300

        _wait(delivered_all, "the daemon never reported all 300 delivered")
        assert max(rates) > 0, rates
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    # -v after the subcommand: a line per batch, each naming its sink, size and outcome.
    batches = [line for line in (tmp_path / "run.err").read_text().splitlines() if " ms: " in line]
    assert len(batches) >= 30
    assert all("10 records in" in line and "10 delivered" in line for line in batches[:-1])
