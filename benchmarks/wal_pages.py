"""What one commit writes: WAL pages per commit, by table and index, and the caller's CPU.

At ``synchronous=FULL`` a commit's cost is its fsync and the pages it hands the WAL, and at
any setting each page is a write the caller's thread makes (and, at the next checkpoint, one
more into the database file). This benchmark commits a run of records after a checkpoint
empties the WAL, then reads the WAL's frame headers and maps each page to the b-tree that
owns it (SQLite's ``dbstat``): ``add`` (one record a commit), ``add_many`` of 100, and the
same-work and mission floors of ``benchmarks.writepath``. It also times the caller's thread
(``time.thread_time``) for ``add`` and the same-work floor, alternating, since the pages are
written on that thread.

``python -m benchmarks.wal_pages`` prints both tables and writes ``results/wal-pages.json``.
"""

from __future__ import annotations

import argparse
import collections
import sqlite3
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    bench_settings,
    head_commit,
    load_average,
    memories,
    open_outbox,
    write_result,
)

RESULTS = Path(__file__).resolve().parent / "results" / "wal-pages.json"
_WAL_HEADER = 32
_FRAME_HEADER = 24
# Fewer commits than fill the WAL up to its autocheckpoint (1,000 pages): a checkpoint in
# the middle would restart the WAL and hide the frames written before it.
_COMMITS = 30
_BATCH = 100
_BATCH_COMMITS = 5  # about 130 pages each
_WARM_RECORDS = 2000  # the tables past their first pages, as a store in use has them


def wal_pages(path: Path) -> list[int]:
    """The page number of every frame in ``path``'s WAL, in the order they were written."""
    raw = Path(f"{path}-wal").read_bytes()
    (page_size,) = struct.unpack(">I", raw[8:12])
    pages: list[int] = []
    offset = _WAL_HEADER
    while offset + _FRAME_HEADER + page_size <= len(raw):
        (page,) = struct.unpack(">I", raw[offset : offset + 4])
        pages.append(page)
        offset += _FRAME_HEADER + page_size
    return pages


def pages_per_commit(path: Path, commit: Callable[[int], object], commits: int) -> dict[str, float]:
    """WAL pages per commit of ``commit`` on the database at ``path``, by owning b-tree
    (``total`` for all), after a checkpoint that empties the WAL."""
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for number in range(commits):
        commit(number)
    with sqlite3.connect(path) as conn:
        owners = dict(conn.execute("SELECT pageno, name FROM dbstat").fetchall())
    pages = wal_pages(path)
    counts = collections.Counter(_owner(owners, page) for page in pages)
    per = {name: count / commits for name, count in counts.most_common()}
    return {"total": len(pages) / commits, **per}


def _owner(owners: dict[int, str], page: int) -> str:
    """The b-tree a page belongs to; page 1 holds the file's header (its size, among others)
    as well as the schema's root."""
    return "page 1 (header)" if page == 1 else str(owners.get(page, "(free)"))


def run(folder: Path, rounds: int) -> dict[str, Any]:
    # The floors' module imports the queues it is compared with (the bench extra); the page
    # count above runs without them, in the test suite.
    from benchmarks.writepath import mission_floor_writer, same_work_floor

    texts = memories(500, seed=24)
    outbox = open_outbox(bench_settings(folder / "add", synchronous="FULL"))
    batched = open_outbox(bench_settings(folder / "add_many", synchronous="FULL"))
    floors = {
        "same-work floor": (same_work_floor(folder, "FULL", texts), folder / "same-work.db"),
        "mission floor": (mission_floor_writer(folder, "FULL", texts), folder / "mission.db"),
    }
    try:
        for number in range(_WARM_RECORDS):
            outbox.add(f"warm {number} {texts[number % len(texts)]}")
            for call, _path in floors.values():
                call(100_000 + number)
        batched.add_many(f"warm {n} {texts[n % len(texts)]}" for n in range(_WARM_RECORDS))
        outbox.wait_mirrored()
        batched.wait_mirrored()

        def add(number: int) -> None:
            outbox.add(f"{number} {texts[number % len(texts)]}", tags=["decision"])

        def add_many(number: int) -> None:
            start = number * _BATCH
            batched.add_many(
                f"{start + item} {texts[(start + item) % len(texts)]}" for item in range(_BATCH)
            )

        database = _database(folder / "add")
        pages = {"add": pages_per_commit(database, add, _COMMITS)}
        many = pages_per_commit(_database(folder / "add_many"), add_many, _BATCH_COMMITS)
        pages[f"add_many of {_BATCH}, per record"] = {
            name: value / _BATCH for name, value in many.items()
        }
        for name, (call, path) in floors.items():
            pages[name] = pages_per_commit(path, _shifted(call, 200_000), _COMMITS)
        cpu = _caller_cpu(add, floors["same-work floor"][0], rounds)
    finally:
        outbox.close()
        batched.close()
    return {"pages_per_commit": pages, "caller_cpu_us": cpu}


def _shifted(call: Callable[[int], None], by: int) -> Callable[[int], None]:
    """``call`` with numbers past those it was given before, so every content is new."""
    return lambda number: call(by + number)


def _database(folder: Path) -> Path:
    return folder / "home" / "outbox.db"


def _caller_cpu(
    add: Callable[[int], None], floor: Callable[[int], None], rounds: int
) -> dict[str, float]:
    """Median CPU µs per call on the calling thread, ``add`` and the floor alternating."""
    per_round = 300
    samples: dict[str, list[float]] = {"add": [], "same-work floor": []}
    number = 300_000
    for round_number in range(rounds):
        order = [("add", add), ("same-work floor", floor)]
        for name, call in order if round_number % 2 == 0 else order[::-1]:
            start = time.thread_time()
            for _ in range(per_round):
                call(number)
                number += 1
            samples[name].append((time.thread_time() - start) / per_round * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="wal-pages-") as scratch:
        result = run(Path(scratch), args.rounds)
    result |= {"commit": head_commit(), "load_before": before, "load_after": load_average()}
    pages = result["pages_per_commit"]
    names = sorted({name for per in pages.values() for name in per} - {"total"})
    names.sort(key=lambda name: -pages["add"].get(name, 0.0))
    print("| b-tree | " + " | ".join(pages) + " |")
    print("|---|" + "---:|" * len(pages))
    for name in ["total", *names]:
        cells = [f"{per.get(name, 0.0):.2f}" for per in pages.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")
    cpu = result["caller_cpu_us"]
    print(
        f"caller CPU per call (median of rounds): add {cpu['add']:.0f} µs, "
        f"same-work floor {cpu['same-work floor']:.0f} µs; load {before[0]:.2f}"
    )
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
