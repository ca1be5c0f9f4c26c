"""The dispatcher: claims due outbox rows per sink, delivers them, settles the outcome.

Each sink gets its own worker thread, rows, attempts and backoff, so a slow or dead sink
never delays another. No database transaction is open while a sink runs: claim, deliver and
settle are three separate steps, and a lease (renewed while a call runs long) keeps a live
dispatcher's rows away from others while letting a dead one's rows be claimed again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outbox.dispatch.classify import classify
from outbox.dispatch.retry import RetryPolicy
from outbox.record import Record
from outbox.sinks.base import Delivered, NotDelivered, Outcome, Sink
from outbox.sinks.registry import load_sink
from outbox.store.storage import DEAD, LEASED, PENDING, Claim
from outbox.store.wakeup import Listener

if TYPE_CHECKING:
    from outbox.api import Outbox

log = logging.getLogger(__name__)

Progress = Callable[["SinkProgress"], None]


class SinkTimeout(TimeoutError):
    """The sink did not answer within ``OUTBOX_SINK_TIMEOUT`` (seed 000: slower than 25 s)."""


@dataclass
class SinkProgress:
    sink: str
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    batches: int = 0
    last_error: str | None = None


@dataclass
class DrainReport:
    sinks: dict[str, SinkProgress] = field(default_factory=dict)
    remaining: dict[str, dict[str, int]] = field(default_factory=dict)
    elapsed: float = 0.0

    @property
    def delivered(self) -> int:
        return sum(p.delivered for p in self.sinks.values())

    @property
    def ok(self) -> bool:
        """True when nothing is left pending, leased or dead for any sink."""
        return all(
            counts.get(PENDING, 0) + counts.get(LEASED, 0) + counts.get(DEAD, 0) == 0
            for counts in self.remaining.values()
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "elapsed": round(self.elapsed, 3),
            "delivered": self.delivered,
            "sinks": {
                name: {
                    "delivered": p.delivered,
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


class _SinkWorker:
    """Delivery for one sink: its own sink object, call thread and progress."""

    def __init__(self, dispatcher: Dispatcher, name: str, sink: Sink | None) -> None:
        self.dispatcher = dispatcher
        self.name = name
        self._sink = sink
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.progress = SinkProgress(name)

    @property
    def sink(self) -> Sink:
        if self._sink is None:
            self._sink = load_sink(self.name, self.dispatcher.outbox.settings)
        return self._sink

    def _call(self, batch: Sequence[object], claims: Sequence[Claim]) -> list[Outcome]:
        """Run the sink with a hard timeout, renewing the lease while it works."""
        settings = self.dispatcher.outbox.settings
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"outbox-sink-{self.name}"
            )
        future = self._executor.submit(self.sink.deliver, batch)
        deadline = time.monotonic() + settings.sink_timeout
        renew_every = max(0.5, self.dispatcher.lease_seconds / 3.0)
        ids = [claim.delivery_id for claim in claims]
        while True:
            wait = min(renew_every, deadline - time.monotonic())
            if wait <= 0:
                self._abandon()
                raise SinkTimeout(f"{self.name} did not answer within {settings.sink_timeout:g}s")
            try:
                return future.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                self.dispatcher.outbox.storage.renew(
                    self.dispatcher.owner, ids, self.dispatcher.lease_seconds
                )

    def _abandon(self) -> None:
        """Leave a hung call behind: a fresh thread and sink object serve the next batch.

        The old sink is closed in the background (its close may wait on the hung call), so
        an MCP sink's server process or a store's handle is not left behind.
        """
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = None
        old, self._sink = self._sink, None
        if old is not None:
            threading.Thread(
                target=_close_quietly, args=(old, self.name), name="outbox-sink-close", daemon=True
            ).start()

    def _isolate(self, batch: list[Record], claims: list[Claim], exc: Exception) -> list[Outcome]:
        """After a permanent whole-batch error, try records one by one, so one poison record
        is dead-lettered alone instead of taking its batch-mates with it."""
        if len(batch) < 2 or classify(exc).transient:
            return [exc] * len(batch)
        outcomes: list[Outcome] = []
        for record, claim in zip(batch, claims, strict=True):
            try:
                (outcome,) = self._call([record], [claim])
            except Exception as single:
                outcome = single
            outcomes.append(outcome)
        return outcomes

    def run_batch(self) -> int:
        """Claim, deliver and settle one batch; returns how many rows were claimed."""
        d = self.dispatcher
        storage = d.outbox.storage
        try:
            self.sink  # noqa: B018 - load it before claiming: a load error is not the records'
        except Exception as exc:
            self.progress.last_error = exc.__class__.__name__
            log.error(
                "sink %s cannot be loaded (%s); its rows stay pending",
                self.name,
                exc.__class__.__name__,
            )
            return 0
        claims = storage.claim(self.name, d.owner, d.batch_size, d.lease_seconds)
        if not claims:
            return 0
        stored = storage.get_records(claim.key for claim in claims)
        live = [claim for claim in claims if claim.key in stored]
        batch = [stored[claim.key].record for claim in live]
        try:
            outcomes: list[Outcome] = self._call(batch, live)
            if len(outcomes) != len(batch):
                raise RuntimeError(
                    f"{self.name} returned {len(outcomes)} outcomes for {len(batch)} records"
                )
        except Exception as exc:  # the whole batch failed (transport, timeout, sink bug)
            outcomes = self._isolate(batch, live, exc)
        now = time.time()
        delivered: list[tuple[int, str]] = []
        failed: list[tuple[int, str, str, float | None]] = []
        for claim, outcome in zip(live, outcomes, strict=True):
            if isinstance(outcome, Delivered) and outcome.sink_id:
                delivered.append((claim.delivery_id, str(outcome.sink_id)))
                continue
            if isinstance(outcome, Delivered):
                outcome = NotDelivered("the sink returned no id")
            failure = classify(outcome)
            next_at = (
                d.policy.next_attempt_at(claim.attempts, now, d.random.random())
                if failure.transient
                else None
            )
            failed.append((claim.delivery_id, failure.message, failure.reason, next_at))
            if next_at is None:
                self.progress.dead += 1
            else:
                self.progress.retried += 1
            self.progress.last_error = failure.reason
            log.warning(
                "delivery of %s to %s failed (%s)%s",
                claim.key[:12],
                self.name,
                failure.reason,
                "; dead letter" if next_at is None else "; will retry",
            )
            log.debug("failure detail for %s: %s", claim.key[:12], failure.message)
        storage.settle(
            d.owner,
            delivered,
            failed,
            now,
            purge_search_index=bool(getattr(self._sink, "semantic", False)),
        )
        self.progress.delivered += len(delivered)
        self.progress.batches += 1
        d.mirror_outcomes()
        if d.on_progress:
            d.on_progress(self.progress)
        return len(claims)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._sink is not None:
            _close_quietly(self._sink, self.name)
        self._sink = None


def _close_quietly(sink: Sink, name: str) -> None:
    try:
        sink.close()
    except Exception as exc:
        log.warning("closing sink %s failed: %s", name, exc.__class__.__name__)


class Dispatcher:
    """Drains an outbox into its sinks; ``drain`` stops when nothing is due, ``run`` loops."""

    def __init__(
        self,
        outbox: Outbox,
        *,
        sinks: Sequence[str] | None = None,
        sink_objects: dict[str, Sink] | None = None,
        batch_size: int | None = None,
        lease_seconds: float | None = None,
        policy: RetryPolicy | None = None,
        on_progress: Progress | None = None,
        owner: str | None = None,
    ) -> None:
        settings = outbox.settings
        self.outbox = outbox
        self.owner = owner or new_owner()
        self.batch_size = batch_size or settings.batch_size
        self.lease_seconds = lease_seconds or settings.lease_seconds
        self.policy = policy or RetryPolicy(max_retries=settings.max_retries)
        self.on_progress = on_progress
        self.random = random.Random()
        names = list(sinks or settings.sinks)
        objects = sink_objects or {}
        self.workers = {name: _SinkWorker(self, name, objects.get(name)) for name in names}
        self.stop_event = threading.Event()
        self._last_prune = 0.0

    def mirror_outcomes(self) -> None:
        """Write settled outcomes to the mirrors (JSONL events, front matter)."""
        try:
            self.outbox.sync_delivery_mirrors()
        except Exception as exc:
            log.warning(
                "mirror update after delivery failed (%s); repair will redo it",
                exc.__class__.__name__,
            )

    def _drain_sink(self, worker: _SinkWorker, deadline: float | None) -> None:
        while not self.stop_event.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return
            try:
                if worker.run_batch() == 0:
                    return
            except Exception as exc:
                log.error("dispatcher for %s stopped: %s", worker.name, exc.__class__.__name__)
                worker.progress.last_error = exc.__class__.__name__
                return

    def drain(self, timeout: float | None = None) -> DrainReport:
        """Deliver everything due now to every sink in parallel, then report what is left."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
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
        counts = self.outbox.storage.counts()
        return DrainReport(
            sinks={name: worker.progress for name, worker in self.workers.items()},
            remaining={name: counts.get(name, {}) for name in self.workers},
            elapsed=time.monotonic() - started,
        )

    def _run_sink(self, worker: _SinkWorker, wake: threading.Event) -> None:
        poll = self.outbox.settings.poll_interval
        while not self.stop_event.is_set():
            try:
                claimed = worker.run_batch()
            except Exception as exc:
                log.error("batch for %s failed: %s", worker.name, exc.__class__.__name__)
                claimed = 0
            if claimed:
                continue
            wake.wait(poll)
            wake.clear()

    def run(self, stop: threading.Event | None = None) -> None:
        """The daemon loop: every sink in its own thread until ``stop`` (or SIGTERM) is set."""
        if stop is not None:
            self.stop_event = stop
        wakes = {name: threading.Event() for name in self.workers}

        def wake_all() -> None:
            for event in wakes.values():
                event.set()

        self.outbox.add_listener(wake_all)
        Listener(self.outbox.engine, wake_all, self.stop_event).start()
        threads = [
            threading.Thread(
                target=self._run_sink,
                args=(worker, wakes[name]),
                name=f"outbox-run-{name}",
                daemon=True,
            )
            for name, worker in self.workers.items()
        ]
        for thread in threads:
            thread.start()
        retention = self.outbox.settings.retention
        while not self.stop_event.wait(min(30.0, max(1.0, retention / 10))):
            try:
                self.maintain()
            except Exception as exc:  # a database locked for a while: try again next round
                log.warning("maintenance failed (%s); retrying later", exc.__class__.__name__)
        for event in wakes.values():
            event.set()
        for thread in threads:
            thread.join(timeout=self.outbox.settings.sink_timeout + 5)

    def maintain(self) -> int:
        """Prune delivered rows past retention and catch the mirrors up."""
        cutoff = time.time() - self.outbox.settings.retention
        pruned = self.outbox.storage.prune_delivered(list(self.workers), cutoff)
        self.outbox.sync_mirrors()
        return pruned

    def close(self) -> None:
        """Stop, hand back unfinished claims, close sinks."""
        self.stop_event.set()
        released = self.outbox.storage.release(self.owner)
        if released:
            log.info("released %d claimed rows on shutdown", released)
        for worker in self.workers.values():
            worker.close()

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
