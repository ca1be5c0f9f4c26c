"""What the Chroma sink costs: MiniLM embedding, ``ChromaSink.deliver`` into embedded Chroma and
into a ``chroma run`` server, and ``Outbox.drain()`` beside the raw embed + upsert of the same
records (chromadb called directly, in process), so the outbox's share can be stated.

Everything lives in a temporary folder; the server is a real ``chroma run`` on a free loopback
port. Run: ``.venv/bin/python benchmarks/chroma_drain.py [--records 1000]``; prints one JSON
object (times in milliseconds unless named otherwise). On a shared machine compare the CPU
figures: wall time there mostly measures the neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: make `benchmarks` and `tests` importable

from benchmarks.common import memories  # noqa: E402
from outbox import Outbox, load_settings  # noqa: E402
from outbox.dispatch.dispatcher import Dispatcher  # noqa: E402
from outbox.record import Record, build_record  # noqa: E402
from outbox.sinks.chroma import ChromaSink, chroma_metadata  # noqa: E402
from outbox.sinks.embedding import MiniLMEmbedding, load_embedding  # noqa: E402
from tests.chroma_server import ChromaServer  # noqa: E402

BATCH = 64


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1000.0


def percent_over(measured: float, baseline: float) -> float:
    return round(100.0 * (measured / baseline - 1.0), 1)


def records(texts: Sequence[str]) -> list[Record]:
    return [build_record(text) for text in texts]


def batches(items: Sequence[Any], size: int = BATCH) -> list[Sequence[Any]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def embedding_figures(model: MiniLMEmbedding, texts: Sequence[str]) -> dict[str, float]:
    model(list(texts[:BATCH]))  # warm the session
    singles = [timed(lambda text=text: model([text])) for text in texts[BATCH : BATCH + 50]]
    runs = [timed(lambda chunk=chunk: model(list(chunk))) for chunk in batches(texts[:320])]
    return {
        "single_median_ms": round(statistics.median(singles), 2),
        "batch64_per_text_ms": round(statistics.median(runs) / BATCH, 2),
    }


def deliver_per_record(sink: ChromaSink, texts: Sequence[str]) -> dict[str, float]:
    """Median of five calls of 64 fresh records; the first call (connect, start) apart."""
    chunks = batches(records(texts))
    first = timed(lambda: sink.deliver(chunks[0]))
    runs = [timed(lambda chunk=chunk: sink.deliver(chunk)) for chunk in chunks[1:6]]
    return {
        "first_call_ms": round(first, 1),
        "per_record_ms": round(statistics.median(runs) / BATCH, 2),
    }


@dataclass
class Cost:
    """Wall seconds, and CPU seconds of this process plus its exited children (the sink's
    child is one): CPU barely moves when other work shares the machine, wall time does."""

    wall: float = 0.0
    cpu: float = 0.0


@contextmanager
def measured(cost: Cost) -> Iterator[None]:
    def cpu() -> float:
        own, children = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    wall, used = time.perf_counter(), cpu()
    yield
    cost.wall, cost.cpu = time.perf_counter() - wall, cpu() - used


def raw_cost(folder: Path, model: MiniLMEmbedding, items: Sequence[Record]) -> Cost:
    """chromadb in this process, no outbox: embed 64, upsert 64, repeat."""
    import chromadb

    cost = Cost()
    with measured(cost):
        client = chromadb.PersistentClient(str(folder))
        collection = client.get_or_create_collection(
            "raw", embedding_function=None, configuration={"hnsw": {"space": "cosine"}}
        )
        for chunk in batches(items):
            collection.upsert(
                ids=[record.key for record in chunk],
                embeddings=model([record.content for record in chunk]),  # type: ignore[arg-type]
                documents=[record.content for record in chunk],
                metadatas=[chroma_metadata(record) for record in chunk],  # type: ignore[misc]
            )
        assert collection.count() == len(items)
        client.close()
    return cost


def sink_cost(folder: Path, items: Sequence[Record]) -> Cost:
    """``ChromaSink.deliver`` called directly (no dispatcher), child start and exit included."""
    cost = Cost()
    with measured(cost):
        sink = ChromaSink("direct", path=folder, timeout=120.0)
        try:
            for chunk in batches(items):
                sink.deliver(chunk)
        finally:
            sink.close()
    return cost


def drain_cost(folder: Path, texts: Sequence[str], warm: bool) -> Cost:
    """``Outbox.drain()`` as ``outbox drain`` runs it (the sink's child starts and exits inside
    the measure), or a long-lived dispatcher whose child is already up (as ``outbox run``;
    wall time only, as its child is still running when the measure ends)."""
    settings = load_settings(
        env={},
        home=folder / "home",
        markdown_dir=folder / "md",
        sinks="chroma",
        chroma_path=folder / "chroma",
        batch_size=BATCH,
    )
    cost = Cost()
    with Outbox.open(settings) as ob, Dispatcher(ob) as dispatcher:
        before = 0
        if warm:
            ob.add("a first memory, to start the sink before the clock does")
            before = dispatcher.drain(timeout=120).delivered  # the counts add up
        ob.add_many(list(texts))
        with measured(cost):
            report = dispatcher.drain(timeout=600) if warm else ob.drain(timeout=600)
        assert report.ok, report.to_dict()
        assert report.delivered - before == len(texts)
    return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--text-bytes", type=int, default=300, help="size of each memory")
    parser.add_argument("--rounds", type=int, default=3, help="the fastest round counts")
    args = parser.parse_args()
    count = args.records
    texts = memories(count + 1000, seed=11, size=args.text_bytes)
    result: dict[str, Any] = {
        "records": count,
        "text_bytes": round(statistics.mean(len(text.encode()) for text in texts)),
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    started = time.perf_counter()
    model = load_embedding("minilm")
    assert isinstance(model, MiniLMEmbedding)
    result["model_load_ms"] = round((time.perf_counter() - started) * 1000.0, 1)
    tokens = [len(model._tokenizer.encode(text).ids) for text in texts[:200]]
    result["tokens_per_text"] = round(statistics.mean(tokens), 1)
    result["embedding"] = embedding_figures(model, texts[count:])

    with tempfile.TemporaryDirectory(prefix="chroma-bench-") as scratch:
        folder = Path(scratch)
        embedded = ChromaSink("bench-embedded", path=folder / "embedded", timeout=120.0)
        try:
            result["deliver_embedded"] = deliver_per_record(embedded, texts[count : count + 384])
        finally:
            embedded.close()
        with ChromaServer(folder / "server") as server:
            remote = ChromaSink("bench-server", url=server.url, timeout=120.0)
            try:
                result["deliver_server"] = deliver_per_record(remote, texts[count : count + 384])
            finally:
                remote.close()

        items = records(texts[:count])
        runs: dict[str, list[Cost]] = {"drain_cold": [], "drain_warm": [], "sink": [], "raw": []}
        for round_ in range(args.rounds):  # interleaved, so a burst of load hits all alike
            here = folder / f"round-{round_}"
            runs["drain_cold"].append(drain_cost(here / "cold", texts[:count], warm=False))
            runs["drain_warm"].append(drain_cost(here / "warm", texts[:count], warm=True))
            runs["sink"].append(sink_cost(here / "sink", items))
            runs["raw"].append(raw_cost(here / "raw", model, items))
    wall = {label: min(cost.wall for cost in costs) for label, costs in runs.items()}
    cpu = {label: min(cost.cpu for cost in costs) for label, costs in runs.items()}
    result["drain"] = {
        "wall_seconds": {label: [round(c.wall, 2) for c in costs] for label, costs in runs.items()},
        "cpu_seconds": {
            label: [round(c.cpu, 2) for c in costs]
            for label, costs in runs.items()
            if label != "drain_warm"
        },
        "records_per_s": {label: round(count / seconds, 1) for label, seconds in wall.items()},
        "wall_drain_warm_vs_raw_pct": percent_over(wall["drain_warm"], wall["raw"]),
        "cpu_dispatcher_vs_sink_pct": percent_over(cpu["drain_cold"], cpu["sink"]),
        "cpu_sink_vs_raw_pct": percent_over(cpu["sink"], cpu["raw"]),
        "cpu_drain_vs_raw_pct": percent_over(cpu["drain_cold"], cpu["raw"]),
    }
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
