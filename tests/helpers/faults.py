"""Real faults for the failure-path tests: a write lock held by another process, read-only and
full file systems, immutable files.

The tests run as root, and root writes through file modes, so "read-only" and "full" are made
real below the file modes: a tmpfs mount remounted read-only, a size-limited tmpfs filled to
the last block, or ``chattr +i``. Every context manager undoes its fault on the way out.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

LOCKER = Path(__file__).with_name("db_lock.py")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def start_lock_holder(db: Path, seconds: float = 120.0) -> subprocess.Popen[bytes]:
    """Another process holding ``BEGIN EXCLUSIVE`` on ``db``; returns once it holds it."""
    proc = subprocess.Popen(
        [sys.executable, str(LOCKER), str(db), str(seconds)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line != b"locked\n":
        release_lock_holder(proc)
        raise RuntimeError(f"the lock holder did not take the lock on {db}")
    return proc


def release_lock_holder(proc: subprocess.Popen[bytes]) -> None:
    """Closing its standard input makes the holder roll back and exit."""
    if proc.stdin is not None and not proc.stdin.closed:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


@contextlib.contextmanager
def held_write_lock(db: Path, seconds: float = 120.0) -> Iterator[subprocess.Popen[bytes]]:
    proc = start_lock_holder(db, seconds)
    try:
        yield proc
    finally:
        release_lock_holder(proc)


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "4m") -> Iterator[Path]:
    """A fresh tmpfs of ``size`` mounted on ``path`` (created if needed)."""
    path.mkdir(parents=True, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
    try:
        yield path
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("mount", "-o", "remount,rw", str(path))
        try:
            _run("umount", str(path))
        except subprocess.CalledProcessError:
            _run("umount", "-l", str(path))  # a straggling child still has a file open


@contextlib.contextmanager
def read_only(mount: Path) -> Iterator[Path]:
    """Remount a tmpfs from :func:`tmpfs` read-only (nothing may hold a file open for writing)."""
    _run("mount", "-o", "remount,ro", str(mount))
    try:
        yield mount
    finally:
        _run("mount", "-o", "remount,rw", str(mount))


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[Path]:
    """``chattr +i``: not even root may write, rename or delete it (or, for a folder, add to it)."""
    _run("chattr", "+i", str(path))
    try:
        yield path
    finally:
        _run("chattr", "-i", str(path))


def fill(folder: Path) -> Path:
    """Write a filler file until the file system reports it is full; returns the filler."""
    filler = folder / "filler.bin"
    block = b"\xff" * 65_536
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(block) == 1:
                    break
                block = block[: len(block) // 2]
    finally:
        os.close(fd)
    return filler
