"""The Chroma sink against real Chroma: embedded (PersistentClient) and a ``chroma run`` server.

Both pass the shared conformance suite; the tests below add outages (server stopped, server
frozen), semantic recall by paraphrase, metadata mapping, per-record refusals and the
classification of the exceptions real Chroma raises.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import chromadb
import httpx
import numpy as np
import pytest
from chromadb.errors import InternalError
from sqlalchemy import update

from outbox import Outbox, Settings, load_settings
from outbox.dispatch.classify import classify
from outbox.dispatch.dispatcher import Dispatcher
from outbox.errors import ConfigError
from outbox.record import build_record
from outbox.sinks.base import Delivered, Rejected
from outbox.sinks.chroma import ChromaSink, EmbeddingMismatch, chroma_metadata, parse_chroma_url
from outbox.sinks.chroma_local import OWNER_LOCK, ChromaStalled, StoreOwned
from outbox.sinks.embedding import HashingEmbedding
from outbox.store.schema import deliveries
from tests.chroma_server import ChromaServer, free_port
from tests.sinks.conformance import TEXTS, SinkConformance

# Zero-width space, word joiner, BOM: passes the outbox's own validation (str.strip() keeps
# them), but the tokenizer drops every one, so it would embed to the empty string's vector.
INVISIBLE = "\u200b\u2060\ufeff\u200b"

HOLD_FLOCK = """
import fcntl, os, sys
handle = open(sys.argv[1], "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
handle.seek(0)
handle.truncate()
handle.write(str(os.getpid()))
handle.flush()
print("held", flush=True)
sys.stdin.read()
"""

HOLD_LOCK = """
import select, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
select.select([sys.stdin], [], [], float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


def chroma_settings(tmp_path: Path, **overrides: Any) -> Settings:
    return load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks="chroma",
        chroma_path=tmp_path / "chroma",
        chroma_collection=f"test-{uuid.uuid4().hex[:12]}",
        **overrides,
    )


@contextlib.contextmanager
def open_client(settings: Settings) -> Iterator[Any]:
    """A chromadb client of our own, to look at the store without the sink's code."""
    if settings.chroma_url:
        host, port, ssl = parse_chroma_url(settings.chroma_url)
        client = chromadb.HttpClient(host=host, port=port, ssl=ssl)
    else:
        client = chromadb.PersistentClient(str(settings.chroma_path))
    try:
        yield client
    finally:
        client.close()


def stored_ids(settings: Settings) -> list[str]:
    with open_client(settings) as client:
        return list(client.get_collection(settings.chroma_collection).get(include=[])["ids"])


def make_due(ob: Outbox) -> None:
    """Skip the backoff wait so the next drain retries now."""
    with ob.engine.begin() as conn:
        conn.execute(update(deliveries).values(available_at=0.0))


@contextlib.contextmanager
def exclusive_lock(database: Path) -> Iterator[None]:
    """Another process holds ``BEGIN EXCLUSIVE`` until the block ends (60 s at most, so a
    regression fails the test instead of wedging the run)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(database), "60"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def chroma_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChromaServer]:
    with ChromaServer(tmp_path_factory.mktemp("chroma-server") / "data") as server:
        yield server


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[ChromaServer]:
    """A server this test may stop and freeze without disturbing the others."""
    with ChromaServer(tmp_path / "server-data") as server:
        yield server


# -- conformance ---------------------------------------------------------------------------


class TestEmbeddedChromaConformance(SinkConformance):
    @pytest.fixture
    def sink_settings(self, tmp_path: Path) -> Settings:
        return chroma_settings(tmp_path)

    def stored_copies(self, settings: Settings, key: str) -> int:
        with open_client(settings) as client:
            found = client.get_collection(settings.chroma_collection).get(ids=[key], include=[])
            return len(found["ids"])

    def poison_content(self, settings: Settings) -> str:
        return INVISIBLE

    @contextlib.contextmanager
    def hung(self, settings: Settings) -> Iterator[None]:
        with open_client(settings):  # make sure chroma.sqlite3 exists before locking it
            pass
        with exclusive_lock(settings.chroma_path / "chroma.sqlite3"):
            yield


class TestServerChromaConformance(SinkConformance):
    server: ChromaServer

    @pytest.fixture
    def sink_settings(self, tmp_path: Path, chroma_server: ChromaServer) -> Settings:
        self.server = chroma_server
        return chroma_settings(tmp_path, chroma_url=chroma_server.url)

    def stored_copies(self, settings: Settings, key: str) -> int:
        with open_client(settings) as client:
            found = client.get_collection(settings.chroma_collection).get(ids=[key], include=[])
            return len(found["ids"])

    def poison_content(self, settings: Settings) -> str:
        return INVISIBLE

    @contextlib.contextmanager
    def hung(self, settings: Settings) -> Iterator[None]:
        self.server.freeze()
        try:
            yield
        finally:
            self.server.thaw()


# -- outages -------------------------------------------------------------------------------


def test_stopped_server_queues_then_delivers_each_record_once(
    tmp_path: Path, own_server: ChromaServer
) -> None:
    settings = chroma_settings(tmp_path, chroma_url=own_server.url)
    with Outbox.open(settings) as ob, Dispatcher(ob) as dispatcher:
        early = [ob.add(text) for text in TEXTS[:2]]
        assert dispatcher.drain(timeout=60).ok  # the sink is connected before the outage
        own_server.stop()
        receipts = [ob.add(f"memory {i} written while Chroma is down") for i in range(20)]
        assert {receipt.status for receipt in receipts} == {"queued"}
        report = dispatcher.drain(timeout=60)
        assert not report.ok
        for receipt in receipts:
            (row,) = ob.storage.deliveries_for([receipt.key])[receipt.key]
            assert (row.state, row.error_class, row.attempts) == ("pending", "transport_closed", 1)
        own_server.start()  # same folder, same port
        make_due(ob)
        assert dispatcher.drain(timeout=60).ok
    ids = stored_ids(settings)
    assert len(ids) == len(set(ids)) == 22
    assert set(ids) == {receipt.key for receipt in early + receipts}


def test_frozen_server_times_out_and_loses_nothing(
    tmp_path: Path, own_server: ChromaServer
) -> None:
    settings = chroma_settings(tmp_path, chroma_url=own_server.url, sink_timeout=2.0)
    with Outbox.open(settings) as ob:
        receipts = [ob.add(f"memory {i} written while Chroma hangs") for i in range(10)]
        own_server.freeze()
        try:
            started = time.monotonic()
            report = ob.drain(timeout=60)
            elapsed = time.monotonic() - started
        finally:
            own_server.thaw()
        assert not report.ok
        assert elapsed < 30, "a hung server must not hold the drain much past sink_timeout"
        for receipt in receipts:
            (row,) = ob.storage.deliveries_for([receipt.key])[receipt.key]
            assert (row.state, row.error_class) == ("pending", "timeout")
        make_due(ob)
        assert ob.drain(timeout=60).ok
    ids = stored_ids(settings)
    assert len(ids) == len(set(ids)) == 10
    assert set(ids) == {receipt.key for receipt in receipts}


def test_http_calls_are_bounded_by_the_sink_timeout(
    tmp_path: Path, chroma_server: ChromaServer
) -> None:
    """chromadb's own client would wait forever on a frozen server; ours gives up."""
    settings = chroma_settings(tmp_path, chroma_url=chroma_server.url, sink_timeout=1.0)
    connected = ChromaSink.from_settings(settings)
    fresh = ChromaSink.from_settings(settings)
    record = build_record("a memory for the timeout probe")
    assert connected.deliver([record]) == [Delivered(record.key)]
    errors: dict[str, BaseException] = {}

    def attempt(label: str, sink: ChromaSink) -> None:
        try:
            sink.deliver([record])
        except Exception as exc:
            errors[label] = exc

    chroma_server.freeze()
    try:
        threads = [
            threading.Thread(target=attempt, args=("connected", connected), daemon=True),
            threading.Thread(target=attempt, args=("fresh", fresh), daemon=True),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads), "a call hung past 30 s"
    finally:
        chroma_server.thaw()
    assert set(errors) == {"connected", "fresh"}
    for exc in errors.values():
        assert isinstance(exc, httpx.TimeoutException)
        assert classify(exc).reason == "timeout" and classify(exc).transient
    connected.close()
    fresh.close()


# -- recall and metadata -------------------------------------------------------------------

MEMORIES = {
    "allergy": "Bob is allergic to peanuts, so team lunch orders must avoid satay sauce.",
    "release": "Production deploys happen only on Tuesday mornings after the change review.",
    "storage": "The outbox keeps its queue in SQLite with write-ahead logging and full fsync.",
    "holiday": "Maria is on vacation in Portugal until the ninth of August.",
    "espresso": "The espresso machine on the third floor is broken; use the kitchen downstairs.",
    "secrets": "Rotate the staging database credentials every ninety days.",
    "style": "Alice prefers terse replies that show code before any explanation.",
    "gpu": "Training jobs must request the A100 queue; the T4 nodes lack enough memory.",
}
PARAPHRASES = {
    "Which colleague cannot eat nuts?": "allergy",
    "When may we ship a new version to prod?": "release",
    "Who is away on leave this summer?": "holiday",
    "How often should passwords be changed?": "secrets",
    "What kind of responses does she like from the assistant?": "style",
}


def test_paraphrase_finds_the_right_memory(tmp_path: Path) -> None:
    settings = chroma_settings(tmp_path)
    with Outbox.open(settings) as ob:
        keys = {
            name: ob.add(text, importance=8 if name in ("release", "secrets") else 4).key
            for name, text in MEMORIES.items()
        }
        assert ob.drain(timeout=120).ok
    sink = ChromaSink.from_settings(settings)
    try:
        assert sink.count() == len(MEMORIES)
        for query, expected in PARAPHRASES.items():
            hits = sink.search(query, n_results=3)
            assert hits.ids[0] == keys[expected], (query, hits.documents)
            assert hits.documents[0] == MEMORIES[expected]
            assert hits.distances[0] < hits.distances[1]
            assert hits.metadatas[0]["importance"] in (4, 8)
        important = sink.search("When may we ship a new version to prod?", 8, {"importance": 8})
        assert set(important.ids) == {keys["release"], keys["secrets"]}
        epoch = important.metadatas[0]["timestamp_epoch"]
        later = sink.search("deploys", 8, {"timestamp_epoch": {"$gt": epoch + 3600}})
        assert later.ids == []
    finally:
        sink.close()


def test_metadata_is_mapped_to_what_chroma_accepts(tmp_path: Path) -> None:
    record = build_record(
        "a memory with awkward metadata",
        importance=9,
        tags=["decision", "storage"],
        timestamp="2026-11-29T08:00:00Z",
        metadata={
            "session_id": "s-1",
            "turn": 3,
            "score": 0.5,
            "flag": True,
            "nested": {"a": 1, "b": {"c": "d"}, "gone": None},
            "none": None,
            "mixed": [1, "a"],
            "empty": [],
            "labels": ["x", "y"],
            "dicts": [{"a": 1}],
            "#hidden": 1,
            "$op": 2,
            "chroma:document": "z",
            "huge": 2**70,
            "timestamp": "spoofed",
        },
    )
    expected = {
        "session_id": "s-1",
        "turn": 3,
        "score": 0.5,
        "flag": True,
        "nested.a": 1,
        "nested.b.c": "d",
        "labels": ["x", "y"],
        "huge": str(2**70),
        "timestamp": "2026-11-29T08:00:00.000000Z",
        "timestamp_epoch": 1795939200.0,
        "importance": 9,
        "tags": ["decision", "storage"],
    }
    assert chroma_metadata(record) == expected
    settings = chroma_settings(tmp_path)
    sink = ChromaSink.from_settings(settings)
    try:
        assert sink.deliver([record, record]) == [Delivered(record.key)] * 2
        with open_client(settings) as client:
            got = client.get_collection(settings.chroma_collection).get(ids=[record.key])
        assert got["metadatas"][0] == expected
        assert got["documents"][0] == record.content
    finally:
        sink.close()


# -- per-record refusals, embedder checks, error classes -----------------------------------


class NaNOnRequest(HashingEmbedding):
    """A custom embedder that returns NaN for one kind of text (a faulty third-party model)."""

    @staticmethod
    def name() -> str:
        return "test_nan_on_request"

    def __call__(self, input: list[str]) -> list[Any]:
        vectors = super().__call__(input)
        return [
            np.full(384, np.nan) if "NAN-ME" in text else vector
            for text, vector in zip(input, vectors, strict=True)
        ]


def test_bad_vectors_are_rejected_per_record(tmp_path: Path) -> None:
    settings = chroma_settings(tmp_path, embedding="tests.sinks.test_chroma_sink:NaNOnRequest")
    records = [build_record(text) for text in ("fine one", "NAN-ME please", INVISIBLE, "fine two")]
    sink = ChromaSink.from_settings(settings)
    try:
        outcomes = sink.deliver(records)
        assert outcomes[0] == Delivered(records[0].key)
        assert isinstance(outcomes[1], Rejected) and "NaN" in str(outcomes[1])
        assert isinstance(outcomes[2], Rejected) and "visible" in str(outcomes[2])
        assert outcomes[3] == Delivered(records[3].key)
        assert all(not classify(o).transient for o in outcomes if isinstance(o, Rejected))
        assert sink.count() == 2
    finally:
        sink.close()
    other = ChromaSink.from_settings(replace(settings, embedding="hashing"))
    try:
        with pytest.raises(EmbeddingMismatch, match="test_nan_on_request") as caught:
            other.deliver([records[0]])
        assert classify(caught.value).transient, "a setting to fix, not a poison record"
    finally:
        other.close()


def test_real_chroma_errors_are_classified(tmp_path: Path, chroma_server: ChromaServer) -> None:
    settings = chroma_settings(tmp_path, chroma_url=chroma_server.url)
    sink = ChromaSink.from_settings(settings)
    record = build_record("a memory to classify errors with")
    try:
        assert sink.deliver([record]) == [Delivered(record.key)]
        with open_client(settings) as client:
            collection = client.get_collection(settings.chroma_collection)
            with pytest.raises(Exception) as wrong_size:
                collection.upsert(ids=["x"], embeddings=[[0.5] * 128], documents=["x"])
            client.delete_collection(settings.chroma_collection)
        failure = classify(wrong_size.value)
        assert type(wrong_size.value).__name__ == "InvalidArgumentError"
        assert (failure.reason, failure.transient) == ("rejected", False)
        with pytest.raises(Exception) as vanished:  # the collection went away underneath
            sink.deliver([record])
        assert type(vanished.value).__name__ == "NotFoundError"
        assert classify(vanished.value).transient
        assert sink.deliver([record]) == [Delivered(record.key)], "recreated on the next call"
    finally:
        sink.close()
    closed = f"http://127.0.0.1:{free_port()}"
    down = ChromaSink.from_settings(replace(settings, chroma_url=closed))
    with pytest.raises(httpx.ConnectError) as refused:
        down.deliver([record])
    assert (classify(refused.value).reason, classify(refused.value).transient) == (
        "transport_closed",
        True,
    )
    host, port, _ = parse_chroma_url(closed)
    with pytest.raises(ValueError, match="Could not connect") as construction:
        chromadb.HttpClient(host=host, port=port)
    assert classify(construction.value).reason == "transport_closed"
    disk_full = InternalError("Error in compaction: Failed to apply logs to the metadata segment")
    assert classify(disk_full).transient


def test_locked_embedded_store_times_out_without_freezing_us(tmp_path: Path) -> None:
    """chromadb keeps the GIL while it waits on a SQLite lock; the child process takes that
    wait, so this process keeps running and the call gives up in time."""
    settings = chroma_settings(tmp_path, sink_timeout=1.0)
    first, second = (build_record(f"memory {i} for the lock test") for i in range(2))
    sink = ChromaSink.from_settings(settings)
    try:
        assert sink.deliver([first]) == [Delivered(first.key)]
        ticks: list[float] = []
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(0.1):
                ticks.append(time.monotonic())

        ticker = threading.Thread(target=tick)
        with exclusive_lock(settings.chroma_path / "chroma.sqlite3"):
            ticker.start()
            started = time.monotonic()
            with pytest.raises(ChromaStalled) as stalled:
                sink.deliver([second])
            waited = time.monotonic() - started
            stop.set()
            ticker.join()
        assert 0.9 < waited < 10
        assert len(ticks) >= 5, "this process froze while Chroma waited"
        assert classify(stalled.value).reason == "timeout"
        assert sink.deliver([second]) == [Delivered(second.key)]  # the stale answer is dropped
        assert sink.count() == 2
    finally:
        sink.close()


def test_a_second_process_cannot_open_the_same_embedded_store(tmp_path: Path) -> None:
    """Two writers on one folder corrupt it (chroma.md); the second is told to wait."""
    settings = chroma_settings(tmp_path)
    lock_file = settings.chroma_path / OWNER_LOCK
    lock_file.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_FLOCK, str(lock_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    record = build_record("a memory that must wait for the folder")
    sink = ChromaSink.from_settings(settings)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreOwned, match=f"process {holder.pid}") as owned:
            sink.deliver([record])
        failure = classify(owned.value)
        assert (failure.reason, failure.transient) == ("db_busy", True)
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
        assert sink.deliver([record]) == [Delivered(record.key)]
    finally:
        sink.close()
        if holder.poll() is None:
            holder.kill()


def test_chroma_url_parsing() -> None:
    assert parse_chroma_url("http://127.0.0.1:8000") == ("127.0.0.1", 8000, False)
    assert parse_chroma_url("https://chroma.internal") == ("chroma.internal", 443, True)
    assert parse_chroma_url("http://[::1]:9000/") == ("::1", 9000, False)
    for bad in ("ftp://host:1", "http://host:1/prefix", "http://host:notaport", "host:8000"):
        with pytest.raises(ConfigError, match="OUTBOX_CHROMA_URL"):
            parse_chroma_url(bad)
