"""The conformance suite every sink passes: real Chroma (embedded and server), real BrainLayer,
and the fault-injection sink all run these same tests through the real dispatcher.

A sink's test module subclasses ``SinkConformance`` and supplies four hooks:

- ``sink_settings`` fixture: Settings whose ``sinks`` name only the sink under test;
- ``stored_copies(settings, key)``: how many memories with this key the sink holds, read
  straight from the sink's own storage (not through our sink class);
- ``poison_content(settings)``: content the sink rejects for good (its own validation, not ours);
- ``hung(settings)``: a context manager during which the sink's calls hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import update

from outbox import Outbox, Settings
from outbox.sinks.base import Delivered
from outbox.sinks.registry import load_sink
from outbox.store.schema import deliveries

TEXTS = [
    "The deploy pipeline now waits for the database migration before starting web workers.",
    "Alice prefers short answers with code first and the explanation after it.",
    "We chose SQLite in WAL mode with synchronous FULL for the outbox database.",
    "The nightly embedding backfill saturates both CPU cores for about forty minutes.",
    "Never report a memory as stored unless the sink returned a concrete id.",
]


class SinkConformance:
    """Shared behaviour of a sink under the dispatcher."""

    @pytest.fixture
    def sink_settings(self) -> Settings:
        raise NotImplementedError

    def stored_copies(self, settings: Settings, key: str) -> int:
        raise NotImplementedError

    def poison_content(self, settings: Settings) -> str:
        raise NotImplementedError

    def hung(self, settings: Settings) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------

    @pytest.fixture
    def ob(self, sink_settings: Settings) -> Iterator[Outbox]:
        outbox = Outbox.open(sink_settings)
        yield outbox
        outbox.close()

    @staticmethod
    def sink_name(ob: Outbox) -> str:
        (name,) = ob.settings.sinks
        return name

    @staticmethod
    def rows(ob: Outbox, key: str) -> list[Any]:
        return ob.storage.deliveries_for([key]).get(key, [])

    # -- the suite ------------------------------------------------------------------------

    def test_delivers_with_concrete_ids(self, ob: Outbox) -> None:
        receipts = [ob.add(text, tags=["conformance"]) for text in TEXTS]
        report = ob.drain(timeout=120)
        assert report.ok, report.to_dict()
        for receipt in receipts:
            (row,) = self.rows(ob, receipt.key)
            assert row.state == "delivered"
            assert row.sink_id, "a delivery must carry the sink's concrete id"
            assert self.stored_copies(ob.settings, receipt.key) == 1

    def test_redelivery_is_a_noop(self, ob: Outbox) -> None:
        receipts = [ob.add(text) for text in TEXTS[:3]]
        assert ob.drain(timeout=120).ok
        first_ids = {r.key: self.rows(ob, r.key)[0].sink_id for r in receipts}
        # A lost acknowledgement: the rows go back to pending although the sink holds them.
        with ob.engine.begin() as conn:
            conn.execute(update(deliveries).values(state="pending", available_at=0.0))
        assert ob.drain(timeout=120).ok
        for receipt in receipts:
            assert self.rows(ob, receipt.key)[0].sink_id == first_ids[receipt.key]
            assert self.stored_copies(ob.settings, receipt.key) == 1

    def test_direct_repeat_gives_same_ids(self, ob: Outbox) -> None:
        records = [ob.prepare(text) for text in TEXTS[:2]]
        sink = load_sink(self.sink_name(ob), ob.settings)
        try:
            first = sink.deliver(records)
            second = sink.deliver(records)
        finally:
            sink.close()
        assert all(isinstance(outcome, Delivered) for outcome in first + second)
        assert [o.sink_id for o in first] == [o.sink_id for o in second]  # type: ignore[union-attr]
        for record in records:
            assert self.stored_copies(ob.settings, record.key) == 1

    def test_poison_record_is_dead_lettered_alone(self, ob: Outbox) -> None:
        good = [ob.add(text) for text in TEXTS[:2]]
        bad = ob.add(self.poison_content(ob.settings))
        report = ob.drain(timeout=120)
        assert not report.ok
        (bad_row,) = self.rows(ob, bad.key)
        assert bad_row.state == "dead"
        assert bad_row.error_class == "rejected"
        assert bad_row.attempts == 1, "a permanent error must not be retried"
        for receipt in good:
            assert self.rows(ob, receipt.key)[0].state == "delivered"
            assert self.stored_copies(ob.settings, receipt.key) == 1

    def test_timeout_is_a_retry_then_delivery(self, sink_settings: Settings) -> None:
        from dataclasses import replace

        settings = replace(sink_settings, sink_timeout=2.0)
        with Outbox.open(settings) as ob:
            receipt = ob.add(TEXTS[0])
            with self.hung(settings):
                report = ob.drain(timeout=60)
            (row,) = self.rows(ob, receipt.key)
            assert not report.ok
            assert row.state == "pending"
            assert row.error_class == "timeout"
            with ob.engine.begin() as conn:  # skip the backoff wait
                conn.execute(update(deliveries).values(available_at=0.0))
            assert ob.drain(timeout=120).ok
            (row,) = self.rows(ob, receipt.key)
            assert row.state == "delivered"
            assert row.attempts == 2
            assert self.stored_copies(settings, receipt.key) == 1
