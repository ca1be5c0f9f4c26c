"""The BrainLayer sink over a real stdio MCP session: a test double serving BrainLayer
1.5.78's own ``brain_store`` handler (see ``tests/helpers/brainlayer_mcp_server.py``), with
BrainLayer's database in the test's folder.

Faults are real: a database locked by another process (BrainLayer defers), a killed server,
a server that cannot start, content BrainLayer refuses. Each failure comes out of the sink
already classified, as the dispatcher sees it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from outbox import Outbox
from outbox.core.record import build_record
from outbox.dispatch.classify import classify
from outbox.sinks.base import Delivered, Rejected
from outbox.sinks.brainlayer_errors import failure_of
from outbox.sinks.brainlayer_mcp import BrainLayerMcpSink, reply_outcome
from outbox.sinks.mcp_client import McpServerError
from outbox.sinks.registry import load_sink
from outbox.testing.conformance import TEXTS, SinkConformance, SinkHarness, make_due
from tests.brainlayer_env import BrainLayerEnv, harness_command, hold_write_lock
from tests.sinks.brainlayer_support import POISON, bl_settings, row_of


@contextlib.contextmanager
def _stalled_store(bl: BrainLayerEnv) -> Iterator[None]:
    """brain_store blocks instead of deferring: BrainLayer's handler waits
    BRAINLAYER_STORE_BUSY_BUDGET_MS on a locked database before it defers, so with a long
    budget a server started meanwhile stalls inside the call while the lock is held."""
    with pytest.MonkeyPatch.context() as mp, hold_write_lock(bl.db):
        mp.setenv("BRAINLAYER_STORE_BUSY_BUDGET_MS", "30000")
        yield


class TestBrainLayerMcpConformance(SinkConformance):
    @pytest.fixture
    def sink_harness(self, tmp_path: Path, bl: BrainLayerEnv) -> SinkHarness:
        # The server mints the ids, so a memory is found by its content, under any chunk id.
        return SinkHarness(
            bl_settings(tmp_path, bl, brainlayer_mcp=harness_command()),
            stored_copies=lambda record: bl.rows_holding(record.content),
            poison=POISON,
            hang=lambda: _stalled_store(bl),
        )


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
    settings = bl_settings(tmp_path, bl, brainlayer_mcp=harness_command())
    with Outbox.open(settings) as ob:
        receipt = ob.add(TEXTS[1], importance=6, tags=["mcp"])
        with hold_write_lock(bl.db):
            ob.drain(timeout=60)
        row = row_of(ob, receipt.key)
        assert (row.state, row.error_class, row.sink_id) == ("pending", "db_busy", None)
        assert bl.queued_files() and bl.rows_holding(TEXTS[1]) == 0
        promised = json.loads(bl.queued_files()[0].read_text().splitlines()[0])["chunk_id"]

        make_due(ob)  # queue not drained: BrainLayer defers everything behind it
        ob.drain(timeout=60)
        row = row_of(ob, receipt.key)
        assert (row.state, row.error_class, row.sink_id) == ("pending", "queued_null_chunk", None)

        assert bl.drain_queue() >= 1
        make_due(ob)
        assert ob.drain(timeout=60).ok
        row = row_of(ob, receipt.key)
    assert (row.state, row.sink_id, row.attempts) == ("delivered", promised, 3)
    assert bl.rows_holding(TEXTS[1]) == 1
    stored = bl.chunk(promised)
    assert stored is not None and stored["importance"] == 6.0
    assert "mcp" in json.loads(stored["tags"])


def test_mcp_killed_server_is_transport_closed_then_redelivered_once(
    tmp_path: Path, bl: BrainLayerEnv
) -> None:
    settings = bl_settings(tmp_path, bl, brainlayer_mcp=harness_command())
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
    settings = bl_settings(tmp_path, bl, brainlayer_mcp=str(tmp_path / "no-such-server"))
    with Outbox.open(settings) as ob:
        receipt = ob.add(TEXTS[0])
        report = ob.drain(timeout=60)
        row = row_of(ob, receipt.key)
    # A sink that cannot start charges its records nothing: they wait, untouched, and the
    # drain's report (and the dispatcher's log) names why.
    assert not report.ok
    assert (row.state, row.attempts, row.sink_id) == ("pending", 0, None)
    assert report.sinks["brainlayer"].last_error == "FileNotFoundError"


def test_mcp_rejected_and_outcome_shapes(tmp_path: Path, bl: BrainLayerEnv) -> None:
    """Direct through the real server: REJECTED is permanent, schema errors too."""
    settings = bl_settings(tmp_path, bl, brainlayer_mcp=harness_command())
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


def _tool_result(text: str, *, error: bool = False, data: dict[str, Any] | None = None) -> Any:
    """A ``brain_store`` result of the shape the MCP SDK hands back."""
    return SimpleNamespace(
        content=[SimpleNamespace(text=text)], is_error=error, structured_content=data
    )


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (
            _tool_result("✖ REJECTED: recursive MCP output ─ nothing was stored", error=True),
            ("rejected", False),
        ),
        (_tool_result("Input validation error: 't' is too long", error=True), ("rejected", False)),
        (_tool_result("✖ ERROR: database is locked ─ Retry once", error=True), ("unknown", True)),
        (
            _tool_result(
                "",
                data={
                    "status": "DEFERRED",
                    "chunk_id": "manual-1",
                    "queued": True,
                    "deferred": {"reason": "DB_BUSY"},
                },
            ),
            ("db_busy", True),
        ),
        (
            _tool_result(
                "",
                data={"status": "DEFERRED", "deferred": {"reason": "SCHEMA_FINGERPRINT_MISMATCH"}},
            ),
            ("db_busy", True),
        ),
        (
            _tool_result(
                "", data={"status": "DEFERRED", "deferred": {"reason": "INTERACTIVE_PRIORITY"}}
            ),
            ("queued_null_chunk", True),
        ),
        (_tool_result("", data={"queued": True}), ("queued_null_chunk", True)),
        (
            _tool_result("", data={"status": "STORED", "chunk_id": None}),
            ("queued_null_chunk", True),
        ),
        (_tool_result("chunk_id: null", data=None), ("queued_null_chunk", True)),
    ],
)
def test_brain_store_replies_keep_their_classes(result: Any, expected: tuple[str, bool]) -> None:
    outcome = reply_outcome(result, build_record("a memory for the reply shapes"))
    failure = classify(outcome)  # type: ignore[arg-type]
    assert (failure.reason, failure.transient) == expected


def test_brain_store_deliveries_need_a_chunk_id() -> None:
    record = build_record("a memory for the reply shapes")
    for status in ("STORED", "DUPLICATE", "MERGED", None):
        data = {"status": status, "chunk_id": "manual-0123456789abcdef"}
        assert reply_outcome(_tool_result("", data=data), record) == Delivered(
            "manual-0123456789abcdef"
        )


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (McpServerError(-32602, "Invalid params"), ("unknown", True)),
        (McpServerError(-32603, "database is locked"), ("db_busy", True)),
        (McpServerError(-32000, "Connection closed"), ("transport_closed", True)),
    ],
)
def test_json_rpc_errors_keep_their_classes(exc: Exception, expected: tuple[str, bool]) -> None:
    failure = classify(failure_of(exc))
    assert (failure.reason, failure.transient) == expected


def test_a_replayed_files_provenance_goes_only_where_brain_store_declares_it(
    tmp_path: Path, bl: BrainLayerEnv
) -> None:
    """BrainLayer 1.5.78's ``brain_store`` has no argument for a replayed file's provenance
    (only its in-process ``store_memory`` does): over MCP the record is stored without it,
    never refused for an argument the tool does not name. A server whose tool declares
    ``fallback_source_path`` and ``replayed_by`` gets both."""
    provenance = {"fallback_source_path": "/home/o/decisions/x.md", "replayed_by": "outbox 9"}
    settings = bl_settings(tmp_path, bl, brainlayer_mcp=harness_command())
    with Outbox.open(settings) as ob:
        record = ob.prepare(TEXTS[3], metadata=provenance)
    sink = load_sink("brainlayer", settings)
    try:
        (outcome,) = sink.deliver([record])
        assert isinstance(sink, BrainLayerMcpSink)
        declared = {"content": {}, "fallback_source_path": {}, "replayed_by": {}}
        assert sink.arguments(record, declared) == {"content": TEXTS[3], **provenance}
    finally:
        sink.close()
    assert isinstance(outcome, Delivered), outcome
    assert bl.rows_holding(TEXTS[3]) == 1
