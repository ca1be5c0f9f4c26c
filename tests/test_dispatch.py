"""The dispatcher in one process: fan-out, retries to dead letter, false acks, waiting, leases."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from outbox import Outbox, Settings
from outbox.core.record import build_record
from outbox.dispatch.retry import RetryPolicy
from outbox.faces.cli import main as cli_main
from outbox.testing.sinks import FaultySink
from outbox.write.fallback import FallbackQueue

A = "outbox.testing.sinks:FaultySink"
B = "outbox.testing.sinks:faulty_sink"
FAST = RetryPolicy(max_retries=2, base=0.01, cap=0.02)


def _front_matter(path: Path) -> dict[str, object]:
    return yaml.safe_load(path.read_text(encoding="utf-8").split("---\n")[1])


def _events(ob: Outbox) -> list[dict[str, object]]:
    return [line.event for line in ob.mirrors.jsonl.lines()]


def _wait_for(predicate: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_a_hung_sink_does_not_delay_another(settings: Settings, tmp_path: Path) -> None:
    """A's 40 records are delivered and settled while B's first batch hangs (50 s, longer
    than the test waits). The test waits on the outbox's own counts: the sink holds a batch
    before the dispatcher settles it, and B's worker may claim after A has finished."""
    settings = replace(settings, sinks=(A, B), sink_timeout=60.0, poll_interval=0.05)
    healthy = FaultySink(tmp_path / "a.db", A, fail_rate=0, hang=0)
    hung = FaultySink(tmp_path / "b.db", B, fail_rate=0, hang=50)
    with Outbox.open(settings) as ob:
        keys = [ob.add(f"memory {i} for two sinks").key for i in range(40)]
        dispatcher = ob.dispatcher(sink_objects={A: healthy, B: hung}, batch_size=10)
        runner = threading.Thread(target=dispatcher.run, daemon=True)
        runner.start()

        def settled() -> bool:
            counts = ob.storage.deliveries.counts()
            return counts[A]["delivered"] == 40 and counts[B]["leased"] == 10

        try:
            assert _wait_for(settled), f"healthy sink starved: {ob.storage.deliveries.counts()}"
            assert len(healthy.stored()) == 40
            # B's first batch is still inside its hung call, leased, not delivered.
            assert ob.storage.deliveries.counts()[B]["delivered"] == 0
        finally:
            dispatcher.stop_event.set()
            hung.release()
            runner.join(timeout=40)
            dispatcher.close()
        assert set(healthy.stored()) == set(keys)


def test_transient_failures_end_as_dead_letters(settings: Settings, tmp_path: Path) -> None:
    sink = FaultySink(tmp_path / "f.db", A, fail_rate=1.0)
    with Outbox.open(settings) as ob:
        receipt = ob.add("a memory whose sink keeps closing the transport")
        for _ in range(10):
            with ob.dispatcher(sink_objects={A: sink}, policy=FAST) as dispatcher:
                dispatcher.drain()
            if ob.storage.deliveries.counts()[A]["dead"]:
                break
            time.sleep(0.03)
        (row,) = ob.storage.deliveries.deliveries_for([receipt.key])[receipt.key]
        assert row.state == "dead"
        assert row.attempts == 3  # the first try and max_retries=2 retries
        assert row.error_class == "transport_closed"
        matter = _front_matter(receipt.markdown_path)  # type: ignore[arg-type]
        assert matter["reason"] == "transport_closed"
        assert matter["retry_attempted"] is True
        assert matter["chunk_id"] is None
        dead_events = [e for e in _events(ob) if e.get("event") == "dead"]
        assert [e["key"] for e in dead_events] == [receipt.key]
        assert ob.verify().ok

        # An operator requeues it; the sink has recovered; it is delivered once.
        assert ob.storage.deliveries.requeue_dead([receipt.key]) == 1
        sink.fail_rate = 0.0
        with ob.dispatcher(sink_objects={A: sink}, policy=FAST) as dispatcher:
            assert dispatcher.drain().ok
        assert sink.stored() == {receipt.key: 1}
        assert _front_matter(receipt.markdown_path)["sinks"] == {A: "delivered"}  # type: ignore[arg-type]


