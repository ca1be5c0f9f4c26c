"""The conformance suite every sink passes, built-in or custom, through the real dispatcher.

A sink's test module subclasses ``SinkConformance`` and gives it one fixture,
``sink_harness``, returning a ``SinkHarness`` for the sink under test::

    from outbox.testing.conformance import SinkConformance, SinkHarness

    class TestWebhookSink(SinkConformance):
        @pytest.fixture
        def sink_harness(self, tmp_path):
            settings = load_settings(env={}, home=tmp_path, sinks="mypkg.sinks:WebhookSink")
            return SinkHarness(settings, stored_copies=..., poison=..., hang=...)

This module needs pytest; only a test imports it (``import outbox.testing`` does not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import update

from outbox import Outbox, Settings
from outbox.core.record import Record
from outbox.sinks.base import Delivered, Sink
from outbox.sinks.registry import load_sink
from outbox.store.schema import deliveries

TEXTS = [
    "The deploy pipeline now waits for the database migration before starting web workers.",
    "Alice prefers short answers with code first and the explanation after it.",
    "We chose SQLite in WAL mode with synchronous FULL for the outbox database.",
    "The nightly embedding backfill saturates both CPU cores for about forty minutes.",
    "Never report a memory as stored unless the sink returned a concrete id.",
]
_DRAIN = 120.0  # seconds a drain may take before the test gives up on it


def make_due(ob: Outbox, **values: Any) -> None:
    """Every delivery row due now (the backoff wait skipped), with ``values`` set too."""
    with ob.engine.begin() as conn:
        conn.execute(update(deliveries).values(available_at=0.0, **values))


@dataclass(frozen=True)
class SinkHarness:
    """One sink under the suite, and how to look behind it. Each ``None`` hook skips what
    it would check, for a sink that has nothing to show there (the no-op sink).

    - ``settings``: Settings whose ``sinks`` name only the sink under test.
    - ``stored_copies(record)``: how many memories holding ``record`` the sink keeps, read
      straight from its own storage (not through the sink class).
    - ``poison``: content the sink itself refuses for good (its own validation, not ours).
    - ``hang()``: a context manager during which the sink's calls hang.
    """

    settings: Settings
    stored_copies: Callable[[Record], int] | None = None
    poison: str | None = None
    hang: Callable[[], AbstractContextManager[Any]] | None = None


class SinkConformance:
    """Shared behaviour of a sink under the dispatcher."""

    @pytest.fixture
    def sink_harness(self) -> SinkHarness:
        raise NotImplementedError("return a SinkHarness for the sink under test")

    # -- helpers --------------------------------------------------------------------------

    @pytest.fixture
    def ob(self, sink_harness: SinkHarness) -> Iterator[Outbox]:
        outbox = Outbox.open(sink_harness.settings)
        yield outbox
        outbox.close()

    @staticmethod
    def sink_name(ob: Outbox) -> str:
        (name,) = ob.settings.sinks
        return name

    @staticmethod
    def rows(ob: Outbox, key: str) -> list[Any]:
        return ob.deliveries_of([key]).get(key, [])

    @staticmethod
    def add(ob: Outbox, text: str, **fields: Any) -> Record:
        """Write ``text`` through the outbox and return its record."""
        record = ob.prepare(text, **fields)
        receipt = ob.add(text, **{**fields, "timestamp": record.timestamp})
        assert receipt.key == record.key
        return record

    @staticmethod
    def assert_copies(harness: SinkHarness, record: Record, expected: int = 1) -> None:
        if harness.stored_copies is not None:
            assert harness.stored_copies(record) == expected, record.key

    # -- the suite ------------------------------------------------------------------------

    def test_declares_what_it_is(self, sink_harness: SinkHarness) -> None:
        (name,) = sink_harness.settings.sinks
        sink = load_sink(name, sink_harness.settings)
        try:
            assert isinstance(sink, Sink)
            assert sink.name == name
            assert isinstance(sink.semantic, bool)
        finally:
            sink.close()

    def test_delivers_with_concrete_ids(self, ob: Outbox, sink_harness: SinkHarness) -> None:
        records = [self.add(ob, text, tags=["conformance"]) for text in TEXTS]
        report = ob.drain(timeout=_DRAIN)
        assert report.ok, report.to_dict()
        for record in records:
            (row,) = self.rows(ob, record.key)
            assert row.state == "delivered"
            assert row.sink_id, "a delivery must carry the sink's concrete id"
            self.assert_copies(sink_harness, record)

    def test_redelivery_is_a_noop(self, ob: Outbox, sink_harness: SinkHarness) -> None:
        records = [self.add(ob, text) for text in TEXTS[:3]]
        assert ob.drain(timeout=_DRAIN).ok
        first_ids = {r.key: self.rows(ob, r.key)[0].sink_id for r in records}
        # A lost acknowledgement: the rows go back to pending although the sink holds them.
        make_due(ob, state="pending")
        assert ob.drain(timeout=_DRAIN).ok
        for record in records:
            assert self.rows(ob, record.key)[0].sink_id == first_ids[record.key]
            self.assert_copies(sink_harness, record)

    def test_direct_repeat_gives_same_ids(self, ob: Outbox, sink_harness: SinkHarness) -> None:
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
            self.assert_copies(sink_harness, record)

    def test_poison_record_is_dead_lettered_alone(
        self, ob: Outbox, sink_harness: SinkHarness
    ) -> None:
        if sink_harness.poison is None:
            pytest.skip("this sink refuses no content")
        good = [self.add(ob, text) for text in TEXTS[:2]]
        bad = self.add(ob, sink_harness.poison)
        report = ob.drain(timeout=_DRAIN)
        assert not report.ok
        (bad_row,) = self.rows(ob, bad.key)
        assert bad_row.state == "dead"
        assert bad_row.error_class == "rejected"
        assert bad_row.attempts == 1, "a permanent error must not be retried"
        for record in good:
            assert self.rows(ob, record.key)[0].state == "delivered"
            self.assert_copies(sink_harness, record)

    def test_timeout_is_a_retry_then_delivery(self, sink_harness: SinkHarness) -> None:
        """A hung call ends at the (short) sink timeout and its record is retried, not lost.

        Only the hung attempt runs under the short timeout. The dispatcher abandons a sink
        that timed out, so the retry is a fresh sink's first call, with its start-up (the
        embedded Chroma's is a new child process importing chromadb): it runs under the
        harness's own timeout, as every other delivery of the suite does, never racing a
        start-up against the two seconds meant for the hang."""
        if sink_harness.hang is None:
            pytest.skip("this sink cannot be made to hang")
        short = dataclasses.replace(sink_harness.settings, sink_timeout=2.0)
        with Outbox.open(short) as ob:
            record = self.add(ob, TEXTS[0])
            with sink_harness.hang():
                report = ob.drain(timeout=60)
            (row,) = self.rows(ob, record.key)
            assert not report.ok
            assert row.state == "pending"
            assert row.error_class == "timeout"
            make_due(ob)
        with Outbox.open(sink_harness.settings) as ob:
            assert ob.drain(timeout=_DRAIN).ok
            (row,) = self.rows(ob, record.key)
            assert row.state == "delivered"
            assert row.attempts == 2
            self.assert_copies(sink_harness, record)

    def test_forget_deletes_from_the_sink(self, ob: Outbox, sink_harness: SinkHarness) -> None:
        kept, gone = (self.add(ob, text) for text in TEXTS[:2])
        assert ob.drain(timeout=_DRAIN).ok
        receipt = ob.forget(gone.key[:16])
        assert receipt.key == gone.key and receipt.sinks == [self.sink_name(ob)]
        assert ob.drain(timeout=_DRAIN).ok
        (row,) = self.rows(ob, gone.key)
        assert (row.state, row.op, row.attempts) == ("forgotten", "delete", 1)
        self.assert_copies(sink_harness, gone, 0)
        self.assert_copies(sink_harness, kept, 1)
        # A lost acknowledgement: the delete runs again, and deleting nothing is no error.
        make_due(ob, state="pending")
        assert ob.drain(timeout=_DRAIN).ok
        assert self.rows(ob, gone.key)[0].state == "forgotten"
        self.assert_copies(sink_harness, gone, 0)
        self.assert_copies(sink_harness, kept, 1)
        report = ob.verify()
        assert report.ok, report.problems

    def test_forgotten_before_delivery_never_reaches_the_sink(
        self, ob: Outbox, sink_harness: SinkHarness
    ) -> None:
        record = self.add(ob, TEXTS[2])
        receipt = ob.forget(record.key)
        assert receipt.sinks == [] and receipt.never_sent == [self.sink_name(ob)]
        assert ob.drain(timeout=_DRAIN).ok
        (row,) = self.rows(ob, record.key)
        assert (row.state, row.attempts, row.sink_id) == ("forgotten", 0, None)
        self.assert_copies(sink_harness, record, 0)
        assert ob.verify().ok
