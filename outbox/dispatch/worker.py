"""Delivery for one sink: claim a batch, call the sink under a hard timeout, settle.

The sink is called with no transaction open; a lease, renewed while the call runs long,
keeps a live dispatcher's rows away from others while letting a dead one's be claimed again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from outbox.core.record import Record
from outbox.core.states import DeliveryOp
from outbox.dispatch.batch_report import BatchReport
from outbox.dispatch.classify import classify
from outbox.sinks.base import (
    Deleted,
    DeleteOutcome,
    Delivered,
    Held,
    NotDelivered,
    Outcome,
    Sink,
    describe,
)
from outbox.sinks.registry import adopt, load_sink
from outbox.store.deliveries import Claim

if TYPE_CHECKING:
    from outbox.dispatch.dispatcher import Dispatcher

log = logging.getLogger(__name__)


class SinkTimeout(TimeoutError):
    """The sink did not answer within ``OUTBOX_SINK_TIMEOUT``."""


@dataclass
class SinkProgress:
    sink: str
    delivered: int = 0
    deleted: int = 0
    retried: int = 0
    dead: int = 0
    batches: int = 0
    last_error: str | None = None


class SinkWorker:
    """Delivery for one sink: its own sink object, call thread and progress."""

    def __init__(self, dispatcher: Dispatcher, name: str, sink: Sink | None) -> None:
        self.dispatcher = dispatcher
        self.name = name
        self._sink = adopt(sink, name) if sink is not None else None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.progress = SinkProgress(name)
        self.batch = BatchReport(name, 0)  # the batch under way, for its log line

    @property
    def sink(self) -> Sink:
        if self._sink is None:
            self._sink = load_sink(self.name, self.dispatcher.settings)
        return self._sink

    def _call(self, batch: Sequence[Record], claims: Sequence[Claim]) -> list[Outcome]:
        """Deliver ``batch`` with a hard timeout, renewing the lease while it works."""
        outcomes: list[Outcome] = self._timed(self.sink.deliver, batch, claims)
        return outcomes

    def _timed(self, call: Callable[[Any], list[Any]], arg: Any, claims: Sequence[Claim]) -> Any:
        """Run one sink call with a hard timeout, renewing the lease while it works."""
        settings = self.dispatcher.settings
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"outbox-sink-{self.name}"
            )
        future = self._executor.submit(call, arg)
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
                self.dispatcher.storage.deliveries.renew(
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
        try:
            self.sink  # noqa: B018 - load it before claiming: a load error is not the records'
        except Exception as exc:
            self.progress.last_error = exc.__class__.__name__
            log.error(
                "sink %s cannot be loaded (%s); its rows stay pending",
                self.name,
                describe(exc),  # no record is involved yet: the text cannot quote one
            )
            return 0
        claims = d.storage.deliveries.claim(self.name, d.owner, d.batch_size, d.lease_seconds)
        if not claims:
            return 0
        self.batch, before = BatchReport(self.name, len(claims)), replace(self.progress)
        deletes = [claim for claim in claims if claim.op == DeliveryOp.DELETE]
        if deletes:
            self._delete(deletes)
        stored = d.storage.records.get_records(
            claim.key for claim in claims if claim.op != DeliveryOp.DELETE
        )
        # A record forgotten since the claim is not sent: the forget took the row over.
        live = [
            claim
            for claim in claims
            if claim.op != DeliveryOp.DELETE
            and claim.key in stored
            and not stored[claim.key].forgotten
        ]
        if live:
            self._deliver(live, [stored[claim.key].record for claim in live])
        d.mirror_outcomes(stored)
        if d.on_progress:
            d.on_progress(self.progress)
        delivered, deleted = self.progress.delivered, self.progress.deleted
        committed = {key: item.created_at for key, item in stored.items()}
        self.batch.finish(delivered - before.delivered, deleted - before.deleted, committed)
        d.batch_done(self.batch)
        return len(claims)

    def _deliver(self, live: list[Claim], batch: list[Record]) -> None:
        try:
            outcomes: list[Outcome] = self._call(batch, live)
            if len(outcomes) != len(batch):
                raise RuntimeError(
                    f"{self.name} returned {len(outcomes)} outcomes for {len(batch)} records"
                )
        except Exception as exc:  # the whole batch failed (transport, timeout, sink bug)
            outcomes = self._isolate(batch, live, exc)
        self._settle(live, outcomes)

    def _delete(self, claims: list[Claim]) -> None:
        """Carry out a forget's deletes: settled like deliveries, retried the same way."""
        rows = self.dispatcher.storage.deliveries.deliveries_for(claim.key for claim in claims)
        ids = {
            row.key: row.sink_id
            for group in rows.values()
            for row in group
            if row.sink == self.name
        }
        items = [Held(claim.key, ids.get(claim.key)) for claim in claims]
        try:
            outcomes: list[DeleteOutcome] = self._timed(self.sink.delete, items, claims)
            if len(outcomes) != len(items):
                raise RuntimeError(
                    f"{self.name} returned {len(outcomes)} outcomes for {len(items)} deletes"
                )
        except Exception as exc:
            outcomes = [exc] * len(items)
        self._settle(claims, outcomes)

    def _settle(self, claims: Sequence[Claim], outcomes: Sequence[Outcome | DeleteOutcome]) -> None:
        """Record each outcome: delivered with its id (or deleted), retried later, or
        dead-lettered."""
        d = self.dispatcher
        now = time.time()
        delivered: list[tuple[int, str]] = []
        deleted: list[int] = []
        failed: list[tuple[int, str, str, float | None]] = []
        for claim, outcome in zip(claims, outcomes, strict=True):
            if isinstance(outcome, Delivered) and outcome.sink_id:
                delivered.append((claim.delivery_id, str(outcome.sink_id)))
                self.batch.delivered_key(claim.key)
                continue
            if isinstance(outcome, Deleted):
                deleted.append(claim.delivery_id)
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
            self.batch.failed(claim.key, failure, outcome, dead=next_at is None)
            log.log(  # a retry is in the batch's line; a dead letter is the operator's to act on
                logging.WARNING if next_at is None else logging.DEBUG,
                "%s of %s to %s failed (%s)%s",
                "delete" if claim.op == DeliveryOp.DELETE else "delivery",
                claim.key[:12],
                self.name,
                failure.reason,
                f"; dead letter: `outbox dead show {claim.key[:12]}`, then retry or discard"
                if next_at is None
                else "; will retry",
            )
            log.debug("failure detail for %s: %s", claim.key[:12], failure.message)
        d.storage.deliveries.settle(
            d.owner,
            delivered,
            failed,
            now,
            # Only a vector index's deliveries let the lexical overlay drop their records.
            purge_search_index=self._sink is not None and self._sink.semantic,
            deleted=deleted,
        )
        self.progress.delivered += len(delivered)
        self.progress.deleted += len(deleted)
        self.progress.batches += 1

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
