"""``outbox reindex`` on a real embedded Chroma: a model change re-embeds every record into a
new collection while the old one keeps serving, survives a SIGKILL, and switches safely."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from outbox import Outbox, Settings
from outbox.faces.cli import main
from outbox.operations.reindex import ReindexProgress, ReindexReport
from outbox.sinks.chroma import ChromaSink, EmbeddingMismatch
from outbox.sinks.chroma_index import IndexPointer
from outbox.sinks.embedding import HashingEmbedding, MiniLMEmbedding, embedding_name
from tests.sinks.chroma_support import chroma_settings, open_client

ROOT = Path(__file__).resolve().parent.parent
BASE = "memories"
COUNTING = "tests.test_reindex:CountingEmbedding"
NEEDLE = "The deploy pipeline failed because the database password had expired"


class CountingEmbedding(HashingEmbedding):
    """The hashing embedder under another name, so switching to it is a model change; it
    logs how many texts it embeds, and may be slowed so that a kill lands mid-run."""

    def __call__(self, input: list[str]) -> list[Any]:
        log = os.environ.get("OUTBOX_TEST_EMBED_LOG")
        if log:
            with open(log, "a", encoding="utf-8") as handle:
                handle.write(f"{len(input)}\n")
        time.sleep(float(os.environ.get("OUTBOX_TEST_EMBED_DELAY", "0")))
        return super().__call__(input)

    @staticmethod
    def name() -> str:
        return "test_counting_hashing"


def _settings(tmp_path: Path, embedding: str) -> Settings:
    return chroma_settings(tmp_path, chroma_collection=BASE, embedding=embedding)


def _filled(settings: Settings, total: int) -> set[str]:
    """``total`` records (one of them NEEDLE) delivered into the configured collection."""
    texts = [f"memory {i} about topic {i % 7} and the weather" for i in range(total - 1)]
    with Outbox.open(settings) as ob:
        keys = {receipt.key for receipt in ob.add_many([*texts, NEEDLE])}
        assert ob.drain(timeout=120).ok
    return keys


def _collections(settings: Settings) -> dict[str, set[str]]:
    """Every collection's ids, read with a client of our own (no sink may be open)."""
    with open_client(settings) as client:
        return {
            c.name: set(client.get_collection(c.name).get(include=[])["ids"])
            for c in client.list_collections()
        }


@pytest.fixture
def sinks() -> Iterator[list[ChromaSink]]:
    opened: list[ChromaSink] = []
    yield opened
    for sink in opened:
        sink.close()


def _wait_for_a_waiter(lock: Path) -> None:
    """Until some process waits for a ``flock`` on ``lock`` (Linux lists it in /proc/locks)."""
    inode = f":{lock.stat().st_ino} "
    deadline = time.monotonic() + 60
    while not any(
        "->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines()
    ):
        assert time.monotonic() < deadline, "the reindex never waited for the index lock"
        time.sleep(0.01)


class _Pauses:
    """A progress callback that stops the reindex at chosen points until the test is done
    looking, and remembers every report."""

    def __init__(self) -> None:
        self.seen: list[ReindexProgress] = []
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.pause_at: int | None = None

    def __call__(self, progress: ReindexProgress) -> None:
        self.seen.append(progress)
        if self.pause_at is not None and progress.done >= self.pause_at:
            self.pause_at = None
            self.paused.set()
            assert self.resume.wait(120)
            self.resume.clear()

    def hold(self, at: int) -> None:
        self.paused.clear()
        self.pause_at = at


