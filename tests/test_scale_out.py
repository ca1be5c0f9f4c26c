"""Issue 7's proof: four writer and four dispatcher processes on one PostgreSQL outbox and
one Chroma server, with one dispatcher SIGKILLed mid-run; every record delivered, none twice,
none lost, and the dead dispatcher's claims taken over after its lease."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from outbox import Outbox, load_settings
from outbox.store.schema import deliveries
from tests.chroma_server import ChromaServer

WRITERS, DISPATCHERS, PER_WRITER = 4, 4, 60
WRITER = """
import sys
from outbox import Outbox
with Outbox.open() as ob:
    for i in range(int(sys.argv[2])):
        receipt = ob.add(f"writer {sys.argv[1]} memory {i}: notes on the rollout of feature {i}")
        print(receipt.key, receipt.status, flush=True)
"""


@pytest.fixture
def chroma(tmp_path: Path) -> Iterator[ChromaServer]:
    with ChromaServer(tmp_path / "chroma-server") as server:
        yield server


@pytest.mark.postgres
def test_four_writers_four_dispatchers_one_killed(
    pg_url: str, chroma: ChromaServer, tmp_path: Path
) -> None:
    env = dict(os.environ)
    env.update(
        OUTBOX_DB_URL=pg_url,
        OUTBOX_CHROMA_URL=chroma.url,
        OUTBOX_SINKS="chroma",
        OUTBOX_BATCH_SIZE="16",
        OUTBOX_LEASE_SECONDS="3",
        OUTBOX_POLL_INTERVAL="0.2",
        OUTBOX_BUSY_TIMEOUT="10",
    )
    dispatchers = []
    for n in range(DISPATCHERS):
        home = tmp_path / f"dispatcher-{n}"
        env_n = {
            **env,
            "OUTBOX_HOME": str(home),
            "OUTBOX_MARKDOWN_DIR": str(home / "md"),
            "OUTBOX_MIRROR_ID": f"dispatcher-{n}",
        }
        dispatchers.append(
            subprocess.Popen(
                [sys.executable, "-m", "outbox", "run"],
                env=env_n,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        )
    writers = []
    for n in range(WRITERS):
        home = tmp_path / f"writer-{n}"
        env_n = {
            **env,
            "OUTBOX_HOME": str(home),
            "OUTBOX_MARKDOWN_DIR": str(home / "md"),
            "OUTBOX_MIRROR_ID": f"writer-{n}",
        }
        writers.append(
            subprocess.Popen(
                [sys.executable, "-c", WRITER, str(n), str(PER_WRITER)],
                env=env_n,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    settings = load_settings(
        env={},
        db_url=pg_url,
        home=tmp_path / "observer",
        markdown_dir=tmp_path / "observer" / "md",
        sinks="chroma",
        mirror_id="observer",
    )
    acknowledged: dict[str, str] = {}
    try:
        with Outbox.open(settings) as ob:
            # Kill one dispatcher at a moment it holds claims, and remember which.
            victim = f":{dispatchers[0].pid}:"
            deadline = time.monotonic() + 180
            held: list[str] = []
            while not held:
                assert time.monotonic() < deadline, "the dispatcher never claimed anything"
                with ob.engine.connect() as conn:
                    held = list(
                        conn.execute(
                            select(deliveries.c.record_key).where(
                                deliveries.c.state == "leased",
                                deliveries.c.lease_owner.contains(victim),
                            )
                        ).scalars()
                    )
                time.sleep(0.01)
            dispatchers[0].send_signal(signal.SIGKILL)
            dispatchers[0].wait(timeout=10)
            for writer in writers:
                out, err = writer.communicate(timeout=180)
                assert writer.returncode == 0, err
                for line in out.splitlines():
                    key, status = line.split()
                    acknowledged[key] = status
            assert len(acknowledged) == WRITERS * PER_WRITER
            assert set(acknowledged.values()) == {"queued"}
            deadline = time.monotonic() + 240
            while ob.storage.deliveries.counts()["chroma"]["delivered"] < len(acknowledged):
                assert time.monotonic() < deadline, ob.storage.deliveries.counts()
                time.sleep(0.2)
            rows = ob.storage.deliveries.deliveries_for(acknowledged)
            assert all(r[0].state == "delivered" and r[0].sink_id == k for k, r in rows.items())
            # What the killed dispatcher held was taken over after its lease and retried.
            taken_over = [rows[key][0] for key in held]
            assert all(row.attempts >= 2 for row in taken_over), taken_over
    finally:
        for proc in dispatchers[1:]:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(timeout=60) for proc in dispatchers[1:]]
    assert codes == [0, 0, 0]

    # Each writer machine keeps the mirrors of what it wrote; verify checks exactly those.
    for n in range(WRITERS):
        home = tmp_path / f"writer-{n}"
        mine = load_settings(
            env={},
            db_url=pg_url,
            home=home,
            markdown_dir=home / "md",
            sinks="chroma",
            mirror_id=f"writer-{n}",
        )
        with Outbox.open(mine) as ob:
            report = ob.verify()
        assert report.ok, report.problems
        assert report.records == report.markdown_files == PER_WRITER

    import chromadb

    client = chromadb.HttpClient(host="127.0.0.1", port=chroma.port)
    collection = client.get_collection("agent-memory")
    got = collection.get(ids=list(acknowledged), include=[])
    assert sorted(got["ids"]) == sorted(acknowledged)  # all there; ids are unique by nature
    assert collection.count() == len(acknowledged)  # nothing beyond them, nothing twice
