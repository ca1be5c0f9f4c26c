"""The process's mirror writer: a thread that writes committed records' mirrors off the
caller's clock.

A receipt promises the commit. Each record's JSONL line and markdown file are written here
right after it, in commit order, while the mirror lock keeps the process's ``flock``
(``MirrorLock.retain``), so no other process sees the commit without its mirrors. ``flush``
waits for them (``close`` and interpreter exit call it); a crash before they are written
leaves what the next open's repair writes, as a writer killed after its commit always did.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from outbox.mirror.lock import MirrorLock

log = logging.getLogger(__name__)

Item = TypeVar("Item")

# Above this many records waiting, a committing writer waits for the thread to catch up
# (within its own time bound): the lag stays bounded when the disk is slower than commits.
MAX_QUEUED = 4096
# How long the thread lets records gather before it writes their files: files created in
# bursts leave most commits' fsyncs without new file metadata to carry through the file
# system's journal (an A/B on ext4, alternating in one process: add's median 1.97x its floor
# written at once, 1.69x gathered for 2 ms). Bounded by COALESCE_RECORDS.
COALESCE_SECONDS = 0.002
COALESCE_RECORDS = 256
# Lag samples kept for ``lags()`` (the benchmark's mirror-lag figure).
LAG_SAMPLES = 100_000
# How long interpreter exit waits for the queue to be written.
EXIT_FLUSH_SECONDS = 30.0


class MirrorWriter(Generic[Item]):
    """Writes submitted items in order on one daemon thread, started on first use.

    ``write`` is called with every item queued since its last call, oldest first; it must
    not raise for a single bad item (an error is logged and repair restores the mirrors).
    """

    def __init__(self, lock: MirrorLock, write: Callable[[Sequence[Item]], None]) -> None:
        self._lock = lock
        self._write = write
        self._ready = threading.Condition()  # guards the queue and the counters below
        self._queue: collections.deque[tuple[float, Sequence[Item]]] = collections.deque()
        self._queued = 0  # items in the queue
        self._busy = 0  # items being written right now
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._lags: collections.deque[float] = collections.deque(maxlen=LAG_SAMPLES)
        _live.add(self)

    def submit(self, items: Sequence[Item], deadline: float | None = None) -> None:
        """Queue ``items`` (one committed transaction's records) to be written next.

        The caller holds the mirror lock and has just committed: the lock keeps the flock
        for them until they are written. A full queue makes the caller wait for room, but
        never past ``deadline``.
        """
        if not items:
            return
        self._lock.retain(len(items))
        with self._ready:
            if self._queued >= MAX_QUEUED:
                self._ready.wait_for(
                    lambda: self._queued < MAX_QUEUED,
                    None if deadline is None else max(0.0, deadline - time.monotonic()),
                )
            first = not self._queue
            self._queue.append((time.monotonic(), items))
            self._queued += len(items)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="outbox-mirror-writer", daemon=True
                )
                self._thread.start()
            if first or self._queued >= COALESCE_RECORDS:  # else it is gathering: let it be
                self._ready.notify_all()

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:
                    return
                self._ready.wait_for(
                    lambda: self._stopping or self._queued >= COALESCE_RECORDS,
                    max(0.0, self._queue[0][0] + COALESCE_SECONDS - time.monotonic()),
                )
                batches = list(self._queue)
                self._queue.clear()
                count = sum(len(items) for _, items in batches)
                self._queued -= count
                self._busy = count
                self._ready.notify_all()  # room for writers waiting on a full queue
            try:
                self._write([item for _, items in batches for item in items])
            except Exception as exc:  # the records stand, committed; repair writes these
                log.warning("mirror write failed (%s); repair will restore it", type(exc).__name__)
            finally:
                done = time.monotonic()
                self._lags.extend(done - queued for queued, items in batches for _ in items)
                with self._ready:
                    self._busy = 0
                    self._ready.notify_all()
                self._lock.release(count)

    @property
    def pending(self) -> int:
        """Records committed but not yet mirrored."""
        return self._queued + self._busy

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written; False if ``timeout`` passed."""
        with self._ready:
            return self._ready.wait_for(lambda: self.pending == 0, timeout)

    def _forget_after_fork(self) -> None:
        """In a forked child: the queue is the parent's to write (its records are the
        parent's commits), and the locks may have been held by threads the child lacks."""
        self._ready = threading.Condition()
        self._queue.clear()
        self._queued = self._busy = 0
        self._thread = None
        self._lock.forget_after_fork()

    def lags(self) -> list[float]:
        """Seconds from commit to written mirrors, per record, for the recent records."""
        return list(self._lags)

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued, then stop the thread; False if ``timeout`` passed first."""
        flushed = self.flush(timeout)
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        _live.discard(self)
        return flushed


_live: weakref.WeakSet[MirrorWriter[Any]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for writer in list(_live):
        writer._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _flush_at_exit() -> None:
    """A process that exits without ``close()`` still leaves its mirrors written."""
    for writer in list(_live):
        if not writer.flush(EXIT_FLUSH_SECONDS):
            log.warning("mirror writes still pending at exit; the next open writes them")
