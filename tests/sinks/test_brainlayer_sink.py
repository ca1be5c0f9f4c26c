"""The BrainLayer sink against real BrainLayer 1.5.78, in process and over a real stdio MCP
session, with its database in the test's folder.

Faults are real too: another process holding BrainLayer's write lock or its writer pidfile,
content BrainLayer's own gates refuse, a killed MCP server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import update

from outbox import Outbox, Settings, load_settings
from outbox.dispatch.classify import classify
from outbox.mirror import markdown
from outbox.record import Record
from outbox.sinks.base import Delivered, Rejected
from outbox.sinks.brainlayer import (
    INSTALL_HINT,
    BrainLayerMcpSink,
    BrainLayerMissing,
    BrainLayerSink,
    chunk_id_for,
)
from outbox.sinks.registry import load_sink
from outbox.store.engine import make_engine
from outbox.store.schema import deliveries
from outbox.store.storage import DeliveryRow, Storage
from tests.brainlayer_env import (
    BrainLayerEnv,
    harness_command,
    hold_write_lock,
    hold_writer,
    setup_brainlayer,
)
from tests.sinks.conformance import TEXTS, SinkConformance

# A JSON-RPC message pasted as a memory: BrainLayer refuses to store MCP traffic for good
# (its ingest guard, "recursive MCP output"), in process and through brain_store alike.
POISON = '{"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": "hi"}]}}'
TS = "2026-11-29T08:00:00Z"
CANONICAL_TS = "2026-11-29T08:00:00.000000Z"


def _settings(tmp_path: Path, env: BrainLayerEnv, **overrides: object) -> Settings:
    return load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks="brainlayer",
        brainlayer_db=env.db,
        **overrides,
    )


def _record(settings: Settings, key: str) -> Record:
    engine = make_engine(settings, writer=False)
    try:
        stored = Storage(engine).get_record(key)
    finally:
        engine.dispose()
    assert stored is not None
    return stored.record


def _row(ob: Outbox, key: str) -> DeliveryRow:
    (row,) = ob.storage.deliveries_for([key])[key]
    return row


def _make_due(ob: Outbox) -> None:
    """Skip the backoff wait, as if its time had come."""
    with ob.engine.begin() as conn:
        conn.execute(update(deliveries).values(available_at=0.0))


class _BrainLayerHooks(SinkConformance):
    """Hooks shared by both modes: BrainLayer's database read directly."""

    bl: BrainLayerEnv

    def poison_content(self, settings: Settings) -> str:
        return POISON


