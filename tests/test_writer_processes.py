"""Several writer processes on one store: they share the mirror lock with each other (never
with repair, verify or a drain's outcome lines, which still get it within their bound while
the writers write back to back), and a SIGKILL of every one of them mid-write loses nothing
and duplicates nothing.
"""

from __future__ import annotations

import os
import random
import selectors
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from outbox import Outbox, Settings
from outbox.core.errors import MirrorBusy
from outbox.mirror.lock import MirrorLock
from outbox.store.transactions import begin_immediate
from tests.helpers.subproc import WRITER, child_env
from tests.test_mirror_writer import PROBE

HOLD = """
import sys, time
from pathlib import Path
from outbox.mirror.lock import MirrorLock
from outbox.store.transactions import begin_immediate
lock = MirrorLock(Path(sys.argv[1]))
with lock.hold(time.monotonic() + 30, exclusive=sys.argv[2] == "exclusive"):
    print("held", flush=True)
    sys.stdin.readline()
"""


BEGIN = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("INSERT INTO t VALUES (1)")
print("held", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
"""


def holder(script: str, *args: str) -> subprocess.Popen[str]:
    """A real process holding a lock until a line arrives on its stdin."""
    child = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def let_go(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    assert child.wait(30) == 0


def test_writers_share_the_mirror_lock_and_an_exclusive_holder_waits_for_them(
    tmp_path: Path,
) -> None:
    """Another process committing holds the lock shared: a writer here gets it too, while
    repair or verify (exclusive) waits until that writer is done, and no writer gets in
    while an exclusive holder is inside."""
    path = tmp_path / "mirror.jsonl.lock"
    lock = MirrorLock(path)
    writer = holder(HOLD, str(path), "shared")
    try:
        with lock.hold(time.monotonic() + 10, exclusive=False):
            pass
        with pytest.raises(MirrorBusy), lock.hold(time.monotonic() + 0.3):
            pass
    finally:
        let_go(writer)
    with lock.hold(time.monotonic() + 10):
        pass
    repair = holder(HOLD, str(path), "exclusive")
    try:
        with pytest.raises(MirrorBusy), lock.hold(time.monotonic() + 0.3, exclusive=False):
            pass
    finally:
        let_go(repair)
    with lock.hold(time.monotonic() + 10, exclusive=False):
        pass
    lock.close()


def test_begin_immediate_waits_for_another_process_and_gives_up_at_its_bound(
    tmp_path: Path,
) -> None:
    """The writer's own wait for the database lock: SQLITE_BUSY once its bound has passed
    while another process holds the lock, the lock once that process commits."""
    database = tmp_path / "store.db"
    setup = sqlite3.connect(database, isolation_level=None)
    setup.execute("PRAGMA journal_mode = WAL")
    setup.execute("CREATE TABLE t (x INTEGER)")
    setup.close()
    conn = sqlite3.connect(database, isolation_level=None, timeout=0)
    other = holder(BEGIN, str(database))
    try:
        with pytest.raises(sqlite3.OperationalError) as busy:
            begin_immediate(conn, 0.2)
        assert busy.value.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
    finally:
        let_go(other)
    other = holder(BEGIN, str(database))
    assert other.stdin is not None
    other.stdin.write("go\n")  # it commits while this process waits
    other.stdin.flush()
    begin_immediate(conn, 30.0)
    conn.execute("INSERT INTO t VALUES (2)")
    conn.execute("COMMIT")
    assert other.wait(30) == 0
    assert sorted(row[0] for row in conn.execute("SELECT x FROM t")) == [1, 1, 2]
    conn.close()


def start_writer(env: dict[str, str], cwd: Path, seed: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WRITER), "crash", str(seed)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def kill_all_while_writing(
    children: list[subprocess.Popen[bytes]], rng: random.Random
) -> list[str]:
    """Wait until each writer has returned a write, let them race a random while, SIGKILL
    them all; the keys whose ``add``/``add_many`` returned."""
    outputs = {child.pid: b"" for child in children}
    selector = selectors.DefaultSelector()
    for child in children:
        assert child.stdout is not None
        selector.register(child.stdout, selectors.EVENT_READ, child)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(b"\n" in out for out in outputs.values()):
        for key, _ in selector.select(timeout=0.1):
            child = key.data
            outputs[child.pid] += os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
    selector.close()
    assert all(b"\n" in out for out in outputs.values()), [
        child.stderr.read() if child.stderr else b"" for child in children if child.poll()
    ]
    time.sleep(rng.uniform(0.05, 0.3))
    for child in children:
        child.send_signal(signal.SIGKILL)
    returned: list[str] = []
    for child in children:
        rest, _ = child.communicate(timeout=30)
        assert child.returncode == -signal.SIGKILL
        output = outputs[child.pid] + rest
        returned += output[: output.rfind(b"\n") + 1].decode("ascii").split()
    return returned


@pytest.mark.slow
def test_writer_processes_killed_together_lose_nothing_and_mirror_each_record_once(
    settings: Settings, tmp_path: Path
) -> None:
    """Three processes write at once (single adds and batches, some sharing a slug), all
    SIGKILLed mid-write, three times: every returned key is stored, and after the reopen's
    repair each record has exactly one accepted line and one file, in one unbroken chain."""
    rng = random.Random(20261202)
    env = child_env(
        home=settings.home, markdown_dir=str(settings.markdown_dir), sinks=",".join(settings.sinks)
    )
    Outbox.open(settings).close()  # the store exists before the writers race to open it
    returned: list[str] = []
    for round_number in range(3):
        children = [start_writer(env, tmp_path, 100 * round_number + n) for n in range(3)]
        returned += kill_all_while_writing(children, rng)
        with Outbox.open(settings) as ob:
            stored = ob.storage.records.get_records(returned)
            assert set(stored) == set(returned), f"round {round_number}: a returned key is lost"
            check = ob.verify()
            assert check.ok, (round_number, check.problems)
            assert check.records == check.markdown_files == ob.storage.records.count_records()
    assert len(set(returned)) == len(returned)
    with Outbox.open(settings) as ob:
        accepted = Counter(
            str(line.event["key"])
            for line in ob.mirrors.jsonl.lines()
            if line.event.get("event") == "accepted"
        )
        assert set(accepted.values()) == {1}
        assert len(accepted) == ob.storage.records.count_records() >= len(returned)
        assert len(list(settings.markdown_dir.glob("*.md"))) == len(accepted)
        assert ob.mirrors.jsonl.verify_chain() == []
        modes = {path.stat().st_mode & 0o777 for path in settings.markdown_dir.glob("*.md")}
        assert modes == {0o600}


def test_writer_processes_writing_back_to_back_still_let_an_exclusive_holder_in(
    settings: Settings, tmp_path: Path
) -> None:
    """Three processes write back to back, holding the lock shared; another process asking
    for it alone (as repair or a dispatcher's outcome lines do) gets it within its 3 s bound
    every time: each writer hands it over before its next commit."""
    env = child_env(
        home=settings.home, markdown_dir=str(settings.markdown_dir), sinks=",".join(settings.sinks)
    )
    Outbox.open(settings).close()
    lock_path = settings.jsonl_path.with_name(settings.jsonl_path.name + ".lock")
    children = [start_writer(env, tmp_path, 500 + n) for n in range(3)]
    try:
        time.sleep(1.0)  # the writers are under way
        assert all(child.poll() is None for child in children)
        probe = subprocess.run(
            [sys.executable, "-c", PROBE, str(lock_path), "3"],
            capture_output=True,
            timeout=120,
            check=False,
        )
    finally:
        for child in children:
            child.send_signal(signal.SIGKILL)
            child.communicate(timeout=30)
    assert probe.returncode == 0, probe.stderr.decode()
    waits = [float(wait) for wait in probe.stdout.split()]
    assert len(waits) >= 5
    assert -1.0 not in waits, waits  # never past its 3 s bound
    with Outbox.open(settings) as ob:
        assert ob.verify().ok
