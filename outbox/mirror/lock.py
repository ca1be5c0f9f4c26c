"""The mirror lock: one writer at a time across the commit and the mirror append.

Holding it from before the database commit until the mirrors are written means that whoever
holds it sees every committed record either mirrored or left by a writer that died; that is
what lets repair append a missing record without ever racing a live writer into a duplicate.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from outbox.errors import MirrorBusy
from outbox.folders import ensure_private_dir
from outbox.safe_files import open_file


class MirrorLock:
    """An ``flock`` on ``<jsonl>.lock`` plus a thread lock (flock is per open file, not thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread_lock = threading.Lock()
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            ensure_private_dir(self.path.parent)
            self._fd = open_file(self.path, os.O_RDWR | os.O_CREAT, what="mirror lock")
        return self._fd

    @contextlib.contextmanager
    def hold(self, deadline: float | None = None) -> Iterator[None]:
        """Hold the lock; raise MirrorBusy if ``deadline`` (monotonic) passes first."""
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._thread_lock.acquire(timeout=-1 if remaining is None else remaining):
            raise MirrorBusy("another thread held the mirror lock past the write's time bound")
        try:
            fd = self._open()
            pause = 0.0005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if deadline is not None and time.monotonic() + pause > deadline:
                        raise MirrorBusy(
                            "another process held the mirror lock past the write's time bound"
                        ) from None
                    time.sleep(pause)
                    pause = min(pause * 2, 0.02)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
