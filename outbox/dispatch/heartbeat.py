"""A running dispatcher's heartbeat: its own thread rewrites its row every interval.

``outbox status`` shows each dispatcher, and one that stopped beating as gone. The thread is
separate from the sink workers and the maintenance round, so a long batch or a slow repair
does not make a live dispatcher look dead; a beat that fails (the database locked for a
while) is logged and tried again at the next interval.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

from outbox.dispatch.classify import first_line
from outbox.store.heartbeats import Heartbeat

if TYPE_CHECKING:
    from outbox.dispatch.dispatcher import Dispatcher

log = logging.getLogger(__name__)

# Beats a dispatcher may miss before it is shown as gone (plus the database's busy timeout,
# which a beat may spend waiting for the lock).
MISSED_BEATS = 3
# Rows of dispatchers silent for this long are deleted when a dispatcher starts.
FORGET_AFTER_SECONDS = 86400.0


def gone_after(interval: float, busy_timeout: float) -> float:
    """How long without a beat before a dispatcher counts as gone."""
    return MISSED_BEATS * interval + busy_timeout


class HeartbeatThread:
    """Beats for ``dispatcher`` from ``start()`` to ``stop()``; ``stop`` records a clean exit."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        settings = dispatcher.settings
        self.interval = settings.heartbeat_interval
        self.gone_after = gone_after(self.interval, settings.busy_timeout)
        self.started_at = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[float, int] = (self.started_at, 0)
        self._failing = False

    def start(self) -> None:
        try:
            self.dispatcher.storage.heartbeats.prune(time.time() - FORGET_AFTER_SECONDS)
        except Exception as exc:
            log.warning("old heartbeats not pruned (%s); next start tries again", first_line(exc))
        self.beat()
        self._thread = threading.Thread(target=self._loop, name="outbox-heartbeat", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def _totals(self) -> tuple[int, int]:
        """(records delivered or deleted, records failed) by every sink since the start."""
        progress = [worker.progress for worker in self.dispatcher.workers.values()]
        done = sum(p.delivered + p.deleted for p in progress)
        return done, sum(p.retried + p.dead for p in progress)

    def beat(self) -> None:
        """Write this dispatcher's row now; records per second are since the previous beat."""
        now = time.time()
        done, failed = self._totals()
        then, done_then = self._last
        rate = (done - done_then) / (now - then) if now > then else 0.0
        heartbeat = Heartbeat(
            owner=self.dispatcher.owner,
            host=socket.gethostname(),
            pid=os.getpid(),
            sinks=tuple(self.dispatcher.workers),
            started_at=self.started_at,
            beat_at=now,
            gone_after=self.gone_after,
            last_batch_at=self.dispatcher.last_batch_at,
            delivered=done,
            failed=failed,
            records_per_second=round(rate, 3),
        )
        try:
            self.dispatcher.storage.heartbeats.beat(heartbeat)
        except Exception as exc:
            if not self._failing:
                log.warning("heartbeat not recorded (%s); trying again", first_line(exc))
            self._failing = True
            return
        if self._failing:
            log.info("heartbeat recorded again")
        self._failing = False
        self._last = (now, done)

    def stop(self) -> None:
        """Stop beating and mark the row stopped, so status never shows this one as gone."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + self.dispatcher.settings.busy_timeout + 1)
        try:
            self.dispatcher.storage.heartbeats.stop(self.dispatcher.owner, time.time())
        except Exception as exc:
            log.warning("clean stop not recorded (%s); status will show it gone", first_line(exc))
