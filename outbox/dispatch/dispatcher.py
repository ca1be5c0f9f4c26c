"""The dispatcher: one worker per sink, draining once (``drain``) or as a daemon (``run``).

Each sink gets its own worker thread, rows, attempts and backoff, so a slow or dead sink
never delays another (the per-batch work is in ``dispatch/worker.py``). It is handed the
storage, the mirrors and the settings it uses, never the façade.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outbox.core.errors import RecordFileError
from outbox.core.states import UNDELIVERED, DeliveryState
from outbox.dispatch.batch_report import BatchReport
from outbox.dispatch.classify import first_line
from outbox.dispatch.heartbeat import HeartbeatThread
from outbox.dispatch.retry import RetryPolicy
from outbox.dispatch.worker import SinkProgress, SinkWorker
from outbox.sinks.base import Sink
from outbox.store.heartbeats import ALIVE
from outbox.store.wakeup import Listener

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.mirror.mirrors import Mirrors
    from outbox.store.rows import StoredRecord
    from outbox.store.storage import Storage

log = logging.getLogger(__name__)

Progress = Callable[[SinkProgress], None]
# Registers a callback for this process's writes; returns what unregisters it.
Subscribe = Callable[[Callable[[], object]], Callable[[], None]]


@dataclass
class DrainReport:
    sinks: dict[str, SinkProgress] = field(default_factory=dict)
    remaining: dict[str, dict[str, int]] = field(default_factory=dict)
    elapsed: float = 0.0
    # The timeout ran out while another dispatcher still held rows it was waiting for.
    timed_out: bool = False

    @property
    def delivered(self) -> int:
        return sum(p.delivered for p in self.sinks.values())

    @property
    def ok(self) -> bool:
        """True when nothing is left pending, leased or dead for any sink."""
        return all(
            sum(counts.get(state, 0) for state in (*UNDELIVERED, DeliveryState.DEAD)) == 0
            for counts in self.remaining.values()
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "elapsed": round(self.elapsed, 3),
            "timed_out": self.timed_out,
            "delivered": self.delivered,
            "sinks": {
                name: {
                    "delivered": p.delivered,
                    "deleted": p.deleted,
                    "retried": p.retried,
                    "dead": p.dead,
                    "batches": p.batches,
                    "remaining": self.remaining.get(name, {}),
                }
                for name, p in self.sinks.items()
            },
        }


def new_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Dispatcher:
    """Drains an outbox into its sinks; ``drain`` stops when nothing is due, ``run`` loops."""

    def __init__(
        self,
        storage: Storage,
        mirrors: Mirrors,
        settings: Settings,
        *,
        sinks: Sequence[str] | None = None,
        sink_objects: dict[str, Sink] | None = None,
        batch_size: int | None = None,
        lease_seconds: float | None = None,
        policy: RetryPolicy | None = None,
        on_progress: Progress | None = None,
        owner: str | None = None,
        chores: Sequence[Callable[[], object]] = (),
        local_writes: Subscribe | None = None,
    ) -> None:
        """``chores`` run in each maintenance round of ``run`` (the façade imports fallback
        files there); ``local_writes`` lets this process's writes wake ``run`` at once."""
        self.storage = storage
        self.mirrors = mirrors
        self.settings = settings
        self.owner = owner or new_owner()
        self.batch_size = batch_size or settings.batch_size
        self.lease_seconds = lease_seconds or settings.lease_seconds
        self.policy = policy or RetryPolicy(max_retries=settings.max_retries)
        self.on_progress = on_progress
        self.random = random.Random()
        self.chores = list(chores)
        self.local_writes = local_writes
        names = list(sinks or settings.sinks)
        objects = sink_objects or {}
        self.workers = {name: SinkWorker(self, name, objects.get(name)) for name in names}
        self.stop_event = threading.Event()
        self._wakes = {name: threading.Event() for name in self.workers}
        self._unsubscribe: Callable[[], None] | None = None
        # Each batch's report goes to these (the metrics, when served) after its log line.
        self.batch_observers: list[Callable[[BatchReport], object]] = []
        self.last_batch_at: float | None = None
        self._timed_out = False  # a drain's deadline came while others held rows
        self._taken_back: set[tuple[str, str]] = set()  # (sink, owner): once per drain

    def batch_done(self, report: BatchReport) -> None:
        """One line per batch (INFO, or WARNING with the first failure's cause), then the
        observers; an observer's error never stops delivery."""
        self.last_batch_at = time.time()
        log.log(report.level, "%s", report.line())
        for observe in self.batch_observers:
            try:
                observe(report)
            except Exception as exc:
                log.warning("batch observer failed: %s", exc.__class__.__name__)

    def wake(self) -> None:
        """Something was written: every sink's loop looks for work now, not at its next poll."""
        for event in self._wakes.values():
            event.set()

    def mirror_outcomes(self, known: Mapping[str, StoredRecord] | None = None) -> None:
        """Write settled outcomes to the mirrors (JSONL events, front matter); ``known`` are
        records the batch already read, which the sync then does not read again."""
        try:
            self.mirrors.sync_deliveries(known)
        except RecordFileError as exc:  # its text names the record by key prefix, never words
            log.warning("mirror update after delivery failed: %s; it stays owed", exc)
        except Exception as exc:
            log.warning(
                "mirror update after delivery failed (%s); repair will redo it",
                exc.__class__.__name__,
            )

    def _drain_sink(self, worker: SinkWorker, deadline: float | None) -> None:
        while not self.stop_event.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                self._timed_out |= bool(
                    self.storage.deliveries.leases_held(worker.name, self.owner)
                )
                return
            try:
                if worker.run_batch() == 0 and not self._held_elsewhere(worker.name, deadline):
                    return
            except Exception as exc:
                log.error("dispatcher for %s stopped: %s", worker.name, first_line(exc))
                worker.progress.last_error = exc.__class__.__name__
                return

    def _held_elsewhere(self, sink: str, deadline: float | None) -> bool:
        """Nothing of ``sink`` is due: whether rows another dispatcher holds are worth
        another claim. Those of a dispatcher whose heartbeat shows it gone are taken back at
        once; with a ``deadline``, a live holder's are waited for (one poll, or until its
        first lease runs out), since it may finish them or its leases may lapse."""
        held = self.storage.deliveries.leases_held(sink, self.owner)
        if not held:
            return False
        now = time.time()
        beats = {beat.owner: beat for beat in self.storage.heartbeats.all()}
        gone = [
            owner
            for owner in held
            if owner in beats
            and beats[owner].state(now) != ALIVE
            and (sink, owner) not in self._taken_back  # a sink that cannot load claims none
        ]
        if gone:
            taken = self.storage.deliveries.take_back(sink, gone)
            self._taken_back.update((sink, owner) for owner in gone)
            log.info("%s: took back %d rows of %d gone dispatcher(s)", sink, taken, len(gone))
            return True
        if deadline is None:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        poll = self.settings.poll_interval
        lapse = min(held.values()) - now  # past already: no claim took them, so poll
        self.stop_event.wait(max(0.05, min(left, lapse if lapse > 0 else poll, poll)))
        return True

    def drain(self, timeout: float | None = None) -> DrainReport:
        """Deliver everything due now to every sink in parallel, then report what is left.
        Within a ``timeout``, rows another dispatcher holds are waited for and delivered
        (``_held_elsewhere``); a record in backoff is not due, so it is not waited for."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        self._timed_out = False
        self._taken_back.clear()
        threads = [
            threading.Thread(
                target=self._drain_sink, args=(worker, deadline), name=f"outbox-drain-{name}"
            )
            for name, worker in self.workers.items()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        counts = self.storage.deliveries.counts()
        return DrainReport(
            sinks={name: worker.progress for name, worker in self.workers.items()},
            remaining={name: counts.get(name, {}) for name in self.workers},
            elapsed=time.monotonic() - started,
            timed_out=self._timed_out,
        )

    def _run_sink(self, worker: SinkWorker, wake: threading.Event) -> None:
        poll = self.settings.poll_interval
        while not self.stop_event.is_set():
            try:
                claimed = worker.run_batch()
            except Exception as exc:
                log.error("batch for %s failed: %s", worker.name, first_line(exc))
                claimed = 0
            if claimed:
                continue
            wake.wait(poll)
            wake.clear()

    def run(self, stop: threading.Event | None = None) -> None:
        """The daemon loop: every sink in its own thread until ``stop`` (or SIGTERM) is set."""
        if stop is not None:
            self.stop_event = stop
        if self.local_writes is not None and self._unsubscribe is None:
            self._unsubscribe = self.local_writes(self.wake)
        Listener(self.storage.engine, self.wake, self.stop_event).start()
        threads = [
            threading.Thread(
                target=self._run_sink,
                args=(worker, self._wakes[name]),
                name=f"outbox-run-{name}",
                daemon=True,
            )
            for name, worker in self.workers.items()
        ]
        for thread in threads:
            thread.start()
        heartbeat = HeartbeatThread(self)
        heartbeat.start()
        retention = self.settings.retention
        while not self.stop_event.wait(min(30.0, max(1.0, retention / 10))):
            try:
                self.maintain()
            except Exception as exc:  # a database locked for a while: try again next round
                log.warning("maintenance failed (%s); retrying later", exc.__class__.__name__)
        self.wake()
        for thread in threads:
            thread.join(timeout=self.settings.sink_timeout + 5)
        heartbeat.stop()

    def maintain(self) -> int:
        """Prune delivered rows past retention, run the chores, catch the mirrors up."""
        cutoff = time.time() - self.settings.retention
        pruned = self.storage.deliveries.prune_delivered(list(self.workers), cutoff)
        for chore in self.chores:
            chore()
        self.mirrors.repair()
        return pruned

    def close(self) -> None:
        """Stop, hand back unfinished claims, close sinks."""
        self.stop_event.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        released = self.storage.deliveries.release(self.owner)
        if released:
            log.info("released %d claimed rows on shutdown", released)
        for worker in self.workers.values():
            worker.close()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