def test_a_reply_without_an_id_is_not_a_delivery(settings: Settings, tmp_path: Path) -> None:
    sink = FaultySink(tmp_path / "n.db", A, null_rate=1.0)
    with Outbox.open(settings) as ob:
        receipt = ob.add("the sink answers chunk_id: null for this one")
        # A backoff no drain outlasts: with FAST's 10-20 ms, a drain slowed by a busy machine
        # found the row due again, retried it to its cap and left it dead, not pending.
        patient = RetryPolicy(max_retries=2, base=600.0, cap=600.0)
        with ob.dispatcher(sink_objects={A: sink}, policy=patient) as dispatcher:
            report = dispatcher.drain()
        assert not report.ok
        (row,) = ob.storage.deliveries.deliveries_for([receipt.key])[receipt.key]
        assert row.state == "pending"
        assert row.error_class == "queued_null_chunk"
        assert row.sink_id is None
        health = ob.status()["sinks"][A]
        assert (health["retrying"], health["last_failure"]) == (1, "queued_null_chunk")
        waited = ob.wait_delivered(receipt.key, timeout=0.2)
        assert waited.status == "queued"
        assert "Stored" not in waited.text


def test_wait_delivered_reports_the_concrete_id(settings: Settings) -> None:
    with Outbox.open(settings) as ob:
        receipt = ob.add("wait for me to be stored")
        assert receipt.status == "queued"
        drainer = threading.Thread(target=lambda: time.sleep(0.2) or ob.drain())
        drainer.start()
        stored = ob.wait_delivered(receipt.key, timeout=30)
        drainer.join()
        assert stored.status == "stored"
        assert stored.sink_ids[A] == f"faulty-{receipt.key[:16]}"
        assert stored.text == f"Stored in FaultySink: faulty-{receipt.key[:16]}"
        # A repeat write of the same record now reports the existing delivery.
        again = ob.add("wait for me to be stored", timestamp=receipt.timestamp)
        assert again.duplicate and again.status == "stored"


def test_expired_lease_is_taken_over_and_the_old_owner_cannot_settle(
    settings: Settings,
) -> None:
    with Outbox.open(settings) as ob:
        receipt = ob.add("claimed by a dispatcher that then died")
        (claim,) = ob.storage.deliveries.claim(A, "dead-owner", 10, lease_seconds=1.0)
        assert ob.storage.deliveries.claim(A, "other", 10, lease_seconds=1.0) == []  # live lease
        time.sleep(1.1)
        assert ob.drain().ok
        done, _ = ob.storage.deliveries.settle("dead-owner", [(claim.delivery_id, "late-id")], [])
        assert done == []
        (row,) = ob.storage.deliveries.deliveries_for([receipt.key])[receipt.key]
        assert row.sink_id == f"faulty-{receipt.key[:16]}"
        assert row.attempts == 2