class TestBrainLayerInProcessConformance(_BrainLayerHooks):
    @pytest.fixture
    def sink_settings(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
        self.bl = setup_brainlayer(tmp_path / "bl", monkeypatch)
        return _settings(tmp_path, self.bl)

    def stored_copies(self, settings: Settings, key: str) -> int:
        # The row under the chunk id derived from the key, then every active row holding
        # that row's content: a second memory of the record would show up whatever its id.
        row = self.bl.chunk(chunk_id_for(key))
        return 0 if row is None else self.bl.rows_holding(row["content"])

    @contextlib.contextmanager
    def hung(self, settings: Settings) -> Iterator[None]:
        # BrainLayer waits on a locked database for OUTBOX_BUSY_TIMEOUT (5 s here), longer
        # than the test's 2 s sink timeout: the dispatcher's timeout fires while BrainLayer
        # is still blocked in SQLite's busy handler. The lock is held until the drain ends.
        with hold_write_lock(self.bl.db):
            yield


class TestBrainLayerMcpConformance(_BrainLayerHooks):
    @pytest.fixture
    def sink_settings(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
        self.bl = setup_brainlayer(tmp_path / "bl", monkeypatch)
        return _settings(tmp_path, self.bl, brainlayer_mcp=harness_command())

    @pytest.fixture
    def ob(self, sink_settings: Settings) -> Iterator[Outbox]:
        """The suite's outbox, remembering the content of records it only prepares (the
        server mints ids, so BrainLayer can only be searched by content)."""
        outbox = Outbox.open(sink_settings)
        self.prepared: dict[str, str] = {}
        prepare = outbox.prepare

        def remembering(*args: Any, **kwargs: Any) -> Record:
            record = prepare(*args, **kwargs)
            self.prepared[record.key] = record.content
            return record

        outbox.prepare = remembering  # type: ignore[method-assign]
        yield outbox
        outbox.close()

    def stored_copies(self, settings: Settings, key: str) -> int:
        # Active BrainLayer rows holding this record's content, under any chunk id.
        content = getattr(self, "prepared", {}).get(key) or _record(settings, key).content
        return self.bl.rows_holding(content)

    @contextlib.contextmanager
    def hung(self, settings: Settings) -> Iterator[None]:
        # BrainLayer's handler waits BRAINLAYER_STORE_BUSY_BUDGET_MS on a locked database
        # (400 ms by default, then it defers). With a 30 s budget, a server started now
        # blocks inside brain_store while another process holds the lock: a real stall.
        with pytest.MonkeyPatch.context() as mp, hold_write_lock(self.bl.db):
            mp.setenv("BRAINLAYER_STORE_BUSY_BUDGET_MS", "30000")
            yield


# -- in process ----------------------------------------------------------------------------


@pytest.fixture
def bl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BrainLayerEnv:
    return setup_brainlayer(tmp_path / "bl", monkeypatch)


def test_chunk_id_timestamp_importance_and_tags_reach_brainlayer(
    tmp_path: Path, bl: BrainLayerEnv
) -> None:
    with Outbox.open(_settings(tmp_path, bl)) as ob:
        receipt = ob.add(TEXTS[2], importance=8, tags=["decision", "storage"], timestamp=TS)
        assert ob.drain(timeout=60).ok
        row = _row(ob, receipt.key)
    assert row.sink_id == chunk_id_for(receipt.key)
    assert row.sink_id.startswith("manual-") and len(row.sink_id) == len("manual-") + 16
    stored = bl.chunk(row.sink_id)
    assert stored is not None
    assert stored["created_at"] == CANONICAL_TS == receipt.timestamp
    assert stored["content"] == TEXTS[2]
    assert stored["importance"] == 8.0
    assert json.loads(stored["tags"]) == ["decision", "storage"]
    assert stored["content_type"] == "note"


def test_metadata_type_and_project_reach_brainlayer(tmp_path: Path, bl: BrainLayerEnv) -> None:
    with Outbox.open(_settings(tmp_path, bl)) as ob:
        known = ob.add(TEXTS[0], metadata={"type": "decision", "project": "outbox"})
        unknown = ob.add(TEXTS[1], metadata={"type": "rumour"})
        assert ob.drain(timeout=60).ok
    decision = bl.chunk(chunk_id_for(known.key))
    note = bl.chunk(chunk_id_for(unknown.key))
    assert decision is not None and note is not None
    assert (decision["content_type"], decision["project"]) == ("decision", "outbox")
    assert (note["content_type"], note["project"]) == ("note", None)


def test_same_content_and_timestamp_is_one_memory(tmp_path: Path, bl: BrainLayerEnv) -> None:
    """Two outboxes (two machines, say) deliver the same record: BrainLayer holds it once."""
    ids = []
    for name in ("a", "b"):
        settings = _settings(tmp_path / name, bl)
        with Outbox.open(settings) as ob:
            receipt = ob.add(TEXTS[4], timestamp=TS)
            assert ob.drain(timeout=60).ok
            ids.append(_row(ob, receipt.key).sink_id)
    assert ids[0] == ids[1] == chunk_id_for(receipt.key)
    assert bl.rows_holding(TEXTS[4]) == 1
    stored = bl.chunk(ids[0])
    assert stored is not None and stored["seen_count"] == 2


def test_writer_held_elsewhere_is_db_busy_then_delivered_once(
    tmp_path: Path, bl: BrainLayerEnv
) -> None:
    with Outbox.open(_settings(tmp_path, bl)) as ob:
        receipt = ob.add(TEXTS[0], timestamp=TS)
        with hold_writer(bl.db):
            report = ob.drain(timeout=60)
            row = _row(ob, receipt.key)
            assert not report.ok
            assert (row.state, row.error_class, row.sink_id) == ("pending", "db_busy", None)
            assert bl.rows_holding(TEXTS[0]) == 0
        _make_due(ob)
        assert ob.drain(timeout=60).ok
        row = _row(ob, receipt.key)
    assert (row.state, row.attempts, row.sink_id) == ("delivered", 2, chunk_id_for(receipt.key))
    assert bl.rows_holding(TEXTS[0]) == 1


def test_lock_shorter_than_sink_timeout_is_db_busy(tmp_path: Path, bl: BrainLayerEnv) -> None:
    """With the busy wait inside the sink timeout, a held lock is a busy database, reported
    by the sink itself (not a timeout), and the record lands once the lock is gone."""
    settings = _settings(tmp_path, bl, busy_timeout=0.5, sink_timeout=30.0)
    with Outbox.open(settings) as ob:
        receipts = [ob.add(text) for text in TEXTS[:3]]
        with hold_write_lock(bl.db):
            report = ob.drain(timeout=60)
        assert not report.ok
        for receipt in receipts:
            row = _row(ob, receipt.key)
            assert (row.state, row.error_class) == ("pending", "db_busy")
        _make_due(ob)
        assert ob.drain(timeout=60).ok
    for text in TEXTS[:3]:
        assert bl.rows_holding(text) == 1


def test_a_held_lock_costs_one_busy_wait_per_batch(tmp_path: Path, bl: BrainLayerEnv) -> None:
    settings = _settings(tmp_path, bl, busy_timeout=2.0)
    with Outbox.open(settings) as ob:
        records = [ob.prepare(f"Memory {i}: {TEXTS[i % len(TEXTS)]}") for i in range(10)]
    sink = load_sink("brainlayer", settings)
    with hold_write_lock(bl.db):
        started = time.monotonic()
        outcomes = sink.deliver(records)
        elapsed = time.monotonic() - started
    sink.close()
    assert [classify(o).reason for o in outcomes] == ["db_busy"] * 10  # type: ignore[arg-type]
    assert elapsed < 10, "waiting per record would take 20 s"
    assert all(bl.rows_holding(record.content) == 0 for record in records)


def test_missing_database_is_created_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = setup_brainlayer(tmp_path / "bl", monkeypatch, bootstrap=False)
    assert not env.db.exists()
    with Outbox.open(_settings(tmp_path, env)) as ob:
        receipt = ob.add(TEXTS[1])
        assert ob.drain(timeout=60).ok
        first_inode = env.db.stat().st_ino
        ob.add(TEXTS[3])
        assert ob.drain(timeout=60).ok
        assert _row(ob, receipt.key).state == "delivered"
    assert env.db.stat().st_ino == first_inode
    assert env.rows_holding(TEXTS[1]) == env.rows_holding(TEXTS[3]) == 1


def test_foreign_database_is_retried_never_migrated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that is not a current BrainLayer database fails BrainLayer's schema check: the
    record waits (db_busy) and the file is left exactly as it was."""
    env = setup_brainlayer(tmp_path / "bl", monkeypatch, bootstrap=False)
    env.db.parent.mkdir(parents=True)
    with sqlite3.connect(env.db) as conn:
        conn.execute("CREATE TABLE chunks (id TEXT PRIMARY KEY, content TEXT)")
    before = env.db.read_bytes()
    with Outbox.open(_settings(tmp_path, env)) as ob:
        receipt = ob.add(TEXTS[0])
        assert not ob.drain(timeout=60).ok
        row = _row(ob, receipt.key)
    assert (row.state, row.error_class) == ("pending", "db_busy")
    assert "SchemaFingerprintMismatch" in (row.last_error or "")
    assert env.db.read_bytes() == before


def test_default_database_is_brainlayers_own(tmp_path: Path, bl: BrainLayerEnv) -> None:
    """Without OUTBOX_BRAINLAYER_DB the sink writes where BrainLayer itself would (here the
    temporary BRAINLAYER_DB)."""
    settings = replace(_settings(tmp_path, bl), brainlayer_db=None)
    sink = load_sink("brainlayer", settings)
    assert isinstance(sink, BrainLayerSink)
    assert sink.db_path == bl.db


def test_markdown_front_matter_gets_brainlayers_chunk_id(tmp_path: Path, bl: BrainLayerEnv) -> None:
    # Leading/trailing whitespace (BrainLayer strips it, the mirror must not), a fence-like
    # line, YAML-looking text and no final newline.
    content = "  chunk_id: fake\n---\nkey: [not, yaml]\n\u00e9t\u00e9 \U0001f9e0 done  "
    with Outbox.open(_settings(tmp_path, bl)) as ob:
        receipt = ob.add(content, tags=["a: b", "- c"], importance=9)
        path = receipt.markdown_path
        before = path.read_bytes()
        _, body_before = markdown.parse(before)
        assert body_before == content.encode("utf-8")
        assert yaml.safe_load(before.split(b"---\n")[1])["chunk_id"] is None
        with hold_writer(bl.db):
            ob.drain(timeout=60)  # one failed attempt first, so retry_attempted turns true
        _make_due(ob)
        assert ob.drain(timeout=60).ok
        chunk_id = _row(ob, receipt.key).sink_id
    data = path.read_bytes()
    matter_text, body = data[len(b"---\n") :].split(b"\n---\n", 1)
    matter = yaml.safe_load(matter_text)
    assert matter["chunk_id"] == chunk_id == chunk_id_for(receipt.key)
    assert bl.chunk(chunk_id) is not None
    assert matter["retry_attempted"] is True
    assert matter["tags"] == ["a: b", "- c"] and matter["importance"] == 9
    assert body == content.encode("utf-8")


def test_poison_never_appears_in_logs_or_errors(
    tmp_path: Path, bl: BrainLayerEnv, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with Outbox.open(_settings(tmp_path, bl)) as ob:
        bad = ob.add(POISON)
        ob.drain(timeout=60)
        row = _row(ob, bad.key)
    assert (row.state, row.error_class) == ("dead", "rejected")
    assert "recursive MCP output" in (row.last_error or "")
    assert POISON not in (row.last_error or "")
    assert all(POISON not in r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert bl.rows_holding(POISON) == 0


def test_missing_brainlayer_is_one_clear_retryable_error(
    tmp_path: Path, bl: BrainLayerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "brainlayer.runtime_store", None)
    with pytest.raises(BrainLayerMissing) as caught:
        load_sink("brainlayer", _settings(tmp_path, bl))
    message = str(caught.value)
    assert "\n" not in message and INSTALL_HINT in message
    assert "pip install --no-deps brainlayer==1.5.78" in message
    assert classify(caught.value).transient


# -- over MCP (stdio test double serving BrainLayer's own handlers) -----------------------


def _server_pids() -> list[int]:
    """The harness servers this process started (children running the harness script)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid() and b"brainlayer_mcp_server.py" in cmdline:
            found.append(int(entry.name))
    return found


def test_mcp_deferred_is_not_a_delivery(tmp_path: Path, bl: BrainLayerEnv) -> None:
    """A locked database makes brain_store answer DEFERRED: queued inside BrainLayer, not in
    its database. That is retried, never reported stored; once BrainLayer's own drain has
    applied its queue, the retry is a DUPLICATE carrying the id BrainLayer promised."""
    settings = _settings(tmp_path, bl, brainlayer_mcp=harness_command())
    with Outbox.open(settings) as ob:
        receipt = ob.add(TEXTS[1], importance=6, tags=["mcp"])
        with hold_write_lock(bl.db):
            ob.drain(timeout=60)
        row = _row(ob, receipt.key)
        assert (row.state, row.error_class, row.sink_id) == ("pending", "db_busy", None)
        assert bl.queued_files() and bl.rows_holding(TEXTS[1]) == 0
        promised = json.loads(bl.queued_files()[0].read_text().splitlines()[0])["chunk_id"]

        _make_due(ob)  # queue not drained: BrainLayer defers everything behind it
        ob.drain(timeout=60)
        row = _row(ob, receipt.key)
        assert (row.state, row.error_class, row.sink_id) == ("pending", "queued_null_chunk", None)

        assert bl.drain_queue() >= 1
        _make_due(ob)
        assert ob.drain(timeout=60).ok
        row = _row(ob, receipt.key)
    assert (row.state, row.sink_id, row.attempts) == ("delivered", promised, 3)
    assert bl.rows_holding(TEXTS[1]) == 1
    stored = bl.chunk(promised)
    assert stored is not None and stored["importance"] == 6.0
    assert "mcp" in json.loads(stored["tags"])


def test_mcp_killed_server_is_transport_closed_then_redelivered_once(
    tmp_path: Path, bl: BrainLayerEnv
) -> None:
    settings = _settings(tmp_path, bl, brainlayer_mcp=harness_command())
    with Outbox.open(settings) as ob:
        first, second = ob.prepare(TEXTS[0]), ob.prepare(TEXTS[3])
    sink = load_sink("brainlayer", settings)
    assert isinstance(sink, BrainLayerMcpSink)
    try:
        (outcome,) = sink.deliver([first])
        assert isinstance(outcome, Delivered)
        (pid,) = _server_pids()
        os.kill(pid, signal.SIGKILL)
        lost = sink.deliver([first, second])
        assert [classify(o).reason for o in lost] == ["transport_closed"] * 2  # type: ignore[arg-type]
        again = sink.deliver([first, second])
        assert all(isinstance(o, Delivered) for o in again)
        assert again[0].sink_id == outcome.sink_id  # type: ignore[union-attr]
        assert _server_pids() and pid not in _server_pids()
    finally:
        sink.close()
    assert _server_pids() == []
    assert bl.rows_holding(TEXTS[0]) == bl.rows_holding(TEXTS[3]) == 1


def test_mcp_server_that_cannot_start_is_retried(tmp_path: Path, bl: BrainLayerEnv) -> None:
    settings = _settings(tmp_path, bl, brainlayer_mcp=str(tmp_path / "no-such-server"))
    with Outbox.open(settings) as ob:
        receipt = ob.add(TEXTS[0])
        report = ob.drain(timeout=60)
        row = _row(ob, receipt.key)
    # A sink that cannot start charges its records nothing: they wait, untouched, and the
    # drain's report (and the dispatcher's log) names why.
    assert not report.ok
    assert (row.state, row.attempts, row.sink_id) == ("pending", 0, None)
    assert report.sinks["brainlayer"].last_error == "FileNotFoundError"


def test_mcp_rejected_and_outcome_shapes(tmp_path: Path, bl: BrainLayerEnv) -> None:
    """Direct through the real server: REJECTED is permanent, schema errors too."""
    settings = _settings(tmp_path, bl, brainlayer_mcp=harness_command())
    with Outbox.open(settings) as ob:
        poison = ob.prepare(POISON)
        long_tag = ob.prepare(TEXTS[2], tags=["t" * 150])  # over brain_store's 128-char cap
    sink = load_sink("brainlayer", settings)
    try:
        outcomes = sink.deliver([poison, long_tag])
    finally:
        sink.close()
    assert all(isinstance(o, Rejected) for o in outcomes), outcomes
    assert all(not classify(o).transient for o in outcomes)  # type: ignore[arg-type]
    assert POISON not in str(outcomes[0])
