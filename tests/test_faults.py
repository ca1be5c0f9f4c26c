"""The failure scenarios an agent's memory store meets, with faults injected in the sink.

The sink is the FaultySink (its own SQLite file; failures, false acks and transport errors set
per instance or through ``OUTBOX_FAULTY_*`` for child processes), or, where one test needs a
sink that fails for chosen records only, a small sink class defined here. The database,
mirrors and processes are real.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from outbox import Outbox, Settings
from outbox.core.record import Record
from outbox.dispatch.retry import RetryPolicy
from outbox.sinks.base import Delivered, Outcome
from outbox.testing.sinks import FaultySink
from outbox.write.fallback import INDEX_NAME
from tests.conftest import FAULTY
from tests.helpers.checks import (
    accepted_counts,
    contract_key,
    files_by_key,
    front_matter,
    markdown_files,
    split_markdown,
)
from tests.helpers.faults import held_write_lock
from tests.helpers.subproc import child_env, run_cli

# Failed rows wait a minute: one drain makes exactly one attempt per record.
PARKED = RetryPolicy(max_retries=50, base=60.0, cap=60.0)
# Failed rows are due again almost at once: repeated drains retry until delivered.
EAGER = RetryPolicy(max_retries=10_000, base=0.001, cap=0.005)


def _env(settings: Settings, **extra: str) -> dict[str, str]:
    return child_env(settings.home, markdown_dir=str(settings.markdown_dir), **extra)


def _no_fallback_trace(folder: Path) -> None:
    """No fallback index and no file marked as a fallback: nothing went the fallback way."""
    assert not (folder / INDEX_NAME).exists()
    assert not (folder / f"{INDEX_NAME}.processing").exists()
    for path in markdown_files(folder):
        assert front_matter(path).get("outbox_fallback") is not True, path


def test_a_null_chunk_id_is_reported_queued_never_stored(
    settings: Settings, tmp_path: Path
) -> None:
    """The sink keeps the record but answers without an id (``chunk_id: null``)."""
    sink = FaultySink(tmp_path / "sink.db", FAULTY, fail_rate=0, null_rate=1)
    with Outbox.open(settings) as ob:
        receipt = ob.add("a memory the sink only pretends to store")
        assert receipt.status == "queued"
        assert receipt.text == f"Queued {receipt.key} for FaultySink"
        with ob.dispatcher(sink_objects={FAULTY: sink}, policy=PARKED) as dispatcher:
            report = dispatcher.drain()
        assert report.delivered == 0 and not report.ok
        (row,) = ob.storage.deliveries.deliveries_for([receipt.key])[receipt.key]
        assert (row.state, row.sink_id, row.error_class) == ("pending", None, "queued_null_chunk")
        after = ob.wait_delivered(receipt.key, timeout=0.3)
        assert after.status == "queued" and after.sink_ids == {}
        assert after.text == f"Queued {receipt.key} for FaultySink"
    assert set(sink.stored()) == {receipt.key}  # it did keep it: still no delivery without an id
    assert receipt.markdown_path is not None
    matter = front_matter(receipt.markdown_path)
    assert matter["reason"] == "queued_null_chunk"
    assert matter["chunk_id"] is None and matter["retry_attempted"] is True
    assert matter["sinks"] == {FAULTY: "pending"}
    assert "sink_ids" not in matter
    _no_fallback_trace(settings.markdown_dir)

    # The same through the command line, with the false ack configured for the child process.
    env = _env(settings, faulty_null_rate="1", faulty_db=str(tmp_path / "cli-sink.db"))
    added = run_cli(
        ["add", "--json", "another memory acknowledged without an id"], cwd=tmp_path, env=env
    )
    assert added.returncode == 0, added.stderr
    payload = json.loads(added.stdout)
    assert payload["status"] == "queued" and payload["sink_ids"] == {}
    drained = run_cli(["drain", "--timeout", "10"], cwd=tmp_path, env=env)
    assert drained.returncode == 1  # still pending: a null id is not a delivery
    for done in (added, drained):
        assert b"stored" not in done.stdout.lower() and b"saved" not in done.stdout.lower()
    status = json.loads(run_cli(["status", "--json"], cwd=tmp_path, env=env).stdout)
    assert status["sinks"][FAULTY]["delivered"] == 0
    assert status["sinks"][FAULTY]["pending"] == 2


def test_a_closed_transport_leaves_a_file_that_the_output_cites(
    settings: Settings, tmp_path: Path
) -> None:
    """``Transport closed`` on every call, no retries left: a dead letter whose file is named."""
    env = _env(
        settings,
        faulty_fail_rate="1",
        faulty_error="Transport closed",
        faulty_db=str(tmp_path / "sink.db"),
        max_retries="0",
    )
    content = "a memory sent down a closed transport\n"
    added = run_cli(["add", "--json", "--tag", "decision", content], cwd=tmp_path, env=env)
    assert added.returncode == 0, added.stderr
    payload = json.loads(added.stdout)
    path = Path(payload["markdown_path"])
    assert path.is_file() and path.parent == settings.markdown_dir
    drained = run_cli(["drain"], cwd=tmp_path, env=env)
    assert drained.returncode == 1
    matter, body = split_markdown(path)
    assert body == content.encode("utf-8")
    assert matter["reason"] == "transport_closed"
    assert matter["retry_attempted"] is True and matter["chunk_id"] is None
    assert matter["sinks"] == {FAULTY: "dead"}
    shown = run_cli(["dead", "show", payload["key"]], cwd=tmp_path, env=env)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout.decode("utf-8")
    assert f"file: {path}" in text and "reason=transport_closed" in text
    listed = json.loads(run_cli(["dead", "list", "--json"], cwd=tmp_path, env=env).stdout)
    assert [d["key"] for d in listed["dead"]] == [payload["key"]]


def test_a_sink_failing_most_of_the_time_leaves_one_file_per_content(
    settings: Settings, tmp_path: Path
) -> None:
    """fail_rate 0.6 plus false acks, callers repeating themselves, some writes locked out:
    however many retries, each distinct content has exactly one markdown file."""
    settings = replace(settings, busy_timeout=0.3)
    stamp = "2026-11-29T08:00:00.000000Z"
    contents = [f"decision {i}: a memory the flaky sink keeps dropping" for i in range(15)]
    sink = FaultySink(tmp_path / "sink.db", FAULTY, fail_rate=0.6, null_rate=0.1)
    ob = Outbox.open(settings)
    try:
        with held_write_lock(settings.home / "outbox.db"):
            locked = [ob.add(content, timestamp=stamp) for content in contents[:3]]
        assert {r.status for r in locked} == {"fallback"}
        first = [ob.add(content, timestamp=stamp) for content in contents]
        again = [ob.add(content, timestamp=stamp) for content in contents[3:]]  # caller retries
        assert all(r.duplicate for r in again)
        keys = {contract_key(content, stamp) for content in contents}
        assert {r.key for r in first} == keys
        deadline = time.monotonic() + 60
        while ob.storage.deliveries.counts()[FAULTY]["delivered"] < len(contents):
            assert time.monotonic() < deadline, ob.storage.deliveries.counts()
            with ob.dispatcher(sink_objects={FAULTY: sink}, policy=EAGER) as dispatcher:
                dispatcher.drain()
        attempts = sum(
            row.attempts
            for rows in ob.storage.deliveries.deliveries_for(keys).values()
            for row in rows
        )
    finally:
        ob.close()
    with Outbox.open(settings) as ob:  # imports the three fallback files: all duplicates now
        assert ob.storage.records.count_records() == len(contents)
        assert ob.verify().ok
    assert attempts > len(contents)  # the sink really did fail, and retries really happened
    by_key = files_by_key(settings.markdown_dir)
    assert set(by_key) == keys
    assert all(len(files) == 1 for files in by_key.values()), by_key
    bodies = [split_markdown(p)[1] for p in markdown_files(settings.markdown_dir)]
    assert sorted(bodies) == sorted(c.encode("utf-8") for c in contents)
    assert set(sink.stored()) == keys
    assert set(accepted_counts(settings.jsonl_path).values()) == {1}


def test_a_successful_store_writes_no_fallback_file(settings: Settings, tmp_path: Path) -> None:
    sink = FaultySink(tmp_path / "sink.db", FAULTY, fail_rate=0, null_rate=0)
    with Outbox.open(settings) as ob:
        receipt = ob.add("a memory the sink takes at the first attempt")
        assert receipt.status == "queued"
        _no_fallback_trace(settings.markdown_dir)
        with ob.dispatcher(sink_objects={FAULTY: sink}) as dispatcher:
            assert dispatcher.drain().ok
        stored = ob.wait_delivered(receipt.key, timeout=5)
    sink_id = f"faulty-{receipt.key[:16]}"
    assert stored.status == "stored"
    assert stored.text == f"Stored in FaultySink: {sink_id}"
    (path,) = markdown_files(settings.markdown_dir)
    matter = front_matter(path)
    assert matter["sinks"] == {FAULTY: "delivered"}
    assert matter["sink_ids"] == {FAULTY: sink_id}
    assert (matter["reason"], matter["retry_attempted"]) == ("delivered", False)
    _no_fallback_trace(settings.markdown_dir)
    added = run_cli(
        ["add", "a second memory, through the command line"], cwd=tmp_path, env=_env(settings)
    )
    assert added.returncode == 0 and added.stdout.startswith(b"Queued ")
    assert len(markdown_files(settings.markdown_dir)) == 2
    _no_fallback_trace(settings.markdown_dir)


UNREACHABLE = "[unreachable]"


class SelectiveSink:
    """Delivers every record except those whose content holds ``[unreachable]``, for which
    the transport stays closed: the replay test needs to choose who fails."""

    semantic = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.received: dict[str, int] = {}

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for record in batch:
            if UNREACHABLE in record.content:
                outcomes.append(ConnectionError("Transport closed"))
            else:
                self.received[record.key] = self.received.get(record.key, 0) + 1
                outcomes.append(Delivered(f"chunk-{record.key[:12]}"))
        return outcomes

    def close(self) -> None:
        """Nothing held open."""


SEED_FILE = """---
intended_brain_store: true
importance: {importance}
tags: [replay, seed-000]
timestamp: '2026-03-1{day}T10:00:00Z'
reason: db_busy
retry_attempted: false
chunk_id:
---
{body}"""


@pytest.mark.parametrize("sink_name", [FAULTY, "brainlayer"])
def test_replay_of_three_pending_files_updates_only_the_delivered_ones(
    settings: Settings, sink_name: str
) -> None:
    """Three pending files from an agent's own fallback; the sink takes two. The two show
    the delivery in their front matter, the third stays pending, and replaying again adds
    nothing.

    ``chunk_id`` is BrainLayer's: it is filled only for a sink configured as ``brainlayer``.
    The ``brainlayer`` case hands the dispatcher a sink object under that name, so what is
    tested is the outbox's bookkeeping, not BrainLayer (its sink has its own tests).
    """
    settings = replace(settings, sinks=(sink_name,))
    folder = settings.markdown_dir
    folder.mkdir(parents=True)
    bodies = {
        "2026-03-11-first.md": "first pending memory, to be delivered\n",
        "2026-03-12-second.md": f"second pending memory {UNREACHABLE}\n",
        "2026-03-13-third.md": "third pending memory, also delivered",
    }
    for day, (name, body) in enumerate(bodies.items(), start=1):
        (folder / name).write_text(
            SEED_FILE.format(importance=day + 5, day=day, body=body), encoding="utf-8"
        )
    sink = SelectiveSink(sink_name)
    with Outbox.open(settings) as ob:
        report = ob.replay()
        assert len(report.imported) == 3 and not report.skipped
        with ob.dispatcher(sink_objects={sink_name: sink}, policy=PARKED) as dispatcher:
            dispatcher.drain()
        again = ob.replay()
        assert ob.storage.records.count_records() == 3
    brainlayer = sink_name == "brainlayer"
    # A filled chunk_id ends a file's pending state; the rest are already imported.
    assert again.imported == [] and len(again.already) == (1 if brainlayer else 3)
    for day, (name, body) in enumerate(bodies.items(), start=1):
        matter, raw = split_markdown(folder / name)
        assert raw == body.encode("utf-8")
        key = contract_key(body, f"2026-03-1{day}T10:00:00.000000Z")
        assert matter["key"] == key
        assert matter["importance"] == day + 5 and matter["tags"] == ["replay", "seed-000"]
        if UNREACHABLE in body:
            assert matter["sinks"] == {sink_name: "pending"}
            assert matter["retry_attempted"] is True
            assert matter["reason"] == "transport_closed"
            assert matter["chunk_id"] is None and "sink_ids" not in matter
            assert key not in sink.received
        else:
            assert matter["sinks"] == {sink_name: "delivered"}
            assert matter["sink_ids"] == {sink_name: f"chunk-{key[:12]}"}
            assert matter["chunk_id"] == (f"chunk-{key[:12]}" if brainlayer else None)
            assert matter["retry_attempted"] is True  # the replay's delivery was the retry
            assert sink.received[key] == 1
    assert sorted(p.name for p in markdown_files(folder)) == sorted(bodies)  # none moved/added


def test_status_shows_the_writes_waiting_for_a_locked_database(
    settings: Settings, tmp_path: Path
) -> None:
    """While the database refuses writes, ``status`` cannot import the fallback files either:
    it says how many wait, in text and in ``--json``; once they are in, it says nothing."""
    with Outbox.open(settings) as ob:
        ob.add("a first memory so the store exists")
    env = _env(settings, OUTBOX_BUSY_TIMEOUT="0.2")
    with held_write_lock(settings.home / "outbox.db"):
        for text in ("the first refused memory", "the second refused memory"):
            added = run_cli(["add", "--json", text], cwd=tmp_path, env=env)
            assert json.loads(added.stdout)["status"] == "fallback", added.stderr
        locked = run_cli(["status", "--json"], cwd=tmp_path, env=env)
        shown = run_cli(["status"], cwd=tmp_path, env=env).stdout.decode()
    assert json.loads(locked.stdout)["fallback_waiting"] == 2
    assert "fallback queue: 2 writes wait for the database" in shown
    after = run_cli(["status", "--json"], cwd=tmp_path, env=env)
    assert json.loads(after.stdout)["fallback_waiting"] == 0
    assert json.loads(after.stdout)["records"] == 3
    assert "fallback queue" not in run_cli(["status"], cwd=tmp_path, env=env).stdout.decode()
