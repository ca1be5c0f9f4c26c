"""The one-shot locks (``core/file_lock``: rebuild, reindex, the Chroma server's start) are
files of the store like the others: created owner-only in an owner-only folder, never taken
through a symlink or on another user's file, and held against other processes, not only
other threads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outbox.core.errors import OutboxError
from outbox.core.file_lock import exclusive
from outbox.core.safe_files import UnsafeFile
from outbox.sinks.chroma_service import START_LOCK, SharedServer

NOBODY = 65534  # a user id that is not the one running the tests

HOLD = """
import sys
from pathlib import Path
from outbox.core.file_lock import exclusive
with exclusive(Path(sys.argv[1]), "test lock", lambda: RuntimeError("busy")):
    print("held", flush=True)
    sys.stdin.read()
"""


class Busy(OutboxError):
    pass


def _busy() -> Busy:
    return Busy("another holder has it")


def test_a_new_lock_is_owner_only_in_an_owner_only_folder(tmp_path: Path) -> None:
    lock = tmp_path / "new" / "folder" / "one.lock"
    before = os.umask(0)
    try:
        with exclusive(lock, "test lock", _busy):
            pass
    finally:
        os.umask(before)
    assert oct(lock.stat().st_mode & 0o777) == oct(0o600)
    for folder in (tmp_path / "new", lock.parent):
        assert oct(folder.stat().st_mode & 0o777) == oct(0o700)


def test_a_symlink_at_a_locks_name_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "someone-elses-file.txt"
    target.write_bytes(b"precious text")
    target.chmod(0o600)
    folder = tmp_path / "store"
    folder.mkdir(mode=0o700)
    (folder / "one.lock").symlink_to(target)
    with (
        pytest.raises(UnsafeFile, match=r"test lock .*one\.lock is a symbolic link"),
        exclusive(folder / "one.lock", "test lock", _busy),
    ):
        raise AssertionError("locked through a symlink")
    assert target.read_bytes() == b"precious text"
    assert target.stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_another_users_file_at_a_locks_name_is_refused(tmp_path: Path) -> None:
    lock = tmp_path / "one.lock"
    lock.touch(mode=0o600)
    os.chown(lock, NOBODY, NOBODY)
    with (
        pytest.raises(UnsafeFile, match=f"belongs to user id {NOBODY}"),
        exclusive(lock, "test lock", _busy),
    ):
        raise AssertionError("locked another user's file")


def test_the_chroma_start_lock_is_never_taken_through_a_symlink(tmp_path: Path) -> None:
    """Found before any server is started: the check comes before the lock."""
    folder = tmp_path / "chroma"
    folder.mkdir(mode=0o700)
    target = tmp_path / "target"
    target.write_bytes(b"")
    (folder / START_LOCK).symlink_to(target)
    with pytest.raises(UnsafeFile, match=r"start lock .* is a symbolic link"):
        SharedServer(folder, idle=1.0).endpoint()
    assert sorted(p.name for p in folder.iterdir()) == [START_LOCK]


def test_another_process_holding_it_makes_a_try_busy_and_a_wait_wait(tmp_path: Path) -> None:
    lock = tmp_path / "one.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(Busy), exclusive(lock, "test lock", _busy):
            raise AssertionError("two processes held it at once")
        started = time.monotonic()
        with pytest.raises(Busy), exclusive(lock, "test lock", _busy, wait=0.5):
            raise AssertionError("two processes held it at once")
        assert time.monotonic() - started >= 0.5
        holder.stdin.close()  # it lets go as it exits: a waiter gets the lock then
        with exclusive(lock, "test lock", _busy, wait=30):
            assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