def test_model_change_keeps_recall_and_delivery_and_switches(
    tmp_path: Path, sinks: list[ChromaSink], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "outbox.operations.reindex")
    old = _settings(tmp_path, "hashing")
    new = replace(old, embedding="minilm")
    keys = _filled(old, 300)
    recall = ChromaSink.from_settings(new)  # a process already set to the new model
    sinks.append(recall)
    with pytest.raises(EmbeddingMismatch, match="outbox reindex"):
        recall.search("weather", 3)

    pauses = _Pauses()
    pauses.hold(50)
    result: list[ReindexReport] = []
    with Outbox.open(new) as ob:
        worker = threading.Thread(
            target=lambda: result.append(ob.reindex(progress=pauses, batch=50))
        )
        worker.start()
        assert pauses.paused.wait(120)
        # Halfway: recall is answered from the old collection, with the old model.
        assert recall.active_index().collection == BASE
        assert embedding_name(recall.embedder()) == HashingEmbedding.name()
        assert set(recall.search("topic 3 weather", 5).ids) <= keys
        # A record written now is delivered into the old collection, as before.
        with Outbox.open(old) as writer:
            during = writer.add("written while the reindex runs, about gardening").key
            assert writer.drain(timeout=60).ok
        assert during in recall.search("gardening while the reindex runs", 3).ids
        pauses.hold(len(keys) + 1)
        pauses.resume.set()
        # At the end: a delivery in flight (its shared lock held) when the switch is due.
        assert pauses.paused.wait(120)
        with IndexPointer(old.home, BASE).held():
            pauses.resume.set()
            _wait_for_a_waiter(old.home / "vector-index.lock")
            with Outbox.open(old) as writer:
                late = writer.add("delivered into the old index just before the switch").key
                assert writer.drain(timeout=60).ok
        worker.join(120)
    (report,) = result
    assert "records arrived while switching" in caplog.text, "the late record was re-checked"
    assert (report.status, report.previous, report.records) == ("done", BASE, 302)
    # After: recall is answered from the new collection with the new model, in every process.
    assert recall.active_index().collection == report.collection == f"{BASE}.v1"
    assert embedding_name(recall.embedder()) == MiniLMEmbedding.name()
    hits = recall.search("why did the release break? the credentials had lapsed", 3)
    assert hits.ids and set(hits.ids) <= keys
    still_old = ChromaSink.from_settings(old)
    sinks.append(still_old)
    assert embedding_name(still_old.embedder()) == MiniLMEmbedding.name()
    assert still_old.count() == 302
    for sink in sinks:
        sink.close()
    stored = _collections(old)
    assert set(stored) == {report.collection}, "the old collection is dropped"
    assert stored[report.collection] == keys | {during, late}


