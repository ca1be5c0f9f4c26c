"""Dispatcher processes (``python -m outbox run``) draining a backlog, timed from outside.

Throughput is read from the database, not from the dispatcher: ``settle`` stamps each
delivered row with its batch's time, and the rate is taken between the moments 10% and 90%
of the backlog was delivered. That window leaves out process start-up (imports, model load)
and the ragged end, which a long-running daemon does not pay per record; the wall time from
launch to the last delivery is reported beside it.
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from benchmarks.common import lag_summary, memories, open_outbox, outbox_environ
from outbox import Settings
from outbox.core.record import Record, build_record
from outbox.sinks.base import Sink
from outbox.store.sqlite_writes import sqlite_path

PREFILL_BATCH = 500


def prefill(settings: Settings, count: int, seed: int, size: int = 600) -> float:
    """Write ``count`` memories through ``add_many`` (mirrors included); returns seconds."""
    began = time.perf_counter()
    with open_outbox(settings) as outbox:
        for start in range(0, count, PREFILL_BATCH):
            texts = memories(min(PREFILL_BATCH, count - start), seed, size, start=start)
            outbox.add_many({"content": text, "tags": ["backlog"]} for text in texts)
    return time.perf_counter() - began


def delivered_times(settings: Settings, sink: str) -> list[float]:
    """``delivered_at`` of every delivered row of ``sink``, oldest first."""
    path = sqlite_path(settings.db_url)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        rows = conn.execute(
            "SELECT delivered_at FROM deliveries WHERE sink = ? AND state = 'delivered'"
            " ORDER BY delivered_at",
            (sink,),
        ).fetchall()
    finally:
        conn.close()
    return [float(row[0]) for row in rows]


def counts(settings: Settings, sink: str) -> dict[str, int]:
    path = sqlite_path(settings.db_url)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        rows = conn.execute(
            "SELECT state, count(*) FROM deliveries WHERE sink = ? GROUP BY state", (sink,)
        ).fetchall()
    finally:
        conn.close()
    return {str(state): int(count) for state, count in rows}


def window_rate(times: Sequence[float], low: float = 0.1, high: float = 0.9) -> float:
    """Items per second between the ``low`` and ``high`` fractions of ``times`` (sorted)."""
    if len(times) < 10:
        return 0.0
    first = times[int(low * (len(times) - 1))]
    last = times[int(high * (len(times) - 1))]
    inside = sum(1 for moment in times if first < moment <= last)
    return inside / (last - first) if last > first else 0.0


def rss_kib(pid: int, field: str = "VmRSS") -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Dispatchers:
    """``count`` ``python -m outbox run`` processes on one outbox; RSS sampled while alive."""

    def __init__(
        self, settings: Settings, count: int, log_dir: Path, extra_env: dict[str, str] | None = None
    ) -> None:
        self.settings = settings
        self.count = count
        self.log_dir = log_dir
        self.env = outbox_environ(settings, **(extra_env or {}))
        self.processes: list[subprocess.Popen[bytes]] = []
        self.rss_samples: dict[int, list[tuple[float, int]]] = {}
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self.started_at = 0.0
        self.exit_codes: list[int] = []
        self.peak_rss_kib: dict[int, int] = {}

    def start(self) -> Dispatchers:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.time()
        for number in range(self.count):
            with (self.log_dir / f"dispatcher-{number}.log").open("ab") as log:
                self.processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "outbox", "run"],
                        env=self.env,
                        cwd=self.log_dir,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for process in self.processes:
                value = rss_kib(process.pid)
                if value is not None:
                    self.rss_samples.setdefault(process.pid, []).append((now, value))
            self._stop.wait(0.5)

    def check_alive(self) -> None:
        for process in self.processes:
            if process.poll() is not None:
                raise RuntimeError(
                    f"dispatcher {process.pid} exited with {process.returncode}; see {self.log_dir}"
                )

    def stop(self) -> None:
        """SIGTERM (a clean stop), then read each one's peak RSS before it is reaped."""
        for process in self.processes:
            if process.poll() is None:
                peak = rss_kib(process.pid, "VmHWM")
                if peak is not None:
                    self.peak_rss_kib[process.pid] = peak
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            self.exit_codes.append(process.returncode)
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()

    def __enter__(self) -> Dispatchers:
        return self.start()

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self.stop()


def wait_until(
    predicate: Callable[[], bool],
    timeout: float,
    what: str,
    poll: float = 0.2,
    alive: Callable[[], None] | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout:g}s")
        time.sleep(poll)


