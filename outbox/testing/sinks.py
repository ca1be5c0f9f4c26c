"""A durable fake sink that fails on purpose, and a no-op sink for measuring overhead.

``FaultySink`` keeps what it receives in its own SQLite file, so several dispatcher processes
can share it and a test can count exactly how many times each memory landed. Its faults are
set by environment variables so they reach dispatcher subprocesses too:

- ``OUTBOX_FAULTY_DB``: its database file (default ``<OUTBOX_HOME>/faulty-sink.db``)
- ``OUTBOX_FAULTY_FAIL_RATE``: chance (0..1) that a record fails with a transient error
- ``OUTBOX_FAULTY_ERROR``: the transient error text (default ``Transport closed``)
- ``OUTBOX_FAULTY_REASON``: its reason class (default ``transport_closed``)
- ``OUTBOX_FAULTY_NULL_RATE``: chance that a record comes back with no id (a false ack)
- ``OUTBOX_FAULTY_REJECT``: records whose content contains this text are rejected for good
- ``OUTBOX_FAULTY_HANG``: seconds each call sleeps before answering (a hung server)
- ``OUTBOX_FAULTY_SEED``: seed for the random faults
"""

from __future__ import annotations

import os
import random
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from outbox.core.config import Settings
from outbox.core.record import Record
from outbox.core.states import FailureReason
from outbox.sinks.base import (
    Deleted,
    DeleteOutcome,
    Delivered,
    Held,
    NotDelivered,
    Outcome,
    Rejected,
    Transient,
)


class FaultySink:
    """Stores records by key (idempotent upsert) and injects the configured faults."""

    semantic: bool = False

    def __init__(
        self,
        db_path: Path,
        name: str = "outbox.testing.sinks:FaultySink",
        *,
        fail_rate: float | None = None,
        null_rate: float | None = None,
        hang: float | None = None,
    ) -> None:
        """Faults come from the environment unless given here (tests in one process)."""
        self.name = name
        self.db_path = db_path
        env = os.environ
        self.fail_rate = (
            float(env.get("OUTBOX_FAULTY_FAIL_RATE", "0") or 0) if fail_rate is None else fail_rate
        )
        self.null_rate = (
            float(env.get("OUTBOX_FAULTY_NULL_RATE", "0") or 0) if null_rate is None else null_rate
        )
        self.error_text = env.get("OUTBOX_FAULTY_ERROR", "Transport closed")
        self.error_reason = FailureReason(
            env.get("OUTBOX_FAULTY_REASON") or FailureReason.TRANSPORT_CLOSED
        )
        self.reject = env.get("OUTBOX_FAULTY_REJECT") or None
        self.hang = float(env.get("OUTBOX_FAULTY_HANG", "0") or 0) if hang is None else hang
        self._released = threading.Event()
        seed = env.get("OUTBOX_FAULTY_SEED")
        self.random = random.Random(int(seed) if seed else None)
        db_path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS delivered ("
                " key TEXT PRIMARY KEY, content TEXT NOT NULL, deliveries INTEGER NOT NULL)"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> FaultySink:
        path = os.environ.get("OUTBOX_FAULTY_DB") or str(settings.home / "faulty-sink.db")
        return cls(Path(path))

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.db_path, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        return conn

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        if self.hang:
            self._released.wait(self.hang)
        outcomes: list[Outcome] = []
        keep: list[Record] = []
        for record in batch:
            if self.reject and self.reject in record.content:
                outcomes.append(Rejected("content rejected by the faulty sink"))
            elif self.random.random() < self.fail_rate:
                outcomes.append(Transient(self.error_text, self.error_reason))
            elif self.random.random() < self.null_rate:
                keep.append(record)  # stored, but the reply carries no id: not a delivery
                outcomes.append(NotDelivered("chunk_id: null"))
            else:
                keep.append(record)
                outcomes.append(Delivered(f"faulty-{record.key[:16]}"))
        with self._connect() as conn:
            conn.executemany(
                "INSERT INTO delivered (key, content, deliveries) VALUES (?, ?, 1) "
                "ON CONFLICT(key) DO UPDATE SET deliveries = deliveries + 1",
                [(record.key, record.content) for record in keep],
            )
        return outcomes

    def delete(self, items: Sequence[Held]) -> list[DeleteOutcome]:
        """Remove these records, with the same faults as a delivery (a forget's deletes are
        retried the same way)."""
        if self.hang:
            self._released.wait(self.hang)
        outcomes: list[DeleteOutcome] = []
        gone: list[str] = []
        for item in items:
            if self.random.random() < self.fail_rate:
                outcomes.append(Transient(self.error_text, self.error_reason))
            else:
                outcomes.append(Deleted(item.key))
                gone.append(item.key)
        with self._connect() as conn:
            conn.executemany("DELETE FROM delivered WHERE key = ?", [(key,) for key in gone])
        return outcomes

    def release(self) -> None:
        """End every hang now and from now on (a hung server that comes back)."""
        self._released.set()

    def stored(self) -> dict[str, int]:
        """key -> how many times it was (idempotently) delivered."""
        with self._connect() as conn:
            return dict(conn.execute("SELECT key, deliveries FROM delivered").fetchall())

    def close(self) -> None:
        """Nothing held open between calls."""


def faulty_sink(settings: Settings) -> FaultySink:
    """Factory for ``OUTBOX_SINKS=outbox.testing.sinks:faulty_sink``."""
    return FaultySink.from_settings(settings)


class NoopSink:
    """Acknowledges every record at once: the dispatcher's own cost, with no sink behind it."""

    semantic: bool = False

    def __init__(self, _settings: Settings | None = None) -> None:
        self.name = "outbox.testing.sinks:NoopSink"

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        return [Delivered(record.key) for record in batch]

    def delete(self, items: Sequence[Held]) -> list[DeleteOutcome]:
        return [Deleted(item.key) for item in items]

    def close(self) -> None:
        """Nothing to release."""
