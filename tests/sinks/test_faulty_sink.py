"""The testing sinks pass the same conformance suite as the real sinks: the fault-injection
sink in full, the no-op sink as far as a sink that keeps nothing can."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import Settings, load_settings
from outbox.testing.conformance import SinkConformance, SinkHarness
from tests.conftest import FAULTY

POISON = "POISON-PILL"


def _settings(tmp_path: Path, sink: str) -> Settings:
    return load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "md", sinks=sink
    )


def _copies(db: Path, key: str) -> int:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(
            conn.execute("SELECT count(*) FROM delivered WHERE key = ?", (key,)).fetchone()[0]
        )


@contextlib.contextmanager
def _hanging() -> Iterator[None]:
    """Every FaultySink made meanwhile sleeps before it answers (a hung server)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OUTBOX_FAULTY_HANG", "5")
        yield


class TestFaultySinkConformance(SinkConformance):
    @pytest.fixture
    def sink_harness(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SinkHarness:
        db = tmp_path / "faulty.db"
        monkeypatch.setenv("OUTBOX_FAULTY_DB", str(db))
        monkeypatch.setenv("OUTBOX_FAULTY_REJECT", POISON)
        return SinkHarness(
            _settings(tmp_path, FAULTY),
            stored_copies=lambda record: _copies(db, record.key),
            poison=f"this record carries the {POISON} that the sink refuses",
            hang=_hanging,
        )


class TestNoopSinkConformance(SinkConformance):
    # The no-op sink refuses nothing and cannot hang: those two checks do not apply to it,
    # so they are not collected (rather than collected and skipped).
    test_poison_record_is_dead_lettered_alone = None  # type: ignore[assignment]
    test_timeout_is_a_retry_then_delivery = None  # type: ignore[assignment]

    @pytest.fixture
    def sink_harness(self, tmp_path: Path) -> SinkHarness:
        return SinkHarness(_settings(tmp_path, "outbox.testing.sinks:NoopSink"))
