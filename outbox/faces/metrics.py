"""Prometheus metrics of a dispatcher daemon: ``outbox run --metrics-port N``.

Three feeds, each named in docs/operations.md:

- this daemon's own work, counted as its batches finish: deliveries, failures by reason,
  dead letters, batch duration, and delivery latency (the record's commit, as the database
  recorded it, to its delivery);
- the database, read at each scrape: rows per sink and state, pending depth, the oldest
  pending row's age, dead letters, records (live, and forgotten apart), dispatchers alive or
  gone, fallback files waiting;
- writes, which other processes make: read from the database as they land (this machine's
  records only), once each; a write the database refused, from the fallback index, once per
  file a scrape finds waiting, by the reason its front matter gives. ``outbox_add_seconds``
  is the part of each write the database can vouch for: from the record's canonical
  timestamp, taken when ``add`` built it, to the commit time stored with it, taken as its
  transaction starts. The commit itself (the wait for the write lock, the statements, the
  fsync) comes after and is recorded nowhere, so the series is a lower bound on ``add``'s
  latency; the benchmarks measure the whole call.

Every label value comes from a closed set (the enums of ``core/states.py``, the sinks the
owner configured, and the few words of this module); anything else, such as the free text of a
fallback file's front matter or a third-party sink's reason, is counted under ``other``, so a
scrape never carries what a file or an exception said.

``prometheus_client`` is imported here only, when a daemon is asked to serve; the endpoint
listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

from outbox.core.errors import OutboxError
from outbox.core.keys import parse_instant
from outbox.core.states import (
    UNDELIVERED,
    BuiltinSink,
    DeliveryState,
    FailureReason,
    FallbackReason,
    ReceiptStatus,
)
from outbox.store.heartbeats import ALIVE, GONE, STOPPED
from outbox.write.fallback import FallbackQueue

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.registry import Collector

    from outbox.dispatch.batch_report import BatchReport
    from outbox.dispatch.dispatcher import Dispatcher

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
# A record whose timestamp is further than this from its commit was given one by its caller
# (or came back from the fallback queue later): its gap says nothing about ``add``.
ADD_SAMPLE_LIMIT_SECONDS = 60.0
# New records read per scrape; a larger burst is read over the next scrapes.
WRITES_PER_SCRAPE = 5000
# The reason label of a waiting fallback file no scrape has read yet.
UNREAD = "unread"
# The one label value for anything outside a label's closed set.
OTHER = "other"
# The closed sets: a fallback file's reason (or not read yet), a sink's failure reason, and
# what follows a failure.
FALLBACK_REASONS = frozenset({*(reason.value for reason in FallbackReason), UNREAD})
FAILURE_REASONS = frozenset(reason.value for reason in FailureReason)
OUTCOMES = frozenset({"retry", "dead"})
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_DELIVERY_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


def closed_label(value: object, allowed: Collection[str]) -> str:
    """``value`` when it is one of ``allowed``, else ``other`` (pure): a label value never
    repeats text the library did not choose itself."""
    return str(value) if isinstance(value, str) and value in allowed else OTHER


def sink_labels(configured: Iterable[str]) -> frozenset[str]:
    """The sink names a label may carry: the built-in sinks and the ones the owner configured.
    Settings accept only ``chroma``, ``brainlayer`` or a ``module:attr`` name, chosen by the
    owner, so these are configuration, never memory text; a row's sink name read back from the
    database is not on its own a label value."""
    return frozenset({*(sink.value for sink in BuiltinSink), *configured})


class DaemonMetrics:
    """The daemon's registry: counters its batches feed, and the database read at scrape."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.dispatcher = dispatcher
        self.sinks = sink_labels(dispatcher.settings.sinks)
        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=True)
        # Registered first: a scrape reads the database (and new writes) before the rest.
        self.registry.register(cast("Collector", _DatabaseCollector(self)))
        self.deliveries = Counter(
            "outbox_deliveries",
            "Records this daemon delivered (the sink returned an id).",
            ["sink"],
            registry=self.registry,
        )
        self.deletes = Counter(
            "outbox_sink_deletes",
            "Forgotten records this daemon deleted from a sink.",
            ["sink"],
            registry=self.registry,
        )
        self.failures = Counter(
            "outbox_delivery_failures",
            "Failed delivery attempts by this daemon, by reason and what follows (retry, dead).",
            ["sink", "reason", "outcome"],
            registry=self.registry,
        )
        self.batch_seconds = Histogram(
            "outbox_batch_seconds",
            "How long one batch took: claim, sink call, settle, mirror update.",
            ["sink"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self.delivery_seconds = Histogram(
            "outbox_delivery_seconds",
            "From a record's commit to its delivery (commit to stored), per sink.",
            ["sink"],
            buckets=_DELIVERY_SECONDS,
            registry=self.registry,
        )
        self.writes = Counter(
            "outbox_writes",
            "Writes on this machine since the daemon started, by receipt status and, for a "
            "fallback, its reason (read from the database as they land; fallback files as a "
            "scrape finds them waiting).",
            ["status", "reason"],
            registry=self.registry,
        )
        self.add_seconds = Histogram(
            "outbox_add_seconds",
            "The part of add before its commit, as the database records it: from the record's "
            "canonical timestamp (add built it) to its commit time (the transaction started); "
            "a lower bound on add's latency. This machine's writes, read by the daemon.",
            buckets=_SECONDS,
            registry=self.registry,
        )
        self._writes_lock = threading.Lock()
        self._seen_seq = self._last_seq()
        settings = dispatcher.settings
        self.fallback = FallbackQueue(settings.markdown_dir, settings.sinks)
        # Waiting fallback files and their reasons, as read; those waiting at the start are
        # not writes since the start.
        self._reasons: dict[str, str] = {}
        self._at_start = set(self.fallback.pending_names())
        self._counted: set[str] = set()  # fallback files counted as writes, not yet landed

    def observe_batch(self, report: BatchReport) -> None:
        """Count one finished batch (the dispatcher's batch observer)."""
        sink = closed_label(report.sink, self.sinks)
        self.deliveries.labels(sink).inc(report.delivered)
        self.deletes.labels(sink).inc(report.deleted)
        for (reason, outcome), count in report.failures.items():
            self.failures.labels(
                sink, closed_label(reason, FAILURE_REASONS), closed_label(outcome, OUTCOMES)
            ).inc(count)
        self.batch_seconds.labels(sink).observe(report.seconds)
        for seconds in report.delivery_latencies:
            self.delivery_seconds.labels(sink).observe(seconds)

    def _last_seq(self) -> int:
        """Where this machine's records stood when the daemon started: later ones are writes."""
        records = self.dispatcher.storage.records
        origin = self.dispatcher.settings.mirror_id
        seq = self.dispatcher.storage.mirror_state.mirror_watermark(origin).record_seq
        while batch := records.records_after(origin, seq, limit=WRITES_PER_SCRAPE):
            seq = batch[-1].seq
        return seq

    def catch_up_writes(self) -> None:
        """Count the writes that landed since the last scrape, and how long each one's add
        took as far as the database shows it."""
        with self._writes_lock:
            storage, origin = self.dispatcher.storage, self.dispatcher.settings.mirror_id
            landed = storage.records.records_after(origin, self._seen_seq, WRITES_PER_SCRAPE)
            for stored in landed:
                gap = stored.created_at - parse_instant(stored.record.timestamp).timestamp()
                if 0.0 <= gap <= ADD_SAMPLE_LIMIT_SECONDS:
                    self.add_seconds.observe(gap)
            # A fallback file counted while it waited is not a second write when it lands.
            counted = self._counted & {stored.markdown_name for stored in landed}
            self._counted -= counted
            queued = sum(1 for stored in landed if stored.markdown_name not in counted)
            if queued:
                self.writes.labels(ReceiptStatus.QUEUED.value, "").inc(queued)
            if landed:
                self._seen_seq = landed[-1].seq

    def fallback_waiting(self) -> dict[str, int]:
        """Fallback files waiting now, by reason. Each file is read once, at most
        ``WRITES_PER_SCRAPE`` per scrape (the rest count as ``unread`` until the next), and
        one first found after the daemon started is a write the database refused."""
        with self._writes_lock:
            names = self.fallback.pending_names()
            reasons: dict[str, str] = {}
            budget = WRITES_PER_SCRAPE
            for name in names:
                reason = self._reasons.get(name)
                if reason is None and budget > 0:
                    budget -= 1
                    reason = closed_label(self.fallback.reason_of(name), FALLBACK_REASONS)
                    if name not in self._at_start:
                        self.writes.labels(ReceiptStatus.FALLBACK.value, reason).inc()
                        self._counted.add(name)
                if reason is not None:
                    reasons[name] = reason
            self._reasons = reasons
            self._at_start &= set(names)
        by_reason: dict[str, int] = {}
        for name in names:
            reason = reasons.get(name, UNREAD)
            by_reason[reason] = by_reason.get(reason, 0) + 1
        return by_reason


class _DatabaseCollector:
    """Gauges read from the database at each scrape (every process's work, not only ours);
    ``outbox_up`` is 0 when the database could not be read this time."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterable[Any]:
        return []  # read at scrape; nothing to declare up front

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        up = GaugeMetricFamily("outbox_up", "1 when this scrape could read the database.")
        try:
            families = list(self._families())
        except Exception as exc:
            log.warning("metrics could not read the database (%s)", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _families(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        dispatcher = self.metrics.dispatcher
        storage, settings = dispatcher.storage, dispatcher.settings
        self.metrics.catch_up_writes()
        known = self.metrics.sinks
        # Rows of a sink no longer configured count under ``other``, merged.
        counts: dict[str, dict[str, int]] = {sink: {} for sink in settings.sinks}
        for sink, states in storage.deliveries.counts().items():
            merged = counts.setdefault(closed_label(sink, known), {})
            for state, count in states.items():
                merged[state] = merged.get(state, 0) + count
        oldest: dict[str, float] = {}
        for sink, created in storage.deliveries.oldest_pending().items():
            label = closed_label(sink, known)
            oldest[label] = min(created, oldest.get(label, created))
        now = time.time()
        rows = GaugeMetricFamily(
            "outbox_delivery_rows", "Outbox rows per sink and state.", labels=["sink", "state"]
        )
        pending = GaugeMetricFamily(
            "outbox_pending", "Rows a sink still has to take (pending or leased).", labels=["sink"]
        )
        age = GaugeMetricFamily(
            "outbox_oldest_pending_age_seconds",
            "Age of the oldest row a sink still has to take (0: none).",
            labels=["sink"],
        )
        dead = GaugeMetricFamily(
            "outbox_dead_letters", "Dead letters waiting for an operator.", labels=["sink"]
        )
        for sink, states in counts.items():
            for state in DeliveryState:
                rows.add_metric([sink, state.value], states.get(state.value, 0))
            pending.add_metric([sink], sum(states.get(state, 0) for state in UNDELIVERED))
            age.add_metric([sink], max(0.0, now - oldest[sink]) if sink in oldest else 0.0)
            dead.add_metric([sink], states.get(DeliveryState.DEAD, 0))
        yield from (rows, pending, age, dead)
        held = storage.records.counts()
        records = GaugeMetricFamily("outbox_records", "Live records (forgotten ones not).")
        records.add_metric([], held.live)
        forgotten = GaugeMetricFamily(
            "outbox_forgotten_records", "Forgotten records: tombstones that keep only a key."
        )
        forgotten.add_metric([], held.forgotten)
        yield from (records, forgotten)
        alive = GaugeMetricFamily(
            "outbox_dispatchers",
            "Dispatcher daemons on record: alive, gone (stopped beating), stopped.",
            labels=["state"],
        )
        beats = [beat.state(now) for beat in storage.heartbeats.all()]
        for beat_state in (ALIVE, GONE, STOPPED):
            alive.add_metric([beat_state], beats.count(beat_state))
        yield alive
        yield from self._fallback_waiting()

    def _fallback_waiting(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        by_reason = self.metrics.fallback_waiting()
        waiting = GaugeMetricFamily(
            "outbox_fallback_waiting",
            "Writes the database could not take, waiting in the fallback queue for import.",
        )
        waiting.add_metric([], sum(by_reason.values()))
        yield waiting
        reasons = GaugeMetricFamily(
            "outbox_fallback_waiting_by_reason",
            "The same fallback files, by the reason their front matter gives.",
            labels=["reason"],
        )
        for reason, count in sorted(by_reason.items()):
            reasons.add_metric([reason], count)
        yield reasons


@contextlib.contextmanager
def serve_metrics(dispatcher: Dispatcher, port: int) -> Iterator[str]:
    """Serve ``dispatcher``'s metrics on 127.0.0.1:``port`` until the block ends; yields the
    URL to scrape."""
    try:
        from prometheus_client import disable_created_metrics, start_http_server
    except ImportError:
        raise OutboxError(
            "metrics need prometheus_client (pip install 'memory-outbox[metrics]'), or unset "
            "--metrics-port and OUTBOX_METRICS_PORT"
        ) from None
    # The daemon's start is in its heartbeat; a _created series per counter adds nothing.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    metrics = DaemonMetrics(dispatcher)
    try:
        server, thread = start_http_server(port, addr=HOST, registry=metrics.registry)
    except OSError as exc:
        raise OutboxError(
            f"cannot serve metrics on {HOST}:{port} ({exc.strerror}); pick another port with "
            "--metrics-port or OUTBOX_METRICS_PORT"
        ) from None
    dispatcher.batch_observers.append(metrics.observe_batch)
    try:
        yield f"http://{HOST}:{port}/metrics"
    finally:
        dispatcher.batch_observers.remove(metrics.observe_batch)
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