def test_cli_drain_and_dead_letters(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OUTBOX_HOME", str(settings.home))
    monkeypatch.setenv("OUTBOX_MARKDOWN_DIR", str(settings.markdown_dir))
    monkeypatch.setenv("OUTBOX_SINKS", A)
    monkeypatch.setenv("OUTBOX_MAX_RETRIES", "0")
    monkeypatch.setenv("OUTBOX_FAULTY_REJECT", "POISON")
    assert cli_main(["add", "a good memory for the command line"]) == 0
    assert cli_main(["add", "a POISON memory the sink refuses"]) == 0
    capsys.readouterr()
    assert cli_main(["drain", "--json"]) == 1  # one dead letter left
    report = json.loads(capsys.readouterr().out)
    assert report["delivered"] == 1 and report["sinks"][A]["dead"] == 1
    assert cli_main(["dead", "list", "--json"]) == 0
    (dead,) = json.loads(capsys.readouterr().out)["dead"]
    assert dead["reason"] == "rejected"
    assert cli_main(["dead", "discard", dead["key"]]) == 0
    assert "discarded 1" in capsys.readouterr().out
    assert cli_main(["status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["sinks"][A]["discarded"] == 1 and status["dead_letters"] == 0


def test_verify_repair_rewrites_a_file_lost_long_after_its_write(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with Outbox.open(settings) as ob:
        receipt = ob.add("a memory whose markdown file is deleted later")
        ob.add("a second memory, so the watermark moves past the first")
    with Outbox.open(settings):  # the open-time repair moves the watermark past both
        pass
    assert receipt.markdown_path is not None
    receipt.markdown_path.unlink()
    monkeypatch.setenv("OUTBOX_HOME", str(settings.home))
    monkeypatch.setenv("OUTBOX_MARKDOWN_DIR", str(settings.markdown_dir))
    monkeypatch.setenv("OUTBOX_SINKS", A)
    assert cli_main(["verify"]) == 1
    assert "is missing" in capsys.readouterr().out
    assert cli_main(["verify", "--repair"]) == 0
    assert receipt.markdown_path.read_bytes().endswith(b"deleted later")


def test_a_sink_that_cannot_load_leaves_its_rows_untouched(settings: Settings) -> None:
    broken = "outbox.testing.sinks:NoSuchSink"
    with Outbox.open(replace(settings, sinks=(broken,))) as ob:
        receipt = ob.add("a memory for a sink whose module attribute is missing")
        report = ob.drain(timeout=10)
        assert not report.ok
        assert report.sinks[broken].last_error == "ConfigError"
        (row,) = ob.storage.deliveries.deliveries_for([receipt.key])[receipt.key]
        assert (row.state, row.attempts, row.error_class) == ("pending", 0, None)


def test_a_failed_maintenance_round_does_not_stop_the_daemon(
    settings: Settings, tmp_path: Path
) -> None:
    """A database locked past the busy timeout during maintenance (pruning, mirror catch-up)
    is retried next round; the daemon keeps delivering."""
    settings = replace(settings, retention=10.0, poll_interval=0.05)
    sink = FaultySink(tmp_path / "a.db", A, fail_rate=0, hang=0)
    rounds: list[str] = []
    with Outbox.open(settings) as ob:
        dispatcher = ob.dispatcher(sink_objects={A: sink}, batch_size=10)
        original = dispatcher.maintain

        def flaky_maintain() -> int:
            rounds.append("called")
            if len(rounds) == 1:
                raise sqlite3.OperationalError("database is locked")
            return original()

        dispatcher.maintain = flaky_maintain  # type: ignore[method-assign]
        runner = threading.Thread(target=dispatcher.run, daemon=True)
        runner.start()
        try:
            assert _wait_for(lambda: len(rounds) >= 2, timeout=20), "no second round"
            assert runner.is_alive()
            key = ob.add("delivered after a failed maintenance round").key
            assert _wait_for(lambda: key in sink.stored())
        finally:
            dispatcher.stop_event.set()
            runner.join(timeout=20)
            dispatcher.close()


def test_a_write_in_this_process_wakes_the_daemon_until_it_closes(
    settings: Settings, tmp_path: Path
) -> None:
    """The façade hands the dispatcher a way to be woken by this process's writes: with a
    poll interval of ten minutes, only that wake-up can deliver in time. Once the dispatcher
    is closed, writes no longer call into it."""
    settings = replace(settings, poll_interval=600.0, retention=3600.0)
    sink = FaultySink(tmp_path / "a.db", A, fail_rate=0, hang=0)
    with Outbox.open(settings) as ob:
        dispatcher = ob.dispatcher(sink_objects={A: sink})
        woken: list[int] = []
        original = dispatcher.wake

        def counting_wake() -> None:
            woken.append(1)
            original()

        dispatcher.wake = counting_wake  # type: ignore[method-assign]
        runner = threading.Thread(target=dispatcher.run, daemon=True)
        runner.start()
        try:
            time.sleep(0.2)  # the daemon is idle, waiting out its poll
            key = ob.add("delivered because the write woke the daemon").key
            assert _wait_for(lambda: key in sink.stored(), timeout=20)
        finally:
            dispatcher.stop_event.set()
            runner.join(timeout=20)
            dispatcher.close()
        calls = len(woken)
        assert calls >= 1
        ob.add("written after the dispatcher closed")
        assert len(woken) == calls


def test_maintenance_runs_the_facades_chores_not_the_delivery_loop(
    settings: Settings, tmp_path: Path
) -> None:
    """Importing fallback files is the façade's chore, run in maintenance rounds; a delivery
    batch only mirrors its own outcomes."""
    sink = FaultySink(tmp_path / "a.db", A, fail_rate=0, hang=0)
    with Outbox.open(settings) as ob:
        ob.add("one record to deliver")
        FallbackQueue(settings.markdown_dir, settings.sinks).write(
            build_record("a memory the database could not take"), "db_busy"
        )
        with ob.dispatcher(sink_objects={A: sink}) as dispatcher:
            assert dispatcher.workers[A].run_batch() == 1
            assert ob.fallback.pending_count() == 1  # the delivery loop left it alone
            dispatcher.maintain()
            assert ob.fallback.pending_count() == 0
        assert ob.storage.records.count_records() == 2
