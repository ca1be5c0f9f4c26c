"""Memory content stays out of logs and error messages, and every file is the owner's alone.

Logs are captured at DEBUG (a failure's detail may go there) and checked at INFO and above;
exception texts, including their chained causes, and the command line's stderr are checked in
full. The distinctive string sits past the content's first eight words, so it is not part of
any file name either (the slug is made of those words, and receipts name their file).
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from outbox import Outbox, Settings, StoreFailed, ValidationError
from outbox.core.record import Record, build_record
from outbox.dispatch.retry import RetryPolicy
from outbox.sinks.base import Outcome, Rejected
from outbox.testing.sinks import FaultySink
from outbox.write.fallback import FallbackQueue
from tests.conftest import FAULTY
from tests.helpers.faults import held_write_lock, immutable, read_only, tmpfs
from tests.helpers.subproc import child_env, run_cli

CANARY = "CANARY-7f3a91-private-detail"
SECRET = f"one two three four five six seven eight nine: the password is {CANARY}\n"
PARKED = RetryPolicy(max_retries=1, base=60.0, cap=60.0)


def _assert_no_canary_logged(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        if record.levelno >= logging.INFO:
            assert CANARY not in record.getMessage(), (record.levelname, record.getMessage())


def _assert_no_canary_in(exc: BaseException) -> None:
    assert CANARY not in str(exc) and CANARY not in repr(exc)
    assert CANARY not in "".join(traceback.format_exception(exc))  # causes and contexts too


class LeakySink:
    """A sink whose errors quote the record, as some servers' error messages do: it refuses
    the memories holding the canary for good and keeps the transport closed for the rest."""

    name = FAULTY

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        return [
            Rejected(f"refused document {r.content!r}")
            if CANARY in r.content
            else ConnectionError(f"Transport closed while sending {r.content!r}")
            for r in batch
        ]

    def close(self) -> None:
        """Nothing held open."""


def test_failure_paths_keep_content_out_of_logs_and_errors(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = replace(settings, busy_timeout=0.3)
    # A database locked by another process: fallback file.
    with Outbox.open(settings) as ob:
        ob.add("a first memory, so the database exists")
        with held_write_lock(settings.home / "outbox.db"):
            assert ob.add(SECRET).status == "fallback"
    # A read-only database file (chattr +i): fallback file again, for another instant.
    with immutable(settings.home / "outbox.db"), Outbox.open(settings) as ob:
        assert ob.add(SECRET, timestamp="2026-01-01T00:00:00Z").status == "fallback"
    # Imports, then deliveries that fail with the content in the sink's error text.
    with Outbox.open(settings) as ob:
        assert len(ob.last_import.imported) == 2  # type: ignore[union-attr]
        with ob.dispatcher(sink_objects={FAULTY: LeakySink()}, policy=PARKED) as dispatcher:
            dispatcher.drain()
        assert ob.storage.deliveries.counts()[FAULTY]["dead"] == 2
        assert ob.storage.deliveries.counts()[FAULTY]["pending"] == 1
        # Invalid input quoting the content: rejected without repeating it.
        for bad in (
            lambda: build_record(SECRET, max_bytes=32),
            lambda: ob.add(SECRET + "\x00"),
            lambda: ob.add(SECRET, metadata={"note": SECRET, "bad": float("nan")}),
        ):
            with pytest.raises(ValidationError) as caught:
                bad()
            _assert_no_canary_in(caught.value)
    # A legacy file that cannot be parsed, its content beside the broken front matter.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "2026-01-01-broken.md").write_text(f"---\ntags: [x\n---\n{SECRET}")
    (legacy / "2026-01-02-no-time.md").write_text(
        f"---\nintended_brain_store: true\nchunk_id:\n---\n{SECRET}"
    )
    with Outbox.open(settings) as ob:
        report = ob.replay(legacy)
    assert len(report.skipped) == 2
    assert CANARY not in repr(report.to_dict())
    # Neither the database nor the markdown folder writable: StoreFailed.
    with tmpfs(tmp_path / "vol") as vol:
        broken = replace(
            settings,
            home=vol / "home",
            db_url=f"sqlite:///{vol / 'home' / 'outbox.db'}",
            jsonl_path=vol / "home" / "outbox.jsonl",
            markdown_dir=vol / "decisions",
        )
        Outbox.open(broken).close()
        with read_only(vol), Outbox.open(broken) as ob, pytest.raises(StoreFailed) as caught:
            ob.add(SECRET)
        _assert_no_canary_in(caught.value)
    assert any(r.levelno >= logging.WARNING for r in caplog.records)  # the paths did log
    assert any(CANARY in r.getMessage() for r in caplog.records if r.levelno < logging.INFO)
    _assert_no_canary_logged(caplog)


def test_command_line_failures_keep_content_out_of_stderr(
    settings: Settings, tmp_path: Path
) -> None:
    settings = replace(settings, busy_timeout=0.3)
    env = child_env(
        settings.home,
        markdown_dir=str(settings.markdown_dir),
        busy_timeout="0.3",
        faulty_fail_rate="1",
        faulty_error=f"Transport closed: {CANARY}",
        max_retries="0",
    )
    assert run_cli(["add", "a first memory"], cwd=tmp_path, env=env).returncode == 0
    outputs = []
    with held_write_lock(settings.home / "outbox.db"):
        outputs.append(run_cli(["-v", "add", "-"], cwd=tmp_path, env=env, stdin=SECRET.encode()))
    outputs.append(run_cli(["-v", "drain"], cwd=tmp_path, env=env))  # imports, then fails
    outputs.append(run_cli(["-v", "add", "--importance", "11", SECRET], cwd=tmp_path, env=env))
    assert [done.returncode for done in outputs] == [0, 1, 2]
    assert b"WARNING" in outputs[1].stderr
    for done in outputs:
        assert CANARY.encode() not in done.stderr, done.stderr


# -- file modes ------------------------------------------------------------------------------


@pytest.fixture
def open_umask() -> Iterator[None]:
    """Umask 000, so only the library's own mode arguments can make a file private."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def _modes(root: Path) -> dict[str, int]:
    found = {str(root): stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        found[str(path)] = stat.S_IMODE(path.lstat().st_mode)
    return found


def test_files_are_0600_and_folders_0700(
    settings: Settings, tmp_path: Path, open_umask: None
) -> None:
    """Nested folders that do not exist yet; every kind of file the library writes."""
    settings = replace(
        settings,
        home=tmp_path / "state" / "outbox" / "home",
        db_url=f"sqlite:///{tmp_path / 'state' / 'outbox' / 'home' / 'outbox.db'}",
        jsonl_path=tmp_path / "state" / "outbox" / "home" / "outbox.jsonl",
        markdown_dir=tmp_path / "notes" / "docs.local" / "decisions",
        busy_timeout=0.3,
    )
    sink = FaultySink(tmp_path / "sink.db", FAULTY)  # the test sink's file is not scanned
    ob = Outbox.open(settings)
    try:
        ob.add("a memory with a markdown mirror and a JSONL line")
        with held_write_lock(settings.home / "outbox.db"):
            assert ob.add("a memory that lands in a fallback file").status == "fallback"
        with ob.dispatcher(sink_objects={FAULTY: sink}) as dispatcher:  # front matter rewrite
            dispatcher.drain()
        # The WAL and its index exist while a connection is open: check them now.
        during = _modes(settings.home)
    finally:
        ob.close()
    with Outbox.open(settings) as ob:  # imports the fallback file
        assert ob.storage.records.count_records() == 2
    fallback_only = FallbackQueue(tmp_path / "fresh" / "queue", (FAULTY,))
    fallback_only.write(build_record("a fallback file in a folder nobody made"), "readonly")
    cli_home = tmp_path / "cli" / "home"
    env = child_env(cli_home, markdown_dir=str(tmp_path / "cli" / "md"))
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "add", "written by the command line"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        check=False,
        preexec_fn=lambda: os.umask(0),
    )
    assert done.returncode == 0, done.stderr

    modes = _modes(tmp_path / "state") | during
    modes |= _modes(tmp_path / "notes") | _modes(tmp_path / "fresh") | _modes(tmp_path / "cli")
    folders = {p: m for p, m in modes.items() if Path(p).is_dir()}
    files = {p: m for p, m in modes.items() if p not in folders}
    home, md = settings.home, settings.markdown_dir
    expected_files = {
        home / "outbox.db",
        home / "outbox.db-wal",  # seen while open
        home / "outbox.jsonl",
        home / "outbox.jsonl.lock",
        fallback_only.index_path,
        cli_home / "outbox.db",
        cli_home / "outbox.jsonl",
    }
    assert {str(p) for p in expected_files} <= set(files)
    assert len([p for p in files if p.startswith(str(md)) and p.endswith(".md")]) == 2
    assert len([p for p in files if p.endswith(".md")]) == 4
    assert {p: oct(m) for p, m in files.items() if m != 0o600} == {}
    expected_folders = {
        tmp_path / "state",
        tmp_path / "state" / "outbox",
        home,
        tmp_path / "notes",
        tmp_path / "notes" / "docs.local",
        md,
        tmp_path / "fresh",
        fallback_only.folder,
        tmp_path / "cli",
        cli_home,
        tmp_path / "cli" / "md",
    }
    assert set(folders) == {str(p) for p in expected_folders}
    assert {p: oct(m) for p, m in folders.items() if m != 0o700} == {}


def test_an_error_line_names_no_markdown_file(tmp_path: Path) -> None:
    """A markdown file's name carries the first words of its memory; the command line's one
    error line names the folder instead, and keeps other paths (database, log) as they are."""
    from outbox.faces.cli.common import error_line

    secret = tmp_path / "md" / "2026-11-29-my-bank-password-is-hunter2-0a1b2c3d.md"
    line = error_line(PermissionError(13, "Permission denied", str(secret)))
    assert "hunter2" not in line
    assert line == f"Permission denied: a markdown file in {secret.parent}"
    database = tmp_path / ".outbox" / "outbox.db"
    assert error_line(OSError(5, "Input/output error", str(database))).endswith(str(database))
    assert error_line(RuntimeError("first line\nsecond line")) == "first line"
