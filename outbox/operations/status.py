"""What an operator reads and steers: the status report, the dead letters, and waiting
until a record is delivered.

Kept apart from the façade so ``api.py`` stays the wiring of the write and delivery paths;
``Outbox.status()`` and ``Outbox.dead`` hand out these.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import DBAPIError

from outbox.core.errors import DatabaseLacksRecords, StoreUnreadable
from outbox.core.naming import key_prefix
from outbox.core.receipt import Receipt
from outbox.core.states import SETTLED, DeliveryState, ReceiptStatus
from outbox.mirror.jsonl import record_count
from outbox.store.driver_errors import reason_of
from outbox.store.records import RecordCounts
from outbox.write.fallback import FallbackQueue

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.mirror.mirrors import Mirrors
    from outbox.store.delivery_reads import DeliveryRow
    from outbox.store.heartbeats import Heartbeat
    from outbox.store.storage import Storage


def status_report(
    storage: Storage, settings: Settings, missing: DatabaseLacksRecords | None = None
) -> dict[str, Any]:
    """Counts per sink and state, the oldest pending age, what is failing right now and why,
    and every dispatcher daemon on record. A database that cannot be read is an error naming
    it, not a driver message. With ``missing`` (records the log names and the database
    lacks), what is missing and the command that brings it back; a deleted SQLite file is
    counted as empty, not created anew to be read."""
    try:
        report = _status(storage, settings, time.time(), read=not (missing and missing.gone))
    except (DBAPIError, sqlite3.Error) as exc:
        raise StoreUnreadable.of(settings.db_url, exc, reason_of(exc)) from None
    if missing is not None:
        report["missing"] = missing_view(report["records"], settings, missing)
    return report


def missing_view(records: int, settings: Settings, missing: DatabaseLacksRecords) -> dict[str, Any]:
    """What the database lacks: its count against the log's (one pass over the log's bytes),
    the writes waiting in the fallback queue meanwhile, and what to run."""
    return {
        "database_records": records,
        "log_records": record_count(settings.jsonl_path),
        "fallback_waiting": FallbackQueue(settings.markdown_dir, settings.sinks).pending_count(),
        "run": missing.command,
        "problem": str(missing),
    }


def _status(storage: Storage, settings: Settings, now: float, *, read: bool) -> dict[str, Any]:
    records = storage.records.counts() if read else RecordCounts(live=0, forgotten=0)
    counts = storage.deliveries.counts() if read else {}
    oldest = storage.deliveries.oldest_pending() if read else {}
    retrying = storage.deliveries.retrying() if read else {}
    sinks = list(dict.fromkeys([*settings.sinks, *counts]))
    per_sink = {
        sink: {
            **counts.get(sink, dict.fromkeys(map(str, DeliveryState), 0)),
            "oldest_pending_age": round(now - oldest[sink], 3) if sink in oldest else None,
            "retrying": retrying.get(sink, (0, None))[0],
            "last_failure": retrying.get(sink, (0, None))[1],
            "last_error": _latest_error(storage, sink) if sink in retrying else None,
        }
        for sink in sinks
    }
    return {
        "records": records.live,  # what every surface calls records: the live ones
        "forgotten": records.forgotten,
        "sinks": per_sink,
        "dead_letters": sum(entry["dead"] for entry in per_sink.values()),
        # Writes the database could not take yet; the open before a status imports them
        # when it can, so these are the ones it could not (the database locked or gone).
        "fallback_waiting": FallbackQueue(settings.markdown_dir, settings.sinks).pending_count(),
        "dispatchers": [dispatcher_view(beat, now) for beat in storage.heartbeats.all()]
        if read
        else [],
        # Never the password of a PostgreSQL URL: status output ends up in logs and issues.
        "database": storage.engine.url.render_as_string(hide_password=True),
        "jsonl_path": str(settings.jsonl_path),
        "markdown_dir": str(settings.markdown_dir),
    }


def _latest_error(storage: Storage, sink: str) -> dict[str, str | None] | None:
    """The most recent failure of ``sink`` still pending: its record's key prefix and the
    error the sink gave (the full text of every failure: ``outbox dead show KEY``)."""
    row = storage.deliveries.latest_failure(sink)
    if row is None:
        return None
    return {"key": key_prefix(row.key), "reason": row.error_class, "error": row.last_error}


def dispatcher_view(beat: Heartbeat, now: float) -> dict[str, Any]:
    """One dispatcher for ``status``: its last beat, and whether it is alive, gone (no beat
    for longer than the bound it set itself) or stopped."""
    return {
        "owner": beat.owner,
        "host": beat.host,
        "pid": beat.pid,
        "sinks": list(beat.sinks),
        "state": beat.state(now),
        "started_at": beat.started_at,
        "beat_at": beat.beat_at,
        "beat_age": round(max(0.0, now - beat.beat_at), 3),
        "gone_after": beat.gone_after,
        "last_batch_at": beat.last_batch_at,
        "records_per_second": beat.records_per_second,
        "delivered": beat.delivered,
        "failed": beat.failed,
        "stopped_at": beat.stopped_at,
    }


class DeadLetters:
    """Deliveries a sink refused for good or that ran out of attempts, for an operator to
    review, then retry or discard; each change is mirrored at once."""

    def __init__(self, storage: Storage, mirrors: Mirrors) -> None:
        self.storage = storage
        self.mirrors = mirrors

    def list(self, sink: str | None = None, limit: int = 100) -> list[DeliveryRow]:
        """Oldest first."""
        return self.storage.deliveries.list_deliveries(DeliveryState.DEAD, sink=sink, limit=limit)

    def retry(self, keys: Iterable[str] | None = None, sink: str | None = None) -> int:
        """A fresh set of attempts for the dead letters of ``keys`` (every one when None);
        returns how many."""
        return self._change(keys, sink, retry=True)

    def discard(self, keys: Iterable[str] | None = None, sink: str | None = None) -> int:
        """Retire dead letters for good (kept for audit, never retried); returns how many."""
        return self._change(keys, sink, retry=False)

    def _change(self, keys: Iterable[str] | None, sink: str | None, *, retry: bool) -> int:
        """An empty ``keys`` changes nothing: the store reads "no keys" as "every key",
        which only None may ask for."""
        wanted = None if keys is None else list(keys)
        if wanted == []:
            return 0
        if retry:
            count = self.storage.deliveries.requeue_dead(wanted, sink=sink)
        else:
            count = self.storage.deliveries.discard_dead(wanted, sink=sink)
        self.mirrors.sync_deliveries()
        return count


def wait_delivered(
    storage: Storage, settings: Settings, key: str, sink: str | None, timeout: float
) -> Receipt:
    """Poll ``key``'s deliveries until ``sink`` (default: every sink) has settled, or time
    out; ``stored`` only when every wanted sink gave a concrete id."""
    stored = storage.records.get_record(key)
    if stored is None:
        raise KeyError(f"no record with key {key}")
    wanted = (sink,) if sink else None
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        rows = storage.deliveries.deliveries_for([key]).get(key, [])
        sinks = wanted or tuple(row.sink for row in rows)
        ids = {
            row.sink: row.sink_id
            for row in rows
            if row.state == DeliveryState.DELIVERED and row.sink_id
        }
        settled = {row.sink for row in rows if row.state in SETTLED}
        if all(name in settled for name in sinks) or time.monotonic() >= deadline:
            done = bool(sinks) and all(name in ids for name in sinks)
            return Receipt(
                key=key,
                status=ReceiptStatus.STORED if done else ReceiptStatus.QUEUED,
                duplicate=False,
                markdown_path=settings.markdown_dir / stored.markdown_name,
                timestamp=stored.record.timestamp,
                sinks=tuple(sinks),
                sink_ids={name: ids[name] for name in sinks if name in ids},
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.25)