def drain_run(
    settings: Settings,
    sink: str,
    records: int,
    processes: int,
    log_dir: Path,
    *,
    extra_env: dict[str, str] | None = None,
    timeout: float = 1200.0,
) -> dict[str, Any]:
    """Launch ``processes`` dispatchers on a prefilled outbox and time the drain."""
    with Dispatchers(settings, processes, log_dir, extra_env) as running:
        wait_until(
            lambda: counts(settings, sink).get("delivered", 0) >= records,
            timeout,
            f"{records} deliveries to {sink}",
            alive=running.check_alive,
        )
    left = counts(settings, sink)
    times = delivered_times(settings, sink)
    return {
        "sink": sink,
        "processes": processes,
        "records": records,
        "per_s": window_rate(times),
        "wall_s": times[-1] - running.started_at,
        "exit_codes": running.exit_codes,
        "not_delivered": sum(n for state, n in left.items() if state != "delivered"),
        "peak_rss_mib": [round(kib / 1024, 1) for kib in running.peak_rss_kib.values()],
    }


class _Writer:
    """Paced ``add`` calls that count what did not come back ``queued``, and how long each
    waited for the mirror lock (which the dispatcher takes to mirror delivery outcomes)."""

    def __init__(self, settings: Settings, seed: int) -> None:
        self.outbox = open_outbox(settings)
        self.texts = memories(500, seed)
        self.errors = 0
        self.fallbacks = 0
        self.samples: list[float] = []
        self.lock_waits: list[float] = []
        lock = self.outbox.mirrors.lock
        hold = lock.hold

        @contextlib.contextmanager
        def timed_hold(deadline: float | None = None, **options: Any) -> Iterator[None]:
            tick = time.perf_counter()
            with hold(deadline, **options):
                self.lock_waits.append(time.perf_counter() - tick)
                yield

        lock.hold = timed_hold  # type: ignore[method-assign]

    def add(self, number: int) -> None:
        tick = time.perf_counter()
        try:
            receipt = self.outbox.add(
                f"turn {number}: {self.texts[number % len(self.texts)]}", tags=["turn"]
            )
        except Exception:
            self.errors += 1
        else:
            if receipt.status != "queued":
                self.fallbacks += 1
        self.samples.append(time.perf_counter() - tick)

    def take(self) -> tuple[list[float], list[float]]:
        samples, self.samples = self.samples, []
        waits, self.lock_waits = self.lock_waits, []
        return samples, waits


def backfill_run(
    settings: Settings,
    records: int,
    idle_calls: int,
    pace: float,
    log_dir: Path,
    *,
    timeout: float = 1800.0,
) -> dict[str, Any]:
    """``add`` latency idle, then while one dispatcher drains ``records`` into the sink.

    A write every ``pace`` seconds, as an agent saving each turn does; the busy phase runs
    from the dispatcher's launch until the whole backlog is delivered.
    """
    sink = settings.sinks[0]
    prefill_s = prefill(settings, records, seed=21)
    writer = _Writer(settings, seed=22)
    for number in range(20):  # warm-up, untimed
        writer.add(-1 - number)
    writer.take()
    writer.outbox.wait_mirrored()
    lags_before = len(writer.outbox.mirrors.writer.lags())
    number = 0
    while number < idle_calls:
        writer.add(number)
        number += 1
        time.sleep(pace)
    idle, idle_waits = writer.take()
    idle_errors, idle_fallbacks = writer.errors, writer.fallbacks
    writer.outbox.wait_mirrored()
    lags_idle = len(writer.outbox.mirrors.writer.lags())
    with Dispatchers(settings, 1, log_dir) as running:
        deadline = time.monotonic() + timeout
        while True:
            writer.add(number)
            number += 1
            if number % 25 == 0:
                running.check_alive()
                if counts(settings, sink).get("delivered", 0) >= records:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the backfill of {records} records did not finish")
            time.sleep(pace)
        busy, busy_waits = writer.take()
    writer.outbox.wait_mirrored()
    lags = writer.outbox.mirrors.writer.lags()
    writer.outbox.close()
    times = delivered_times(settings, sink)
    return {
        "records": records,
        "prefill_s": prefill_s,
        "pace_ms": pace * 1000,
        "idle_samples": idle,
        "busy_samples": busy,
        "idle_lock_waits": idle_waits,
        "busy_lock_waits": busy_waits,
        "idle_mirror_lag": lag_summary(lags[lags_before:lags_idle]),
        "busy_mirror_lag": lag_summary(lags[lags_idle:]),
        "idle_errors": idle_errors,
        "idle_fallbacks": idle_fallbacks,
        "errors": writer.errors - idle_errors,
        "fallbacks": writer.fallbacks - idle_fallbacks,
        "drain_per_s": window_rate(times[:records]),
        "drain_wall_s": times[min(records, len(times)) - 1] - running.started_at,
        "exit_codes": running.exit_codes,
    }


