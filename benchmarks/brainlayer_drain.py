"""How fast ``Outbox.drain()`` delivers into BrainLayer in process, against BrainLayer's own
``store_memory`` called directly for the same records.

The gap between the two is the outbox's cost per record (claim, settle, mirrors) plus the
sink's writer open/close per batch. Everything lives in a temporary folder; no model is
loaded. Run: ``python benchmarks/brainlayer_drain.py [--records 500]``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def brainlayer_environ(root: Path) -> dict[str, str]:
    """Keep BrainLayer inside ``root`` and offline."""
    return {
        "HOME": str(root / "home"),
        "HF_HUB_OFFLINE": "1",
        "BRAINLAYER_FORBID_EMBEDDING_MODEL": "1",
        "BRAINLAYER_WRITER_TELEMETRY": "0",
        "BRAINLAYER_DB": str(root / "unused.db"),
        "BRAINLAYER_QUEUE_DIR": str(root / "queue"),
        "BRAINLAYER_WRITER_PIDFILE_DIR": str(root / "pid"),
        "BRAINLAYER_WRITER_HEARTBEAT_DIR": str(root / "heartbeat"),
    }


def contents(count: int, seed: int = 7) -> list[str]:
    """Distinct memories, varied enough that BrainLayer's near-duplicate merge stays out."""
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))

    return [
        f"Note {i}: " + " ".join(word() for _ in range(rng.randint(12, 40))) for i in range(count)
    ]


def bench_drain(root: Path, texts: list[str]) -> dict[str, Any]:
    from brainlayer.vector_store import VectorStore

    from outbox import Outbox, load_settings

    db = root / "drain" / "brainlayer.db"
    VectorStore(db).close()
    settings = load_settings(
        env={},
        home=root / "drain" / ".outbox",
        markdown_dir=root / "drain" / "md",
        sinks="brainlayer",
        brainlayer_db=db,
    )
    with Outbox.open(settings) as ob:
        ob.add_many(texts)
        started = time.perf_counter()
        report = ob.drain(timeout=600)
        elapsed = time.perf_counter() - started
    if not report.ok:
        raise SystemExit(f"drain did not deliver everything: {report.to_dict()}")
    return {
        "records": len(texts),
        "batch_size": settings.batch_size,
        "batches": report.sinks["brainlayer"].batches,
        "seconds": round(elapsed, 3),
        "records_per_second": round(len(texts) / elapsed, 1),
    }


def bench_store_memory(root: Path, texts: list[str]) -> dict[str, Any]:
    from brainlayer.runtime_store import open_writer_store
    from brainlayer.store import store_memory
    from brainlayer.vector_store import VectorStore

    from outbox.record import build_record
    from outbox.sinks.brainlayer import chunk_id_for

    db = root / "direct" / "brainlayer.db"
    VectorStore(db).close()
    records = [build_record(text) for text in texts]
    store = open_writer_store(db)
    try:
        started = time.perf_counter()
        for record in records:
            store_memory(
                store,
                None,
                content=record.content,
                memory_type="note",
                importance=record.importance,
                chunk_id=chunk_id_for(record.key),
                created_at=record.timestamp,
            )
        elapsed = time.perf_counter() - started
    finally:
        store.close()
    return {
        "records": len(records),
        "seconds": round(elapsed, 3),
        "ms_per_record": round(elapsed / len(records) * 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="outbox-bl-bench-") as tmp:
        root = Path(tmp)
        os.environ.update(brainlayer_environ(root))
        (root / "home").mkdir()
        texts = contents(args.records)
        result = {
            "python": sys.version.split()[0],
            "drain": bench_drain(root, texts),
            "store_memory_direct": bench_store_memory(root, texts),
        }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
