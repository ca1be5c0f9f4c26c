"""The Chroma sink against real Chroma: embedded (PersistentClient), a ``chroma run`` server of
the test's own, and the shared server the library starts by itself (the default).

Both pass the shared conformance suite; the tests below add outages (server stopped, server
frozen), semantic recall by paraphrase and metadata mapping. ``test_chroma_errors.py`` has
per-record refusals and what real Chroma's failures are classified as.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox import Outbox, Settings
from outbox.core.record import build_record
from outbox.dispatch.classify import classify
from outbox.sinks.base import Delivered, Transient
from outbox.sinks.chroma import ChromaSink
from outbox.sinks.chroma_documents import chroma_metadata
from outbox.sinks.chroma_service import SharedServer
from outbox.testing.conformance import TEXTS, SinkConformance, SinkHarness, make_due
from tests.chroma_server import ChromaServer, stop_shared_server
from tests.sinks.chroma_support import (
    INVISIBLE,
    chroma_settings,
    locked_store,
    open_client,
    stored_copies,
    stored_ids,
)

# -- conformance ---------------------------------------------------------------------------


class TestEmbeddedChromaConformance(SinkConformance):
    @pytest.fixture
    def sink_harness(self, tmp_path: Path) -> SinkHarness:
        settings = chroma_settings(tmp_path)
        return SinkHarness(
            settings,
            stored_copies=partial(stored_copies, settings),
            poison=INVISIBLE,
            hang=partial(locked_store, settings),
        )


@contextlib.contextmanager
def frozen_shared_server(settings: Settings) -> Iterator[None]:
    """The shared server of the settings' folder, running but answering nothing, for a block."""
    state = SharedServer(settings.chroma_path, settings.chroma_idle).endpoint()
    os.kill(state.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(state.pid, signal.SIGCONT)


class TestSharedChromaConformance(SinkConformance):
    @pytest.fixture
    def sink_harness(self, tmp_path: Path) -> Iterator[SinkHarness]:
        settings = chroma_settings(tmp_path, chroma_mode="server")
        try:
            yield SinkHarness(
                settings,
                stored_copies=partial(stored_copies, settings),
                poison=INVISIBLE,
                hang=partial(frozen_shared_server, settings),
            )
        finally:
            stop_shared_server(settings.chroma_path)


class TestServerChromaConformance(SinkConformance):
    @pytest.fixture
    def sink_harness(self, tmp_path: Path, chroma_server: ChromaServer) -> SinkHarness:
        settings = chroma_settings(tmp_path, chroma_url=chroma_server.url)
        return SinkHarness(
            settings,
            stored_copies=partial(stored_copies, settings),
            poison=INVISIBLE,
            hang=chroma_server.frozen,
        )


# -- outages -------------------------------------------------------------------------------


def test_stopped_server_queues_then_delivers_each_record_once(
    tmp_path: Path, own_server: ChromaServer
) -> None:
    settings = chroma_settings(tmp_path, chroma_url=own_server.url)
    with Outbox.open(settings) as ob, ob.dispatcher() as dispatcher:
        early = [ob.add(text) for text in TEXTS[:2]]
        assert dispatcher.drain(timeout=60).ok  # the sink is connected before the outage
        own_server.stop()
        receipts = [ob.add(f"memory {i} written while Chroma is down") for i in range(20)]
        assert {receipt.status for receipt in receipts} == {"queued"}
        report = dispatcher.drain(timeout=60)
        assert not report.ok
        for receipt in receipts:
            (row,) = ob.deliveries_of([receipt.key])[receipt.key]
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
        with own_server.frozen():
            started = time.monotonic()
            report = ob.drain(timeout=60)
            elapsed = time.monotonic() - started
        assert not report.ok
        assert elapsed < 30, "a hung server must not hold the drain much past sink_timeout"
        for receipt in receipts:
            (row,) = ob.deliveries_of([receipt.key])[receipt.key]
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

    with chroma_server.frozen():
        threads = [
            threading.Thread(target=attempt, args=("connected", connected), daemon=True),
            threading.Thread(target=attempt, args=("fresh", fresh), daemon=True),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads), "a call hung past 30 s"
    assert set(errors) == {"connected", "fresh"}
    for exc in errors.values():
        assert isinstance(exc, Transient) and exc.reason == "timeout"
        assert isinstance(exc.__cause__, httpx.TimeoutException)
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
            assert sink.nearest(query, 3) == list(zip(hits.ids, hits.distances, strict=True))
        important = sink.search("When may we ship a new version to prod?", 8, {"importance": 8})
        assert set(important.ids) == {keys["release"], keys["secrets"]}
        assert sink.nearest("When may we ship a new version to prod?", 8, {"importance": 8}) == [
            *zip(important.ids, important.distances, strict=True)
        ]
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
        "tag:decision": True,  # one key per tag: what recall's tag filter asks Chroma for
        "tag:storage": True,
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


def test_a_batch_is_upserted_in_pieces_while_it_embeds(tmp_path: Path) -> None:
    """More records than one upsert piece, of many lengths, with an invisible one and a
    repeated key among them: every visible record is delivered once, each under the vector
    the model gives it alone (its own text is its nearest neighbour)."""
    from outbox.sinks import chroma

    words = ["memory", "outbox", "ledger", "river", "lantern", "orchard", "violin", "granite"]
    texts = [" ".join(words[i % 8 :] + words[: i % 8]) * (1 + i % 5) for i in range(3 * 16 + 5)]
    records = [build_record(f"note {i}: {text}") for i, text in enumerate(texts)]
    batch = [*records, build_record(INVISIBLE), records[0]]
    assert len(records) > 3 * chroma._UPSERT_PIECE
    sink = ChromaSink.from_settings(chroma_settings(tmp_path))
    try:
        outcomes = sink.deliver(batch)
        assert [type(o) for o in outcomes[: len(records)]] == [Delivered] * len(records)
        assert not isinstance(outcomes[len(records)], Delivered)
        assert sink.count() == len(records)
        for record in records[::7]:
            hits = sink.search(record.content, n_results=1)
            assert hits.ids == [record.key]
            assert hits.distances[0] < 1e-3
    finally:
        sink.close()


def test_a_failed_piece_fails_the_whole_batch(tmp_path: Path) -> None:
    """One piece's upsert fails (injected): the call raises instead of reporting the rest
    delivered, so the dispatcher retries the whole batch (upserts repeat safely)."""
    records = [build_record(f"note {i}: {'words ' * (1 + i % 9)}") for i in range(40)]
    sink = ChromaSink.from_settings(chroma_settings(tmp_path))
    written = sink._upsert
    calls: list[int] = []

    def second_fails(chunk: list[Any]) -> None:
        calls.append(len(chunk))
        if len(calls) == 2:
            raise OSError("injected: the store's disk went away")
        written(chunk)

    sink._upsert = second_fails  # type: ignore[method-assign]
    try:
        with pytest.raises(OSError, match="injected"):
            sink.deliver(records)
        assert len(calls) >= 2
    finally:
        sink.close()
