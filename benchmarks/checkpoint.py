"""When a writer checkpoints its WAL: SQLite's default of 1,000 pages, which the library
keeps, against a larger bound (``--pages``), side by side on two stores in alternating rounds
at FULL: what the larger bound buys a bulk writer, and what it does to a single ``add``.

Two measures, as a user meets them: ``add_many`` of 100 into a store that grows (records per
second until the files are written, per step of the store's size), and single ``add`` calls
(median, p99, p99.9 and the slowest, where a checkpoint lands on one commit). Both
contenders are the library as it is, each with ``PRAGMA wal_autocheckpoint`` set (and read
back) on its writer's connection: 1,000 and ``--pages``. Not the whole story: the larger
bound also pushed ``add`` beside a backfill and at a million records
(``benchmarks.backfill_modes``, ``benchmarks.scale`` on a build that had it;
docs/benchmarks.md, bulk writes), which is why the library does not set it.

``python -m benchmarks.checkpoint`` prints both tables and writes ``results/checkpoint.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    bench_settings,
    head_commit,
    load_average,
    memories,
    open_outbox,
    percentile,
    quiet_gc,
    write_result,
)
from outbox import Outbox

REPO = Path(__file__).resolve().parent.parent
SQLITE_DEFAULT_PAGES = 1_000
LARGER_PAGES = 10_000
BATCH = 100


def _outbox(folder: Path, pages: int) -> Outbox:
    """A scratch outbox at FULL whose writer checkpoints at ``pages``."""
    outbox = open_outbox(bench_settings(folder, synchronous="FULL"))
    outbox.add("opens the writer's connection")
    connection = outbox.writer.transactions._connection  # type: ignore[attr-defined]
    connection.execute(f"PRAGMA wal_autocheckpoint = {pages}")
    (set_to,) = connection.execute("PRAGMA wal_autocheckpoint").fetchone()
    assert set_to == pages
    return outbox


def batches(folder: Path, records: int, step: int, pages: int) -> dict[str, list[dict[str, float]]]:
    """``add_many`` of BATCH per contender, ``step`` records at a time, alternating, until
    each store holds ``records``: records per second of each step, files included."""
    texts = memories(500, seed=31)
    stores = {
        name: _outbox(folder / f"batches-{bound}", bound)
        for name, bound in (
            ("default", SQLITE_DEFAULT_PAGES),
            ("larger", pages),
        )
    }
    steps: dict[str, list[dict[str, float]]] = {name: [] for name in stores}
    try:
        for start in range(0, records, step):
            for name, outbox in stores.items():
                with quiet_gc():
                    tick = time.perf_counter()
                    for first in range(start, start + step, BATCH):
                        outbox.add_many(
                            [
                                {"content": f"{n} {texts[n % len(texts)]}", "tags": ["bench"]}
                                for n in range(first, first + BATCH)
                            ]
                        )
                    outbox.wait_mirrored()
                    wall = time.perf_counter() - tick
                steps[name].append({"records": start + step, "per_s": step / wall})
    finally:
        for outbox in stores.values():
            outbox.close()
    return steps


def singles(folder: Path, calls: int, rounds: int, pages: int) -> dict[str, dict[str, float]]:
    """``calls`` single ``add``s per contender per round, alternating: latency in µs."""
    texts = memories(500, seed=37)
    stores = {
        "default": _outbox(folder / "singles-default", SQLITE_DEFAULT_PAGES),
        "larger": _outbox(folder / "singles-larger", pages),
    }
    samples: dict[str, list[float]] = {name: [] for name in stores}
    number = 0
    try:
        for _ in range(rounds):
            for name, outbox in stores.items():
                with quiet_gc():
                    for _ in range(calls):
                        number += 1
                        tick = time.perf_counter()
                        outbox.add(f"{number} {texts[number % len(texts)]}", tags=["bench"])
                        samples[name].append((time.perf_counter() - tick) * 1e6)
    finally:
        for outbox in stores.values():
            outbox.close()
    return {
        name: {
            "calls": len(values),
            "median_us": statistics.median(values),
            "p99_us": percentile(values, 0.99),
            "p999_us": percentile(values, 0.999),
            "max_us": max(values),
            "mean_us": statistics.mean(values),
        }
        for name, values in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint")
    parser.add_argument("--records", type=int, default=30_000)
    parser.add_argument("--step", type=int, default=5_000)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--pages", type=int, default=LARGER_PAGES, help="the larger bound")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/checkpoint.json")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "commit": head_commit(),
        "load_before": load_average(),
        "pages": {"default": SQLITE_DEFAULT_PAGES, "larger": args.pages},
    }
    with tempfile.TemporaryDirectory(prefix="outbox-checkpoint-") as scratch:
        result["batches"] = batches(Path(scratch), args.records, args.step, args.pages)
        result["singles"] = singles(Path(scratch), args.calls, args.rounds, args.pages)
    result["load_after"] = load_average()
    write_result(args.out, result)
    print(f"add_many of {BATCH}, records/s as the store grows (FULL):")
    print(f"{'records':>8} {'default':>9} {args.pages:>9} {'ratio':>6}")
    for old, new in zip(result["batches"]["default"], result["batches"]["larger"], strict=True):
        ratio = new["per_s"] / old["per_s"]
        print(f"{old['records']:>8.0f} {old['per_s']:>9.0f} {new['per_s']:>9.0f} {ratio:>5.2f}x")
    print("single add, µs (FULL):")
    for name, figures in result["singles"].items():
        print(
            f"  {name:8} median {figures['median_us']:7.0f}  p99 {figures['p99_us']:7.0f}"
            f"  p99.9 {figures['p999_us']:7.0f}  max {figures['max_us']:7.0f}"
        )
    print(f"load {result['load_before'][0]:.2f} -> {result['load_after'][0]:.2f}")


if __name__ == "__main__":
    main()
