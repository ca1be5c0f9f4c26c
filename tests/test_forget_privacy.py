"""Issue 21, cases 6-9: no copy of a forgotten memory survives a duplicate fallback file, a
forget cut off at any step (with the database lost after it), an old backup merged back, or
a log line verify refuses. Real processes (the command line, SIGKILL at a chosen step of
the forget), real files searched byte for byte for the memory's words."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from outbox.mirror import markdown
from outbox.mirror.jsonl import encode, line_hash
from tests.helpers.cut_forget import POINTS
from tests.helpers.subproc import child_env, run_cli
from tests.test_forget import OTHERS, SECRET, WORDS, holding, key_of, outbox_files

HELPERS = Path(__file__).parent / "helpers"
TS = "2026-05-04T09:30:00Z"


class Store:
    """A store in ``tmp_path`` driven through the command line."""

    def __init__(self, tmp_path: Path, **extra: str) -> None:
        self.root = tmp_path
        self.home = tmp_path / ".outbox"
        self.md = tmp_path / "docs.local" / "decisions"
        self.env = child_env(self.home, faulty_db=str(tmp_path / "sink.db"), **extra)

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
        return run_cli(list(args), cwd=self.root, env=self.env, timeout=timeout)

    def ok(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        done = self.cli(*args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    def holding(self) -> list[str]:
        return holding(outbox_files(self.home, self.md), WORDS)

    def seed(self) -> str:
        """The secret and three other records, all delivered to the fault sink."""
        key = key_of(self.cli("add", SECRET, "--timestamp", TS, "--json"))
        for text in OTHERS:
            self.ok("add", text)
        self.ok("drain", "--timeout", "60")
        assert self.holding(), "control: the files hold the words before the forget"
        return key

    def cut_forget(self, key: str, point: str) -> None:
        """A real ``forget`` process, SIGKILLed right after the step ``point`` names."""
        child = subprocess.Popen(
            [sys.executable, str(HELPERS / "cut_forget.py"), key, point],
            cwd=self.root,
            env={**self.env, "PYTHONPATH": str(Path(__file__).parents[1])},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert child.stdout is not None
        try:
            assert child.stdout.readline() == b"cut\n", "the forget ended before its cut"
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        assert child.returncode == -signal.SIGKILL

    def lose_database(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.home / 'outbox.db'}{suffix}").unlink(missing_ok=True)

    def log_events(self) -> list[dict[str, object]]:
        lines = (self.home / "outbox.jsonl").read_bytes().splitlines()
        return [json.loads(line) for line in lines]


def test_a_duplicate_fallback_file_goes_with_the_forget_and_a_leftover_is_flagged(
    tmp_path: Path,
) -> None:
    """Case 6. The same write (content and instant) once committed and once, with another
    slug, in the fallback queue while the database was locked: two files, one key. The
    forget removes both; a copy it could not know of is named by verify and removed by a
    second forget."""
    store = Store(tmp_path, busy_timeout="0.3")
    key = store.seed()
    locker = subprocess.Popen(
        [sys.executable, str(HELPERS / "db_lock.py"), str(store.home / "outbox.db"), "120"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert locker.stdout is not None and locker.stdin is not None
    try:
        assert locker.stdout.readline() == b"locked\n"
        again = json.loads(
            store.ok("add", SECRET, "--timestamp", TS, "--slug", "vault-note", "--json").stdout
        )
        assert (again["key"], again["status"]) == (key, "fallback")
    finally:
        locker.stdin.close()
        locker.wait(30)
    assert (store.md / "2026-05-04-vault-note.md").exists()

    forgot = store.ok("forget", key[:12])
    assert b"already" not in forgot.stdout
    assert store.holding() == [], "no file (markdown, fallback, index) keeps the words"
    assert store.cli("verify").returncode == 0

    # A copy of the key the forget could not know of (a duplicate imported by an earlier
    # version, a file copied back by hand): verify names it, a second forget removes it.
    planted = store.md / "2026-05-04-copied-back.md"
    matter = {"key": key, "timestamp": "2026-05-04T09:30:00.000000Z", "outbox_fallback": False}
    planted.write_bytes(markdown.render(matter, SECRET))
    verified = store.cli("verify")
    assert verified.returncode == 1
    assert f"record {key[:12]}: forgotten, but a markdown file still carries it".encode() in (
        verified.stdout + verified.stderr
    )
    assert b"copied-back" not in verified.stdout + verified.stderr
    second = store.ok("forget", key[:12])
    assert b"already" in second.stdout and b"1 leftover" in second.stdout
    assert not planted.exists() and store.holding() == []
    assert store.cli("verify").returncode == 0


@pytest.mark.parametrize("point", list(POINTS))
def test_a_forget_killed_at_any_step_is_finished_by_the_next_forget(
    tmp_path: Path, point: str
) -> None:
    """Build point 2: SIGKILL between any two steps of a forget; the next ``forget`` of the
    key (its open's repair, then the forget) finishes it: no file keeps the words, verify
    passes, and the log holds one forgotten line for it. (A guard: the code before issue 21
    already finished these; the lost-database variant below is what it did not.)"""
    store = Store(tmp_path)
    key = store.seed()
    store.cut_forget(key, point)
    again = store.ok("forget", key[:12])
    assert b"already" in again.stdout
    assert store.holding() == []
    assert store.cli("verify").returncode == 0
    events = [(e["event"], e["key"]) for e in store.log_events()]
    assert events.count(("forgotten", key)) == 1


@pytest.mark.parametrize("point", ["forgotten-line", "redacted"])
def test_a_cut_forget_and_a_lost_database_end_as_a_tombstone(tmp_path: Path, point: str) -> None:
    """Case 7. The forget is SIGKILLed after its ``forgotten`` line (its accepted line not
    yet redacted, or its file not yet deleted), then the database is lost. ``rebuild`` puts
    the record back only as a tombstone and finishes the forget: the words leave the log and
    the folder, verify and verify --repair pass, and a forget says it already was."""
    store = Store(tmp_path)
    key = store.seed()
    store.cut_forget(key, point)
    store.lose_database()
    report = json.loads(store.ok("rebuild", "--json").stdout)
    assert (report["tombstones"], report["restored"]) == (1, len(OTHERS))
    assert store.holding() == []
    assert store.cli("verify").returncode == 0
    assert store.cli("verify", "--repair").returncode == 0
    assert b"already" in store.ok("forget", key[:12]).stdout
    assert holding(outbox_files(store.home, store.md), (OTHERS[0][:20].encode(),))


def test_an_old_backup_merged_back_does_not_bring_a_forgotten_memory_back(
    tmp_path: Path,
) -> None:
    """Case 8. A backup of the database taken before the forget is put back and merged
    with ``rebuild --merge``: the log's forgotten line wins. The record is a tombstone, its
    file is not written again, search and export do not give it, the restored copy's pages
    are purged, and each sink gets its delete again."""
    store = Store(tmp_path)
    key = store.seed()
    database = store.home / "outbox.db"
    with closing(sqlite3.connect(database)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    backup = tmp_path / "backup.db"
    shutil.copyfile(database, backup)
    store.ok("forget", key[:12])
    store.ok("drain", "--timeout", "60")  # the sink's delete, with its deleted line
    assert store.holding() == []
    store.lose_database()
    shutil.copyfile(backup, database)
    assert store.holding(), "control: the restored copy holds the words"

    report = json.loads(store.ok("rebuild", "--merge", "--json").stdout)
    assert store.holding() == [], "not in the database, the log or any markdown file"
    assert report["forgets_applied"] == 1
    assert store.cli("verify").returncode == 0
    assert key.encode() not in store.ok("export").stdout
    assert key not in store.ok("search", "marmalade quokka", "--json").stdout.decode()
    shown = store.ok("show", key[:12]).stdout
    assert b"forgotten" in shown and b"marmalade" not in shown
    with closing(sqlite3.connect(database)) as conn:
        rows = conn.execute(
            "SELECT op, state FROM deliveries WHERE record_key = ?", (key,)
        ).fetchall()
    assert rows == [("delete", "forgotten")], "the log says the sink deleted it: settled"


def _forge_accepted(store: Store, text: str, seq: int) -> str:
    """Append an ``accepted`` line for a record nobody wrote, its key and chain recomputed
    as a forger with write access to the log would."""
    from outbox.core.keys import idempotency_key

    path = store.home / "outbox.jsonl"
    last = path.read_bytes().splitlines()[-1]
    timestamp = "2026-05-04T10:00:00.000000Z"
    key = idempotency_key(text, timestamp)
    event = {
        "event": "accepted",
        "key": key,
        "timestamp": timestamp,
        "content": text,
        "importance": 5,
        "tags": [],
        "metadata": {},
        "sinks": ["faulty"],
        "markdown": "2026-05-04-forged.md",
        "seq": seq,
    }
    with path.open("ab") as handle:
        handle.write(encode(event, line_hash(last)) + b"\n")
    return key


def test_merge_adopts_only_what_verify_accepts(tmp_path: Path) -> None:
    """Case 9. A forged accepted line (valid key, recomputed chain) that verify names is not
    merged in; a chain-valid forgotten line for a record the database holds live is named
    by verify."""
    store = Store(tmp_path)
    store.seed()
    forged = _forge_accepted(store, "Transfer the savings to the new account now.", seq=2)
    verified = store.cli("verify")
    assert verified.returncode == 1 and forged[:12].encode() in verified.stdout + verified.stderr
    report = json.loads(store.ok("rebuild", "--merge", "--json").stdout)
    assert report["restored"] == 0
    assert any(forged[:12] in problem for problem in report["problems"])
    assert forged.encode() not in store.ok("export").stdout

    live = [e for e in store.log_events() if e["event"] == "accepted"][1]
    path = store.home / "outbox.jsonl"
    data = path.read_bytes()
    offset = data.index(json.dumps(live["key"]).encode()) - len('{"event":"accepted","key":')
    accepted_raw = data[offset : data.index(b"\n", offset)]
    event = {"event": "forgotten", "key": live["key"], "line": offset}
    event["hash"] = line_hash(accepted_raw)
    with path.open("ab") as handle:
        handle.write(encode(event, line_hash(data.splitlines()[-1])) + b"\n")
    verified = store.cli("verify")
    out = verified.stdout + verified.stderr
    assert verified.returncode == 1
    assert f"record {str(live['key'])[:12]}: the log has a forgotten line".encode() in out
