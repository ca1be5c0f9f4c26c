"""The mirror lock: writers share it across their commit and their mirror writes; everyone
else (repair, verify, the dispatcher's outcome lines, forget, rebuild) holds it alone.

Whoever holds it alone sees every committed record either mirrored or left by a writer that
died; that is what lets repair append a missing record without ever racing a live writer
into a duplicate. A commit's mirrors are written after the committing thread has left (by
the process's mirror writer, ``mirror/writer.py``), so the process keeps its ``flock`` until
they are written (``retain``/``release``): another process still never sees a committed
record whose mirrors a live writer has yet to write, and a holder in this process other than
a committing writer first waits for them.

Writers of several processes hold the flock shared: they need nothing of each other here
(SQLite orders their commits, and the log's appends take their own short lock,
``JsonlLog.append``). With the flock exclusive for writers too, two writer processes took
turns one commit at a time, each handing over only after its mirror writes were done: two
processes wrote half as many records as one.

Kept that way, the flock could stay with processes whose threads commit back to back. So a
process waiting for it says so, with a shared lock on ``<jsonl>.lock.want``, and polls often;
a process keeping the flock for its queued mirror writes checks that file before its next
commit and, when someone waits, lets its mirror writes finish, gives the flock up and waits
(briefly) for the waiters to have had their turn.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from outbox.core.errors import MirrorBusy
from outbox.core.folders import ensure_private_dir
from outbox.core.safe_files import open_file

# How long a process that gave the flock up waits for the waiters to take their turn.
YIELD_SECONDS = 0.05
# A waiter's longest pause between tries once it has said it waits.
WAITING_PAUSE = 0.001


class MirrorLock:
    """An ``flock`` on ``<jsonl>.lock`` plus a thread lock (flock is per open file, not thread).

    The flock is this process's from the first holder until no thread holds the lock and no
    retained mirror write is left: shared while only committing writers held it since it was
    taken, exclusive otherwise.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._thread_lock = threading.Lock()
        self._state = threading.Condition()  # guards the three fields below
        self._retained = 0  # committed records whose mirrors are still to be written
        self._inside = False  # a thread holds the lock
        self._flocked = False  # this process holds the flock
        self._shared = False  # ... shared (writers only), not exclusive
        self._fd: int | None = None
        self._want_fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            ensure_private_dir(self.path.parent)
            self._fd = open_file(self.path, os.O_RDWR | os.O_CREAT, what="mirror lock")
        return self._fd

    def _want(self) -> int:
        if self._want_fd is None:
            want = self.path.with_name(self.path.name + ".want")
            self._want_fd = open_file(want, os.O_RDWR | os.O_CREAT, what="mirror lock")
        return self._want_fd

    @contextlib.contextmanager
    def hold(self, deadline: float | None = None, *, exclusive: bool = True) -> Iterator[None]:
        """Hold the lock; raise MirrorBusy if ``deadline`` (monotonic) passes first.

        ``exclusive`` (everyone but a committing writer) also waits until the mirror writes
        this process retained are done, so the holder finds the files as the database says,
        and holds the flock alone; a committing writer shares it with other processes'.
        """
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._thread_lock.acquire(timeout=-1 if remaining is None else remaining):
            raise MirrorBusy("another thread held the mirror lock past the write's time bound")
        try:
            with self._state:
                handing_over = not exclusive and self._flocked and self._others_wait()
                if handing_over:  # our mirror writes finish first; release() then unlocks
                    self._wait_written(deadline)
                self._inside = True
                if exclusive:
                    self._wait_written(deadline)
                    if self._flocked and self._shared:  # nothing retained: let go, then
                        self._unlock()  # take it alone (a conversion is not atomic anyway)
                flocked = self._flocked
            if handing_over:
                self._let_waiters_in(deadline)
            if not flocked:
                self._take_flock(deadline, exclusive)
            yield
        finally:
            with self._state:
                self._inside = False
                self._unlock_if_idle()
            self._thread_lock.release()

    def _wait_written(self, deadline: float | None) -> None:
        """Wait (``_state`` held) until the mirror writes this process retained are done."""
        if not self._state.wait_for(lambda: self._retained == 0, _left(deadline)):
            raise MirrorBusy("mirror writes still pending past the time bound")

    def _others_wait(self) -> bool:
        """Whether another process (or another lock on this file) waits for the flock."""
        want = self._want()
        try:
            fcntl.flock(want, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(want, fcntl.LOCK_UN)
        return False

    def _let_waiters_in(self, deadline: float | None) -> None:
        """After giving the flock up, wait until the waiters took it (their shared locks on
        the want file are gone), for ``YIELD_SECONDS`` at most."""
        until = time.monotonic() + YIELD_SECONDS
        if deadline is not None:
            until = min(until, deadline)
        while self._others_wait() and time.monotonic() < until:
            time.sleep(WAITING_PAUSE / 2)

    def _take_flock(self, deadline: float | None, exclusive: bool) -> None:
        fd = self._open()
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            self._wait_for_flock(fd, mode, deadline)
        with self._state:
            self._flocked = True
            self._shared = not exclusive

    def _wait_for_flock(self, fd: int, mode: int, deadline: float | None) -> None:
        """Poll for the flock, saying meanwhile (a shared lock on the want file) that this
        process waits, so a process keeping it for queued mirror writes hands it over."""
        want = self._want()
        wanting = False
        pause = 0.0005
        try:
            while True:
                if not wanting:
                    with contextlib.suppress(BlockingIOError):  # a holder is checking: retry
                        fcntl.flock(want, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        wanting = True
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    if deadline is not None and time.monotonic() + pause > deadline:
                        raise MirrorBusy(
                            "another process held the mirror lock past the write's time bound"
                        ) from None
                    time.sleep(pause)
                    pause = min(pause * 2, WAITING_PAUSE if wanting else 0.02)
        finally:
            if wanting:
                fcntl.flock(want, fcntl.LOCK_UN)

    def _unlock_if_idle(self) -> None:
        """Give the flock back once nobody holds the lock and nothing is retained (call
        with ``_state`` held)."""
        if self._flocked and not self._inside and self._retained == 0:
            self._unlock()

    def _unlock(self) -> None:
        """Give the flock back (call with ``_state`` held)."""
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._flocked = self._shared = False

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

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's queued mirror writes are not the child's to wait
        for, and a lock a vanished thread held would never be released."""
        self._thread_lock = threading.Lock()
        self._state = threading.Condition()
        self._retained = 0
        self._inside = False

    @property
    def retained(self) -> int:
        """Records committed by this process whose mirrors are not written yet."""
        return self._retained

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._flocked = self._shared = False
        if self._want_fd is not None:
            os.close(self._want_fd)
            self._want_fd = None


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
