"""A PostgreSQL server that stops answering: writes and opens still return within the bound.

The server's processes are stopped with SIGSTOP (the postmaster, so no new connection is
answered, and every backend of the test's database, so no open connection is either). The
driver would wait for a reply forever; the outbox cuts the call off and falls back, and once
the server runs again every write is in the outbox exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from outbox import Outbox, load_settings
from outbox.core.states import ReceiptStatus
from tests.conftest import FAULTY
from tests.pg import unavailable

BUSY = 1.0
# Beyond busy_timeout + 0.5 s: the fallback file (fsynced) on a loaded two-core machine.
MARGIN = 1.5


def _parent(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    raise AssertionError(f"no parent for {pid}")


@contextlib.contextmanager
def frozen_server(url: str) -> Iterator[None]:
    """SIGSTOP the postmaster and the database's backends; SIGCONT them afterwards."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            own = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
            backends = [
                int(pid)
                for pid in conn.execute(
                    text(
                        "SELECT pid FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).scalars()
            ]
            if not Path(f"/proc/{own}").exists():
                unavailable("the PostgreSQL server is not on this machine: cannot stop it")
            postmaster = _parent(own)
    finally:
        engine.dispose()
    stopped = [postmaster, *backends]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _helpers_done(timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [t for t in threading.enumerate() if t.name.startswith("outbox-write")]:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.postgres
def test_a_server_that_stops_answering_sends_writes_to_the_fallback(
    pg_url: str, tmp_path: Path
) -> None:
    settings = load_settings(
        env={},
        db_url=pg_url,
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks=FAULTY,
        busy_timeout=BUSY,
    )
    ob = Outbox.open(settings)
    before = ob.add("written while the server answers")
    assert before.status == ReceiptStatus.QUEUED
    with frozen_server(pg_url):
        started = time.monotonic()
        during = ob.add("written while the server is stopped")
        write_took = time.monotonic() - started
        started = time.monotonic()
        late = Outbox.open(settings)
        open_took = time.monotonic() - started
        opened_during = late.add("written by an outbox opened while the server is stopped")
    assert during.status == ReceiptStatus.FALLBACK and during.reason == "db_unreachable"
    assert write_took <= BUSY + 0.5 + MARGIN
    assert open_took <= BUSY + 0.5 + MARGIN
    assert late.unavailable == "db_unreachable"
    assert opened_during.status == ReceiptStatus.FALLBACK
    assert _helpers_done(), "a cut-off write never finished after the server came back"
    ob.close()
    late.close()

    with Outbox.open(settings) as again:
        keys = [row.record.key for row in again.storage.records.iter_records()]
        assert sorted(keys) == sorted({before.key, during.key, opened_during.key})
        report = again.verify()
        assert report.ok, report.problems
