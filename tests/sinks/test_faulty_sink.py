"""The fault-injection sink passes the same conformance suite as the real sinks."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import Settings, load_settings
from tests.sinks.conformance import SinkConformance

POISON = "POISON-PILL"


class TestFaultySinkConformance(SinkConformance):
    @pytest.fixture
    def sink_settings(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
        monkeypatch.setenv("OUTBOX_FAULTY_DB", str(tmp_path / "faulty.db"))
        monkeypatch.setenv("OUTBOX_FAULTY_REJECT", POISON)
        return load_settings(
            env={},
            home=tmp_path / ".outbox",
            markdown_dir=tmp_path / "md",
            sinks="outbox.testing.sinks:FaultySink",
        )

    def stored_copies(self, settings: Settings, key: str) -> int:
        with sqlite3.connect(Path(settings.home).parent / "faulty.db") as conn:
            return conn.execute("SELECT count(*) FROM delivered WHERE key = ?", (key,)).fetchone()[
                0
            ]

    def poison_content(self, settings: Settings) -> str:
        return f"this record carries the {POISON} that the sink refuses"

    @contextlib.contextmanager
    def hung(self, settings: Settings) -> Iterator[None]:
        mp = pytest.MonkeyPatch()
        mp.setenv("OUTBOX_FAULTY_HANG", "5")
        try:
            yield
        finally:
            mp.undo()
