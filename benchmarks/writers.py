"""Bulk writes the way a user would do them: ``add_many``, and several writer processes.

Two questions (issue 24, point 3), each answered in alternating rounds in one run:

- **batches**: ``Outbox.add_many`` with 100 and with 1,000 records per call, records per
  second, beside persist-queue's ``put`` and litequeue's ``put`` from one writer (one row per
  call, its own commit) on the same disk. An ``add_many`` round's time runs until its last
  record's JSONL line and markdown file are written, so no round leaves its mirror writes
  to the next contender;
- **processes**: 1, 2 and 4 writer processes (real OS processes, ``python -c``), each with
  its own handle on one store as a user would open it, calling ``Outbox.add`` (or the
  queue's ``put``) back to back for the same window: the outbox on one store, persist-queue
  ``SQLiteAckQueue`` on one folder and litequeue ``LiteQueue`` on one file. Each process
  also reports the CPU time it spent (user + system), so the figures say whether the CPU
  or the disk bounds them.

All at ``synchronous=FULL`` (set on the queues' own connections), so everyone fsyncs alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    bench_settings,
    memories,
    open_outbox,
    percentile,
    quiet_gc,
    time_calls,
)

BATCH_SIZES = (100, 1000)
SYNCHRONOUS = "FULL"
KINDS = ("add", "persist-queue put", "litequeue put")
_TAGS = ["decision", "storage"]
_REPO = Path(__file__).resolve().parent.parent
_WORKER = "from benchmarks.writers import worker; worker()"
# A process that has not reported this long after its window ended is stuck: the run fails.
_REPORT_GRACE_S = 120.0


def _payload(content: str) -> dict[str, Any]:
    from benchmarks.writepath import payload

    return payload(content)


# -- batches, in one process --------------------------------------------------------------


def batches(folder: Path, records: int, rounds: int) -> dict[str, Any]:
    """Records per second of ``add_many`` per batch size beside one writer's ``put``s.

    Each contender writes ``records`` records in all, split over ``rounds`` alternating
    rounds; a batch contender makes ``records / size`` calls.
    """
    import litequeue
    import persistqueue

    texts = memories(500, seed=23)
    outboxes = {
        size: open_outbox(bench_settings(folder / f"add_many-{size}", synchronous=SYNCHRONOUS))
        for size in BATCH_SIZES
    }
    pq = persistqueue.SQLiteAckQueue(str(folder / "persist-queue"), auto_commit=True)
    pq._putter.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
    lq = litequeue.LiteQueue(str(folder / "litequeue.db"), timeout=30)
    lq.conn.execute(f"PRAGMA synchronous={SYNCHRONOUS}")

    def many(size: int) -> Callable[[int], object]:
        outbox = outboxes[size]

        def call(number: int) -> object:
            return outbox.add_many(
                {"content": f"{number}-{item} {texts[(number + item) % len(texts)]}", "tags": _TAGS}
                for item in range(size)
            )

        return call

    def pq_put(number: int) -> object:
        return pq.put(_payload(f"{number} {texts[number % len(texts)]}"))

    def lq_put(number: int) -> object:
        return lq.put(json.dumps(_payload(f"{number} {texts[number % len(texts)]}")))

    per_call = {f"add_many {size}": size for size in BATCH_SIZES}
    per_call |= {"persist-queue put": 1, "litequeue put": 1}
    calls: dict[str, Callable[[int], object]] = {
        f"add_many {size}": many(size) for size in BATCH_SIZES
    }
    calls |= {"persist-queue put": pq_put, "litequeue put": lq_put}
    mirrored = {f"add_many {size}": outboxes[size] for size in BATCH_SIZES}
    for call in calls.values():
        call(-1)  # warm-up: connections, caches, lazy imports
    timed: dict[str, tuple[list[float], float]] = {name: ([], 0.0) for name in calls}
    for round_number in range(rounds):
        for name, call in calls.items():
            size = per_call[name]
            count = max(1, records // rounds // size)
            with quiet_gc():
                samples, wall = time_calls(_numbered(call, size), count, start=round_number * count)
                if name in mirrored:  # its mirrors, written on its mirror writer's thread
                    tick = time.perf_counter()
                    mirrored[name].wait_mirrored()
                    wall += time.perf_counter() - tick
            kept, total = timed[name]
            timed[name] = (kept + samples, total + wall)
    for outbox in outboxes.values():
        outbox.close()
    pq.close()
    lq.conn.close()
    return {name: _rate(samples, wall, per_call[name]) for name, (samples, wall) in timed.items()}


def _numbered(call: Callable[[int], object], size: int) -> Callable[[int], object]:
    """``call`` numbered so that a batch's records never share a number with another's."""
    return lambda number: call(number * size)


def _rate(samples: list[float], wall: float, size: int) -> dict[str, Any]:
    """Records per second over the rounds' wall time, and what one call took."""
    ordered = sorted(samples)
    return {
        "records": len(samples) * size,
        "calls": len(samples),
        "per_s": len(samples) * size / wall,
        "call_median_ms": ordered[len(ordered) // 2] * 1000,
        "call_max_ms": ordered[-1] * 1000,
    }


# -- writer processes on one store --------------------------------------------------------


def _open(kind: str, target: Path) -> tuple[Callable[[str], object], Callable[[], None]]:
    """What one writer process calls per record, and what closes its handle."""
    if kind == "add":
        outbox = open_outbox(bench_settings(target, synchronous=SYNCHRONOUS))
        return (lambda text: outbox.add(text, tags=_TAGS, importance=7)), outbox.close
    if kind == "persist-queue put":
        import persistqueue

        pq = persistqueue.SQLiteAckQueue(str(target / "persist-queue"), auto_commit=True)
        pq._putter.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
        return (lambda text: pq.put(_payload(text))), pq.close
    import litequeue

    lq = litequeue.LiteQueue(str(target / "litequeue.db"), timeout=30)
    lq.conn.execute(f"PRAGMA synchronous={SYNCHRONOUS}")
    return (lambda text: lq.put(json.dumps(_payload(text)))), lq.conn.close


def worker() -> None:
    """One writer process (``python -c``; argv: kind, store folder, label): open its own
    handle, warm up, say ``ready``; then for each window length read on stdin, write back to
    back for that long and print writes, wall and CPU time (user + system) as JSON; close
    its handle at the end of stdin."""
    kind, target, label = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    call, close = _open(kind, target)
    texts = memories(200, seed=sum(label.encode()))
    for number in range(5):  # warm-up, outside the windows
        call(f"{label} warm {number} {texts[number]}")
    print("ready", flush=True)
    writes = 0
    for line in sys.stdin:
        seconds = float(line)
        before = os.times()
        begin = time.perf_counter()
        latencies: list[float] = []
        while (tick := time.perf_counter()) - begin < seconds:
            call(f"{label} {writes} {texts[writes % len(texts)]}")
            latencies.append(round((time.perf_counter() - tick) * 1000, 3))
            writes += 1
        wall = time.perf_counter() - begin
        after = os.times()
        cpu = (after.user - before.user) + (after.system - before.system)
        print(json.dumps({"wall": wall, "cpu_s": cpu, "latencies_ms": latencies}), flush=True)
    close()


class _Writers:
    """``count`` writer processes with their own handles on one store, kept between windows
    (a user's writers are long-lived), let go together for each window.

    ``library`` is a folder holding another version's ``outbox`` package, which the
    processes then import instead of this one (a before/after comparison in one run).
    """

    def __init__(
        self, name: str, kind: str, target: Path, count: int, library: Path | None
    ) -> None:
        path = [str(library)] if library is not None else []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, str(_REPO)]))
        self.name = name
        target.mkdir(parents=True, exist_ok=True)
        self.processes: list[subprocess.Popen[str]] = []
        for number in range(count):  # one at a time: the first one makes the store
            process = subprocess.Popen(
                [sys.executable, "-c", _WORKER, kind, str(target), f"{target.name}-{number}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=target,  # not the repository: ``library``'s outbox comes first on the path
                env=env,
                text=True,
            )
            self.processes.append(process)
            if self._line(process) != "ready":
                self.stop()
                raise RuntimeError(f"a {kind} writer process did not start")

    @staticmethod
    def _line(process: subprocess.Popen[str]) -> str:
        assert process.stdout is not None
        return process.stdout.readline().strip()

    def window(self, seconds: float) -> dict[str, Any]:
        """Every process writes for ``seconds``; their summed writes and CPU, longest wall,
        and every call's latency."""
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write(f"{seconds}\n")
            process.stdin.flush()
        outcomes = [json.loads(self._line(process)) for process in self.processes]
        return {
            "writes": sum(len(outcome["latencies_ms"]) for outcome in outcomes),
            "wall": max(outcome["wall"] for outcome in outcomes),
            "cpu_s": sum(outcome["cpu_s"] for outcome in outcomes),
            "latencies_ms": [value for outcome in outcomes for value in outcome["latencies_ms"]],
        }

    def stop(self) -> None:
        """Close stdin (each process closes its handle and exits); kill a stuck one."""
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in self.processes:
            try:
                process.wait(timeout=_REPORT_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def processes(
    folder: Path,
    counts: tuple[int, ...],
    seconds: float,
    rounds: int,
    baselines: dict[str, Path] | None = None,
) -> dict[str, Any]:
    """Records per second per contender and process count, with the scaling over one
    process; counts and contenders alternate within each round. ``baselines`` adds an
    ``add`` contender per named folder holding another version's ``outbox`` package."""
    contenders: dict[str, tuple[str, Path | None]] = {kind: (kind, None) for kind in KINDS}
    for name, library in (baselines or {}).items():
        contenders[f"add ({name})"] = ("add", library)
    totals: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in contenders}
    stores = {name: f"store-{number}" for number, name in enumerate(contenders)}
    for name in contenders:
        for count in counts:
            totals[name][count] = {"writes": 0, "wall": 0.0, "cpu_s": 0.0, "latencies_ms": []}
    groups: list[_Writers] = []
    try:
        for count in counts:  # each round: every count, and every contender at each count
            for name, (kind, where) in contenders.items():
                target = folder / f"{stores[name]}-{count}"
                groups.append(_Writers(name, kind, target, count, where))
        for _ in range(rounds):
            for group in groups:
                outcome = group.window(seconds)
                total = totals[group.name][len(group.processes)]
                for field, value in outcome.items():
                    total[field] += value
    finally:
        for group in groups:
            group.stop()
    results: dict[str, Any] = {}
    for name, per_count in totals.items():
        one = per_count[counts[0]]["writes"] / per_count[counts[0]]["wall"]
        results[name] = {
            str(count): {
                "writes": int(total["writes"]),
                "per_s": total["writes"] / total["wall"],
                "scaling": total["writes"] / total["wall"] / one,
                "cpu_us_per_record": total["cpu_s"] / max(1.0, total["writes"]) * 1e6,
                "p99_ms": percentile(total["latencies_ms"], 0.99),
                "max_ms": max(total["latencies_ms"]),
            }
            for count, total in per_count.items()
        }
    return results


def main() -> None:
    """A run on its own (outside ``benchmarks.compare``), printed and saved as JSON;
    ``--baseline NAME=DIR`` times another version's ``outbox`` package (e.g. from ``git
    archive``) beside this one in the same rounds."""
    import argparse
    import tempfile

    from benchmarks.common import head_commit, load_average, write_result
    from benchmarks.compare import fs_baseline

    parser = argparse.ArgumentParser(prog="python -m benchmarks.writers")
    parser.add_argument("--records", type=int, default=30_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--counts", default="1,2,4")
    parser.add_argument("--only", default="batches,processes")
    parser.add_argument("--baseline", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--out", type=Path, default=_REPO / "benchmarks/results/writers.json")
    args = parser.parse_args()
    baselines = {
        name: Path(folder).resolve()
        for name, folder in (entry.split("=", 1) for entry in args.baseline)
    }
    counts = tuple(int(count) for count in args.counts.split(","))
    result: dict[str, Any] = {"commit": head_commit(), "load_before": load_average()}
    with tempfile.TemporaryDirectory(prefix="outbox-writers-") as scratch:
        result["disk_before"] = fs_baseline(Path(scratch))
        if "batches" in args.only:
            result["batches"] = batches(Path(scratch) / "batches", args.records, args.rounds)
        if "processes" in args.only:
            result["processes"] = processes(
                Path(scratch) / "processes", counts, args.seconds, args.rounds, baselines
            )
        result["disk_after"] = fs_baseline(Path(scratch))
    result["load_after"] = load_average()
    result["plan"] = vars(args) | {"out": str(args.out)}
    write_result(args.out, result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