def _state(settings: Settings) -> dict[str, Any] | None:
    try:
        value: dict[str, Any] = json.loads((settings.home / f"reindex-{BASE}.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return value


def _embedded(log: Path) -> int:
    return sum(int(line) for line in log.read_text().split()) if log.exists() else 0


def _command_env(settings: Settings) -> dict[str, str]:
    """The environment of an ``outbox reindex`` process on ``settings``' store, to COUNTING."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OUTBOX_HOME": str(settings.home),
        "OUTBOX_MARKDOWN_DIR": str(settings.markdown_dir),
        "OUTBOX_SINKS": "chroma",
        "OUTBOX_CHROMA_PATH": str(settings.chroma_path),
        "OUTBOX_CHROMA_MODE": "embedded",
        "OUTBOX_CHROMA_COLLECTION": BASE,
        "OUTBOX_EMBEDDING": COUNTING,
    }


def test_a_second_reindex_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    """Two reindexes of one collection would fill the same new collection and race to switch:
    while the first (here paused after its first batch) holds the collection's reindex lock,
    a second process is refused at once with one line, and the first finishes alone."""
    settings = _settings(tmp_path, "hashing")
    keys = _filled(settings, 40)
    pauses = _Pauses()
    pauses.hold(10)
    result: list[ReindexReport] = []
    with Outbox.open(replace(settings, embedding=COUNTING)) as ob:
        worker = threading.Thread(
            target=lambda: result.append(ob.reindex(progress=pauses, batch=10))
        )
        worker.start()
        try:
            assert pauses.paused.wait(120)
            second = subprocess.run(
                [sys.executable, "-m", "outbox", "reindex"],
                env=_command_env(settings),
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            pauses.resume.set()
            worker.join(120)
    assert second.returncode == 1
    (line,) = second.stderr.splitlines()
    lock = settings.home / f"reindex-{BASE}.lock"
    assert f"another `outbox reindex` of {BASE!r} is running (it holds {lock})" in line
    (report,) = result
    assert report.status == "done"
    assert _collections(settings) == {f"{BASE}.v1": keys}


def test_a_killed_reindex_resumes_without_embedding_again(tmp_path: Path) -> None:
    settings = _settings(tmp_path, "hashing")
    total, batch = 400, 20
    keys = _filled(settings, total)
    log = tmp_path / "embedded.log"
    env = {**_command_env(settings), "OUTBOX_TEST_EMBED_LOG": str(log)}
    command = [sys.executable, "-m", "outbox", "reindex", "--batch", str(batch), "--json"]
    first = subprocess.Popen(
        command, env={**env, "OUTBOX_TEST_EMBED_DELAY": "0.05"}, stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 120
    while ((_state(settings) or {}).get("seen", 0)) < total // 2:
        assert first.poll() is None and time.monotonic() < deadline, "it ended before the kill"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    state = _state(settings)
    assert state is not None and 0 < state["seen"] < total
    before = _embedded(log)
    assert 0 <= before - state["seen"] <= batch, "at most the batch under way is lost"

    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert second.returncode == 0, second.stderr
    report = json.loads(second.stdout)
    assert report["status"] == "done" and report["resumed_after"] == state["done_seq"]
    assert report["embedded"] == _embedded(log) - before == total - state["seen"]
    assert "records" in second.stderr, "progress is shown on stderr"
    assert _state(settings) is None
    assert _collections(settings) == {f"{BASE}.v1": keys}


def test_nothing_to_do_and_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = _settings(tmp_path, "hashing")
    keys = _filled(settings, 40)
    for name, value in {
        "OUTBOX_HOME": settings.home,
        "OUTBOX_MARKDOWN_DIR": settings.markdown_dir,
        "OUTBOX_SINKS": "chroma",
        "OUTBOX_CHROMA_PATH": settings.chroma_path,
        "OUTBOX_CHROMA_MODE": "embedded",
        "OUTBOX_CHROMA_COLLECTION": BASE,
        "OUTBOX_EMBEDDING": "hashing",
    }.items():
        monkeypatch.setenv(name, str(value))
    assert main(["reindex", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "nothing to do"

    stop = threading.Event()
    with Outbox.open(replace(settings, embedding=COUNTING)) as ob:
        report = ob.reindex(progress=lambda _progress: stop.set(), stop=stop, batch=10)
    assert (report.status, report.ok, report.records) == ("interrupted", False, 10)
    # The operator changes their mind: back to the model that serves; the half-built
    # collection is dropped.
    assert main(["reindex"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert _collections(settings) == {BASE: keys}


def test_a_forgotten_record_is_neither_embedded_nor_counted_as_a_record(tmp_path: Path) -> None:
    """Forget one of seven, then change the model: the new collection holds the six live
    records, and the report says six records, six embedded and one forgotten, as ``status``."""
    settings = _settings(tmp_path, "hashing")
    keys = _filled(settings, 7)
    gone = sorted(keys)[0]
    with Outbox.open(settings) as ob:
        ob.forget(gone)
        assert ob.drain(timeout=120).ok  # Chroma's delete
    assert _collections(settings) == {BASE: keys - {gone}}
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "reindex", "--json"],
        env=_command_env(settings),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["status"], report["records"], report["embedded"]) == ("done", 6, 6)
    assert report["forgotten"] == 1
    assert _collections(settings) == {f"{BASE}.v1": keys - {gone}}


def test_a_record_the_new_index_refuses_is_logged_by_key_prefix_never_by_content(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sink's error text may quote the memory it refused: the reindex's warning names the
    record by key prefix and the reason class; the text goes to debug only."""
    from outbox.core.naming import key_prefix
    from outbox.core.record import build_record
    from outbox.operations.reindex import Reindexer
    from outbox.sinks.base import Rejected

    class Refusing:
        """A target refusing every record, quoting it as some libraries do."""

        def deliver(self, batch: list[Any]) -> list[Any]:
            raise Rejected(f"cannot embed {batch[0].content!r}")

    settings = _settings(tmp_path, "hashing")
    records = [build_record(f"secret plan number {i}") for i in range(2)]
    caplog.set_level(logging.DEBUG, "outbox.operations.reindex")
    with Outbox.open(settings) as ob:
        reindexer = Reindexer(ob.storage, settings)
        assert reindexer._deliver(Refusing(), records) == 0  # type: ignore[arg-type]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2
    for record, line in zip(records, warnings, strict=True):
        assert key_prefix(record.key) in line and "(rejected)" in line
        assert "secret plan" not in line
    assert any(
        "secret plan" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG
    )


def test_reindex_lowers_its_own_priority_like_a_drain(tmp_path: Path) -> None:
    """It embeds every record, as a backfill does: its threads run at ``OUTBOX_RUN_NICE``
    like ``outbox run`` and ``outbox drain`` (read back from ``/proc`` while it embeds)."""
    from tests.test_dispatcher_leaves_a_core import nice_of

    settings = _settings(tmp_path, "hashing")
    _filled(settings, 200)
    mine = os.nice(0)
    env = {**_command_env(settings), "OUTBOX_TEST_EMBED_DELAY": "0.2", "OUTBOX_RUN_NICE": "3"}
    log = tmp_path / "embedded.log"
    env["OUTBOX_TEST_EMBED_LOG"] = str(log)
    child = subprocess.Popen(
        [sys.executable, "-m", "outbox", "reindex", "--batch", "10"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text()):  # embedding: past its start-up
            assert child.poll() is None and time.monotonic() < deadline, "it ended first"
            time.sleep(0.02)
        tasks = [int(name) for name in os.listdir(f"/proc/{child.pid}/task")]
        values = {nice_of(child.pid, task) for task in tasks}
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(60)
    assert values == {min(19, mine + 3)}, values
