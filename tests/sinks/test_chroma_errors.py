"""The Chroma sink's failures against real Chroma: per-record refusals, an embedder that does
not fit the collection, a vanished collection, a server that is not there, a locked or owned
embedded store. Each comes out of the sink already classified, as the dispatcher sees it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import chromadb
import httpx
import numpy as np
import pytest
from chromadb.errors import DuplicateIDError, InternalError, InvalidArgumentError, NotFoundError

from outbox.core.errors import ConfigError
from outbox.core.record import build_record
from outbox.dispatch.classify import Failure, classify
from outbox.sinks.base import Delivered, Permanent, Rejected, Transient
from outbox.sinks.chroma import ChromaSink, EmbeddingMismatch
from outbox.sinks.chroma_client import chroma_failure, parse_chroma_url
from outbox.sinks.chroma_local import OWNER_LOCK, ChromaChildGone, ChromaStalled, StoreOwned
from outbox.sinks.embedding import HashingEmbedding
from tests.chroma_server import ChromaServer, free_port
from tests.sinks.chroma_support import INVISIBLE, chroma_settings, exclusive_lock, open_client

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


def classified(exc: BaseException) -> tuple[str, bool]:
    failure: Failure = classify(exc)
    return failure.reason, failure.transient


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


class ShortVectors(HashingEmbedding):
    """Claims to be the hashing embedder but gives 128 dimensions: Chroma refuses them."""

    def __call__(self, input: list[str]) -> list[Any]:
        return [vector[:128] for vector in super().__call__(input)]


def test_bad_vectors_are_rejected_per_record(tmp_path: Path) -> None:
    settings = chroma_settings(tmp_path, embedding="tests.sinks.test_chroma_errors:NaNOnRequest")
    records = [build_record(text) for text in ("fine one", "NAN-ME please", INVISIBLE, "fine two")]
    sink = ChromaSink.from_settings(settings)
    try:
        outcomes = sink.deliver(records)
        assert outcomes[0] == Delivered(records[0].key)
        assert isinstance(outcomes[1], Rejected) and "NaN" in str(outcomes[1])
        assert isinstance(outcomes[2], Rejected) and "visible" in str(outcomes[2])
        assert outcomes[3] == Delivered(records[3].key)
        refusals = [o for o in outcomes if isinstance(o, Rejected)]
        assert [classified(o) for o in refusals] == [("rejected", False)] * 2
        assert sink.count() == 2
    finally:
        sink.close()
    other = ChromaSink.from_settings(replace(settings, embedding="hashing"))
    try:
        with pytest.raises(EmbeddingMismatch, match="test_nan_on_request") as caught:
            other.deliver([records[0]])
        assert classified(caught.value) == ("unknown", True), "a setting to fix, not a poison"
    finally:
        other.close()


@pytest.mark.parametrize("mode", ["embedded", "server"])
def test_wrong_dimension_is_rejected_for_good(
    tmp_path: Path, mode: str, chroma_server: ChromaServer
) -> None:
    url = chroma_server.url if mode == "server" else None
    settings = chroma_settings(tmp_path, embedding="hashing", chroma_url=url)
    records = [build_record(f"memory {i} about vector sizes") for i in range(2)]
    first = ChromaSink.from_settings(settings)
    short = ChromaSink.from_settings(
        replace(settings, embedding="tests.sinks.test_chroma_errors:ShortVectors")
    )
    try:
        assert first.deliver(records[:1]) == [Delivered(records[0].key)]
        first.close()  # one embedded writer per folder at a time
        with pytest.raises(Permanent) as caught:
            short.deliver(records[1:])
        assert classified(caught.value) == ("rejected", False)
        assert "InvalidArgumentError" in str(caught.value)
    finally:
        short.close()


def test_a_vanished_collection_is_retried_and_recreated(
    tmp_path: Path, chroma_server: ChromaServer
) -> None:
    settings = chroma_settings(tmp_path, chroma_url=chroma_server.url)
    sink = ChromaSink.from_settings(settings)
    record = build_record("a memory whose collection goes away")
    try:
        assert sink.deliver([record]) == [Delivered(record.key)]
        with open_client(settings) as client:
            client.delete_collection(settings.chroma_collection)
        with pytest.raises(Transient) as vanished:
            sink.deliver([record])
        assert isinstance(vanished.value.__cause__, NotFoundError)
        assert classified(vanished.value) == ("unknown", True)
        assert sink.deliver([record]) == [Delivered(record.key)], "recreated on the next call"
    finally:
        sink.close()


def test_a_server_that_is_not_there_is_transport_closed(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    sink = ChromaSink.from_settings(chroma_settings(tmp_path, chroma_url=closed))
    try:
        with pytest.raises(Transient) as refused:
            sink.deliver([build_record("a memory for a server that is down")])
    finally:
        sink.close()
    assert isinstance(refused.value.__cause__, httpx.ConnectError)
    assert classified(refused.value) == ("transport_closed", True)


def test_chromas_own_exceptions_keep_their_classes(
    tmp_path: Path, chroma_server: ChromaServer
) -> None:
    """chromadb's exceptions the sink can meet (raised by chromadb where a test can make it
    happen), and the class each is given."""
    with pytest.raises(ValueError, match="Could not connect") as no_server:
        chromadb.HttpClient(host="127.0.0.1", port=free_port())  # its own first heartbeat
    settings = chroma_settings(tmp_path, chroma_url=chroma_server.url)
    with open_client(settings) as client:
        collection = client.get_or_create_collection(settings.chroma_collection)
        with pytest.raises(DuplicateIDError) as duplicate:
            collection.upsert(ids=["x", "x"], embeddings=[[0.5] * 4] * 2, documents=["x", "x"])
    expected: list[tuple[BaseException, tuple[str, bool]]] = [
        (no_server.value, ("transport_closed", True)),
        (duplicate.value, ("rejected", False)),
        (
            InvalidArgumentError("Collection expecting embedding with dimension of 384"),
            ("rejected", False),
        ),
        (
            InternalError("Error in compaction: Failed to apply logs to the metadata segment"),
            ("unknown", True),
        ),
        (
            InternalError("error returned from database: (code: 5) database is locked"),
            ("db_busy", True),
        ),
        (InternalError("attempt to write a readonly database"), ("readonly", True)),
        (InternalError("pool timed out while waiting for an open connection"), ("timeout", True)),
        (NotFoundError("Collection [x] does not exist"), ("unknown", True)),
        (httpx.ReadTimeout("timed out"), ("timeout", True)),
        (
            httpx.RemoteProtocolError("Server disconnected without sending a response."),
            ("transport_closed", True),
        ),
    ]
    for exc, want in expected:
        failure = chroma_failure(exc)
        assert failure is not None, exc
        assert classified(failure) == want, exc
    assert chroma_failure(RuntimeError("not chromadb's")) is None


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
        assert classified(stalled.value) == ("timeout", True)
        assert sink.deliver([second]) == [Delivered(second.key)]  # the stale answer is dropped
        assert sink.count() == 2
    finally:
        sink.close()


def _serving(folder: Path) -> list[int]:
    """The process ids of embedded Chroma children serving ``folder``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone meanwhile
            continue
        if b"outbox.sinks.chroma_local" in argv and str(folder).encode() in argv:
            found.append(int(entry.name))
    return found


def test_an_embedded_child_that_dies_mid_call_is_noticed_at_once_and_replaced(
    tmp_path: Path,
) -> None:
    """The child's end of the connection closes with it: the call waiting on it fails at
    once as retryable (not at its timeout), and the next call starts a new child."""
    settings = chroma_settings(tmp_path, sink_timeout=30.0)
    first, second = (build_record(f"memory {i} for the child that dies") for i in range(2))
    sink = ChromaSink.from_settings(settings)
    try:
        assert sink.deliver([first]) == [Delivered(first.key)]
        (child,) = _serving(settings.chroma_path)
        with exclusive_lock(settings.chroma_path / "chroma.sqlite3"):
            killer = threading.Timer(1.0, os.kill, (child, signal.SIGKILL))
            killer.start()
            started = time.monotonic()
            with pytest.raises(ChromaChildGone) as gone:
                sink.deliver([second])
            assert time.monotonic() - started < 15
            killer.join()
        assert classified(gone.value) == ("unknown", True)
        assert sink.deliver([second]) == [Delivered(second.key)]
        assert sink.count() == 2
        assert _serving(settings.chroma_path) not in ([], [child])
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
        assert classified(owned.value) == ("db_busy", True)
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
