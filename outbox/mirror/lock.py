"""The mirror lock: one writer at a time across the commit and the mirror append.

Whoever holds it sees every committed record either mirrored or left by a writer that died;
that is what lets repair append a missing record without ever racing a live writer into a
duplicate. A commit's mirrors are written after the committing thread has left (by the
process's mirror writer, ``mirror/writer.py``), so the process keeps the ``flock`` until
they are written (``retain``/``release``): another process still never sees a committed
record whose mirrors a live writer has yet to write, and a holder in this process other than
a committing writer first waits for them.
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
    """An ``flock`` on ``<jsonl>.lock`` plus a thread lock (flock is per open file, not thread).

    The flock is this process's from the first holder until no thread holds the lock and no
    retained mirror write is left.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread_lock = threading.Lock()
        self._state = threading.Condition()  # guards the three fields below
        self._retained = 0  # committed records whose mirrors are still to be written
        self._inside = False  # a thread holds the lock
        self._flocked = False  # this process holds the flock
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            ensure_private_dir(self.path.parent)
            self._fd = open_file(self.path, os.O_RDWR | os.O_CREAT, what="mirror lock")
        return self._fd

    @contextlib.contextmanager
    def hold(self, deadline: float | None = None, *, exclusive: bool = True) -> Iterator[None]:
        """Hold the lock; raise MirrorBusy if ``deadline`` (monotonic) passes first.

        ``exclusive`` (everyone but a committing writer) also waits until the mirror writes
        this process retained are done, so the holder finds the files as the database says.
        """
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._thread_lock.acquire(timeout=-1 if remaining is None else remaining):
            raise MirrorBusy("another thread held the mirror lock past the write's time bound")
        try:
            with self._state:
                self._inside = True
                if exclusive and not self._state.wait_for(
                    lambda: self._retained == 0, _left(deadline)
                ):
                    raise MirrorBusy("mirror writes still pending past the time bound")
                flocked = self._flocked
            if not flocked:
                self._take_flock(deadline)
            yield
        finally:
            with self._state:
                self._inside = False
                self._unlock_if_idle()
            self._thread_lock.release()

    def _take_flock(self, deadline: float | None) -> None:
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
        with self._state:
            self._flocked = True

    def _unlock_if_idle(self) -> None:
        """Give the flock back once nobody holds the lock and nothing is retained (call
        with ``_state`` held)."""
        if self._flocked and not self._inside and self._retained == 0:
            assert self._fd is not None
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._flocked = False

    def retain(self, count: int) -> None:
        """Keep the flock for ``count`` records' mirror writes after the holder leaves (the
        committing writer, inside ``hold``, right after its commit)."""
        with self._state:
            assert self._inside and self._flocked, "retain only while holding the lock"
            self._retained += count

    def release(self, count: int) -> None:
        """``count`` retained mirror writes are done: wake exclusive holders, and give the
        flock back when nothing else keeps it."""
        with self._state:
            self._retained -= count
            assert self._retained >= 0
            if self._retained == 0:
                self._state.notify_all()
                self._unlock_if_idle()

    @property
    def retained(self) -> int:
        """Records committed by this process whose mirrors are not written yet."""
        return self._retained

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._flocked = False


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
