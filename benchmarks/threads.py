"""Writers on several threads of one process: throughput when callers overlap.

An MCP server runs each tool call on a worker thread, and a multi-threaded application
shares one ``Outbox``, so several ``add`` calls are often in flight at once. The outbox
then commits them in one transaction (group commit). Each contender here runs ``threads``
threads that write back to back for ``seconds``, in alternating rounds, at the same
``synchronous`` level:

- **floor**: one bare ``sqlite3`` connection behind a lock, on the outbox schema, the rows
  one ``add`` makes, one ``BEGIN IMMEDIATE`` ... ``COMMIT`` per record: what the threads
  get without group commit (each commit pays its own fsync), with no library around it;
- **add**: one shared ``Outbox``, both mirrors;
- **persist-queue**: one shared ``SQLiteAckQueue(multithreading=True)``, ``put``;
- **litequeue**: one ``LiteQueue`` per thread on one file (it has no lock of its own), ``put``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import litequeue
import persistqueue

from benchmarks.common import bench_settings, memories, open_outbox, percentile, quiet_gc
from benchmarks.writepath import TAGS, floor_writer, payload

# A writer factory: given the thread's number, the call that thread makes.
Factory = Callable[[int], Callable[[int], object]]


def _run(factory: Factory, threads: int, seconds: float, start: int) -> dict[str, Any]:
    """``threads`` threads call back to back until ``seconds`` pass; latencies in µs."""
    calls = [factory(number) for number in range(threads)]
    samples: list[list[float]] = [[] for _ in range(threads)]
    barrier = threading.Barrier(threads + 1)
    stop_at = [0.0]

    def work(number: int) -> None:
        call, mine = calls[number], samples[number]
        item = start + number * 10_000_000
        barrier.wait()
        while True:
            tick = time.perf_counter()
            if tick >= stop_at[0]:
                return
            call(item)
            mine.append((time.perf_counter() - tick) * 1e6)
            item += 1

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    with quiet_gc():
        stop_at[0] = time.perf_counter() + seconds
        begin = time.perf_counter()
        barrier.wait()
        for worker in workers:
            worker.join()
        wall = time.perf_counter() - begin
    flat = [value for mine in samples for value in mine]
    return {"writes": len(flat), "wall": wall, "latencies": flat}


def contenders(folder: Path, synchronous: str, threads: int) -> dict[str, Factory]:
    """Fresh stores for one thread count (so every count starts from the same size)."""
    texts = memories(500, seed=17)
    base = folder / f"{threads}-threads"
    outbox = open_outbox(bench_settings(base / "add", synchronous=synchronous))
    pq = persistqueue.SQLiteAckQueue(
        str(base / "persist-queue"), auto_commit=True, multithreading=True
    )
    for conn in {id(pq._putter): pq._putter, id(pq._getter): pq._getter}.values():
        conn.execute(f"PRAGMA synchronous={synchronous}")
    floor = floor_writer(base / "floor", synchronous, texts, 1)
    floor_lock = threading.Lock()

    def floor_call(n: int) -> None:
        with floor_lock:
            floor(n)

    def add_factory(_thread: int) -> Callable[[int], object]:
        return lambda n: outbox.add(f"{n} {texts[n % len(texts)]}", tags=TAGS, importance=7)

    def floor_factory(_thread: int) -> Callable[[int], object]:
        return floor_call

    def pq_factory(_thread: int) -> Callable[[int], object]:
        return lambda n: pq.put(payload(f"{n} {texts[n % len(texts)]}"))

    def lq_factory(_thread: int) -> Callable[[int], object]:
        queue = litequeue.LiteQueue(str(base / "litequeue.db"), timeout=30)
        queue.conn.execute(f"PRAGMA synchronous={synchronous}")

        def put(n: int) -> object:
            return queue.put(json.dumps(payload(f"{n} {texts[n % len(texts)]}")))

        return put

    return {
        "floor": floor_factory,
        "add": add_factory,
        "persist-queue put": pq_factory,
        "litequeue put": lq_factory,
    }


def run(
    folder: Path, synchronous: str, thread_counts: tuple[int, ...], seconds: float, rounds: int
) -> dict[str, Any]:
    """Writes per second and latency per contender and thread count."""
    results: dict[str, Any] = {}
    for threads in thread_counts:
        factories = contenders(folder, synchronous, threads)
        totals: dict[str, dict[str, Any]] = {
            name: {"writes": 0, "wall": 0.0, "latencies": []} for name in factories
        }
        for factory in factories.values():  # warm-up: connections, caches, imports
            _run(factory, threads, 0.2, start=-50_000_000)
        for round_number in range(rounds):
            for name, factory in factories.items():
                outcome = _run(factory, threads, seconds / rounds, start=round_number * 1_000_000)
                total = totals[name]
                total["writes"] += outcome["writes"]
                total["wall"] += outcome["wall"]
                total["latencies"].extend(outcome["latencies"])
        results[str(threads)] = {
            name: {
                "writes": total["writes"],
                "per_s": total["writes"] / total["wall"],
                "median_us": percentile(total["latencies"], 0.5),
                "p99_us": percentile(total["latencies"], 0.99),
            }
            for name, total in totals.items()
        }
    return results