def raw_chromadb(path: Path, records: int, batch: int = 64) -> dict[str, Any]:
    """chromadb called directly, no outbox and no sink: embed ``batch`` texts with the same
    model, ``upsert`` them with the same ids, documents and metadata, repeat."""
    import chromadb

    from outbox.sinks.chroma import chroma_metadata
    from outbox.sinks.embedding import load_embedding

    embedder = load_embedding("minilm")
    client = chromadb.PersistentClient(path=str(path))
    collection = client.get_or_create_collection(
        "raw", embedding_function=None, configuration={"hnsw": {"space": "cosine"}}
    )
    prepared = [build_record(text, tags=["backlog"]) for text in memories(records, seed=21)]

    def upsert(chunk: Sequence[Any]) -> None:
        collection.upsert(
            ids=[record.key for record in chunk],
            embeddings=[list(map(float, v)) for v in embedder([r.content for r in chunk])],
            documents=[record.content for record in chunk],
            metadatas=[chroma_metadata(record) for record in chunk],  # type: ignore[misc]
        )

    upsert(prepared[:1])  # open the collection and warm the model outside the clock
    done: list[float] = []
    began = time.time()
    for start in range(0, records, batch):
        chunk = prepared[start : start + batch]
        upsert(chunk)
        done.extend([time.time()] * len(chunk))
    elapsed = time.time() - began
    if collection.count() != records:
        raise RuntimeError(f"raw upsert left {collection.count()} of {records} documents")
    client.close()
    return {"records": records, "per_s": window_rate(done), "wall_s": elapsed}


def raw_store_memory(db: Path, records: int) -> dict[str, Any]:
    """BrainLayer's ``store_memory`` called directly with one writer held throughout: what
    BrainLayer itself costs per record, without the outbox or the sink's open per batch."""
    from brainlayer.runtime_store import open_writer_store
    from brainlayer.store import store_memory
    from brainlayer.vector_store import VectorStore

    from outbox.sinks.brainlayer import chunk_id_for

    VectorStore(db).close()
    prepared = [build_record(text, tags=["backlog"]) for text in memories(records, seed=21)]
    store = open_writer_store(db)
    done: list[float] = []
    began = time.time()
    try:
        for record in prepared:
            store_memory(
                store,
                None,
                content=record.content,
                memory_type="note",
                tags=list(record.tags),
                importance=record.importance,
                chunk_id=chunk_id_for(record.key),
                created_at=record.timestamp,
            )
            done.append(time.time())
    finally:
        store.close()
    return {"records": records, "per_s": window_rate(done), "wall_s": time.time() - began}


class _TimedSink:
    """A sink wrapper that adds up the time spent inside ``deliver``; every other attribute
    (``name``, ``semantic``, ``close``) is the wrapped sink's."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self.inside = 0.0
        self.calls = 0

    def deliver(self, batch: Sequence[Record]) -> list[Any]:
        tick = time.perf_counter()
        try:
            return self._sink.deliver(batch)
        finally:
            self.inside += time.perf_counter() - tick
            self.calls += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)


def dispatcher_share(settings: Settings, sink: Sink, records: int) -> dict[str, Any]:
    """The dispatcher's own cost beside its sink's, measured in one drain, in process.

    The sink is warmed first (connection, model) with a record of its own; then a
    ``Dispatcher`` drains ``records`` prefilled memories. Everything the drain spends outside
    ``sink.deliver`` (claim, reading the records, settle, mirroring each outcome, thread
    hand-offs) is the dispatcher's overhead; the time inside is the sink's own embed and
    upsert. Both are taken from the same batches, so a busy neighbour slows both alike.
    """

    prefill(settings, records, seed=21)
    sink.deliver([build_record("warm-up: connect and load the model before the clock")])
    timed = _TimedSink(sink)
    with open_outbox(settings) as outbox:
        name = settings.sinks[0]
        with outbox.dispatcher(sink_objects={name: timed}) as dispatcher:  # type: ignore[dict-item]
            tick = time.perf_counter()
            report = dispatcher.drain()
            wall = time.perf_counter() - tick
    if report.delivered != records:
        raise RuntimeError(f"the drain delivered {report.delivered} of {records}")
    outside = wall - timed.inside
    return {
        "records": records,
        "batches": timed.calls,
        "wall_s": wall,
        "sink_s": timed.inside,
        "per_s": records / wall,
        "dispatcher_ms_per_record": outside / records * 1000,
        "sink_ms_per_record": timed.inside / records * 1000,
        "overhead": outside / timed.inside if timed.inside else float("inf"),
    }
