"""What a forget's Chroma delete costs now that it purges Chroma's own copies (issue 21).

A Chroma store of ``--count`` documents (about 600 bytes each, two tags, the ``hashing``
embedder's 384-dimension vectors) is filled through ``ChromaSink.deliver``, as the dispatcher
fills it; then ``--forgets`` documents are deleted one at a time through ``ChromaSink.delete``,
whose thread then stops Chroma and purges (``outbox.sinks.chroma_purge``), leaving the next
call to start it again. Timed for each: the delete until its purge is done, and the first call
after it (the restart of the shared server or of the embedded child). Both modes, one after
the other.

    python -m benchmarks.forget_chroma                 # 100,000 documents
    python -m benchmarks.forget_chroma --count 10000   # a quick run
    python -m benchmarks.forget_chroma --store DIR     # fill DIR once, time both modes on it
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import head_commit, load_average, memory_text, percentile, write_result
from outbox.core.record import Record
from outbox.sinks.base import Held
from outbox.sinks.chroma import PURGE_OWED, ChromaSink
from outbox.sinks.chroma_service import SharedServer

RESULTS = Path(__file__).with_name("results") / "forget_chroma.json"
_BATCH = 2000


def _records(count: int) -> list[Record]:
    rng = random.Random(21)
    return [
        Record(
            hashlib.sha256(str(number).encode()).hexdigest(),
            f"2026-01-01T00:00:{number % 60:02d}.{number % 1_000_000:06d}Z",
            memory_text(number, rng),
            tags=(f"topic{number % 50}", f"person{number % 997}"),
        )
        for number in range(count)
    ]


def _size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def run_mode(folder: Path, mode: str, records: list[Record], forgets: int) -> dict[str, Any]:
    """Fill one store, then time each delete (with its purge) and the call after it."""
    sink = ChromaSink("bench", path=folder, embedding="hashing", mode=mode, timeout=900.0)
    try:
        began = time.perf_counter()
        if sink.count() < len(records) - 2 * forgets:  # else a store kept from a run (--store)
            for start in range(0, len(records), _BATCH):
                sink.deliver(records[start : start + _BATCH])
        filled = time.perf_counter() - began
        size, held = _size(folder), sink.count()
        chosen = random.Random(5 if mode == "server" else 6).sample(records, forgets)
        purges, restarts = [], []
        for record in chosen:
            began = time.perf_counter()
            sink.delete([Held(record.key, record.key)])
            while (folder / PURGE_OWED).exists():  # the purge runs in the sink's own thread
                time.sleep(0.05)
            purges.append(time.perf_counter() - began)
            began = time.perf_counter()
            remaining = sink.count()
            restarts.append(time.perf_counter() - began)
        assert remaining == held - forgets
    finally:
        sink.close()
        if mode == "server":
            with SharedServer(folder, 0.0).stopped():
                pass  # leaves no server behind
    return {
        "fill_seconds": round(filled, 1),
        "store_mb_before": round(size / 1e6, 1),
        "store_mb_after": round(_size(folder) / 1e6, 1),
        "forgets": forgets,
        "delete_with_purge_median_s": round(percentile(purges, 0.5), 2),
        "delete_with_purge_max_s": round(max(purges), 2),
        "next_call_median_s": round(percentile(restarts, 0.5), 2),
        "next_call_max_s": round(max(restarts), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--forgets", type=int, default=5)
    parser.add_argument("--store", type=Path, help="a store folder to fill once and keep")
    args = parser.parse_args()
    records = _records(args.count)
    began_load = load_average()
    modes = {}
    with tempfile.TemporaryDirectory(prefix="outbox-forget-chroma-") as scratch:
        for mode in ("server", "embedded"):
            folder = args.store or Path(scratch) / mode
            modes[mode] = run_mode(folder, mode, records, args.forgets)
    result = {
        "count": args.count,
        "load_average_at_start": began_load,
        "modes": modes,
        "commit": head_commit(),
    }
    write_result(RESULTS, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
