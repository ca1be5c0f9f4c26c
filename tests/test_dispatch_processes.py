"""Real dispatcher processes on one SQLite outbox, one of them killed with SIGKILL mid-batch."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from outbox import Outbox, Settings

SINK = "outbox.testing.sinks:FaultySink"


def _env(settings: Settings, tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OUTBOX_HOME=str(settings.home),
        OUTBOX_MARKDOWN_DIR=str(settings.markdown_dir),
        OUTBOX_SINKS=SINK,
        OUTBOX_BATCH_SIZE="20",
        OUTBOX_LEASE_SECONDS="2",
        OUTBOX_POLL_INTERVAL="0.1",
        OUTBOX_FAULTY_DB=str(tmp_path / "sink.db"),
        OUTBOX_FAULTY_HANG="0.15",  # slow batches, so a kill lands mid-batch
        OUTBOX_FAULTY_FAIL_RATE="0.1",
    )
    return env


_started: list[subprocess.Popen[bytes]] = []


@pytest.fixture(autouse=True)
def _no_dispatcher_outlives_its_test() -> Iterator[None]:
    """A failed assertion must not leave an ``outbox run`` draining on (one did, for an hour)."""
    yield
    while _started:
        process = _started.pop()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def _dispatcher(env: dict[str, str]) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox", "run"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _started.append(process)
    return process


def test_two_dispatchers_and_a_sigkill_lose_and_double_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    total = 400
    with Outbox.open(settings) as ob:
        keys = {
            r.key for r in ob.add_many(f"memory {i} for the process test" for i in range(total))
        }
    env = _env(settings, tmp_path)
    first, second = _dispatcher(env), _dispatcher(env)
    sink_db = tmp_path / "sink.db"

    def delivered_to_sink() -> int:
        try:
            with sqlite3.connect(f"file:{sink_db}?mode=ro", uri=True, timeout=30) as conn:
                return int(conn.execute("SELECT count(*) FROM delivered").fetchone()[0])
        except sqlite3.OperationalError:  # not created yet by the dispatchers
            return 0

    deadline = time.monotonic() + 60
    while delivered_to_sink() < total // 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    with Outbox.open(settings) as ob:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            counts = ob.storage.deliveries.counts()[SINK]
            if counts["delivered"] == total:
                break
            time.sleep(0.2)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, second.stderr.read().decode() if second.stderr else ""
        counts = ob.storage.deliveries.counts()[SINK]
        assert counts["delivered"] == total, counts
        assert counts["leased"] == 0 and counts["dead"] == 0
        with sqlite3.connect(sink_db) as conn:
            stored = dict(conn.execute("SELECT key, deliveries FROM delivered").fetchall())
        assert set(stored) == keys  # every record landed, nothing foreign
        report = ob.verify()
        assert report.ok, report.problems
        delivered_lines = [
            line.event["key"]
            for line in ob.mirrors.jsonl.lines()
            if line.event.get("event") == "delivered"
        ]
        assert sorted(set(delivered_lines)) == sorted(keys)


def test_two_dispatchers_into_real_chroma_and_brainlayer_with_a_sigkill(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same kill, with the real sinks: a `chroma run` server (two processes must not share
    an embedded store) and BrainLayer in process (its one-writer rule makes the second
    dispatcher wait its turn, as db_busy)."""
    import chromadb

    from tests.brainlayer_env import setup_brainlayer
    from tests.chroma_server import ChromaServer

    brainlayer = setup_brainlayer(tmp_path / "brainlayer", monkeypatch)
    total = 120
    with ChromaServer(tmp_path / "chroma") as server:
        real = replace(settings, sinks=("chroma", "brainlayer"), chroma_url=server.url)
        with Outbox.open(real) as ob:
            receipts = ob.add_many(f"memory {i} about the quarterly plan" for i in range(total))
        env = _env(settings, tmp_path)
        env.update(os.environ)  # BrainLayer's variables, set by setup_brainlayer
        env.update(
            OUTBOX_SINKS="chroma,brainlayer",
            OUTBOX_CHROMA_URL=server.url,
            OUTBOX_HOME=str(settings.home),
            OUTBOX_MARKDOWN_DIR=str(settings.markdown_dir),
            OUTBOX_BATCH_SIZE="8",
            OUTBOX_LEASE_SECONDS="3",
            OUTBOX_BUSY_TIMEOUT="2",
        )
        first, second = _dispatcher(env), _dispatcher(env)
        with Outbox.open(real) as ob:
            deadline = time.monotonic() + 120
            while (
                sum(
                    ob.storage.deliveries.counts().get(s, {}).get("delivered", 0)
                    for s in real.sinks
                )
                < 16
            ):
                assert time.monotonic() < deadline, "deliveries never started"
                time.sleep(0.05)
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=10)
            deadline = time.monotonic() + 240
            while any(ob.storage.deliveries.counts()[s]["delivered"] < total for s in real.sinks):
                assert time.monotonic() < deadline, ob.storage.deliveries.counts()
                time.sleep(0.2)
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=60) == 0
            rows = ob.storage.deliveries.deliveries_for(r.key for r in receipts)
            assert ob.verify().ok
        collection = chromadb.HttpClient(host="127.0.0.1", port=server.port).get_collection(
            "agent-memory"
        )
        assert collection.count() == total  # ids are keys: none twice, none missing
    for receipt in receipts:
        by_sink = {row.sink: row for row in rows[receipt.key]}
        assert by_sink["chroma"].sink_id == receipt.key
        chunk_id = by_sink["brainlayer"].sink_id
        assert chunk_id and brainlayer.chunk(chunk_id) is not None
    # BrainLayer holds each memory once.
    ((count,),) = brainlayer.query("SELECT count(*) FROM chunks WHERE id LIKE 'manual-%'")
    assert count == total
