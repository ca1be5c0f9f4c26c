"""Pieces every benchmark shares: memories to write, scratch outboxes, timing and statistics.

All figures are per call in microseconds unless named otherwise. Percentiles use the nearest
rank (no interpolation), so a reported p99 is a latency some call really had.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from outbox import Outbox, Settings, load_settings

NOOP_SINK = "outbox.testing.sinks:NoopSink"
MIRROR_ID = "bench"

# A working vocabulary for synthetic memories: realistic word lengths and enough distinct
# terms that the FTS index has posting lists of many lengths, as real notes give it.
_VOCABULARY = (
    "agent memory outbox sqlite chroma brainlayer dispatcher lease retry backoff embedding "
    "vector index recall session decision storage durable commit journal fsync mirror markdown "
    "jsonl replay fallback queue sink delivery pending delivered dead letter schema migration "
    "alembic postgres wal checkpoint busy timeout lock writer reader thread process signal "
    "shutdown latency throughput batch claim settle upsert collection document metadata tag "
    "importance timestamp canonical key slug hash chain verify repair crash power loss torn "
    "line file folder permission owner config setting environment default override yaml json "
    "model onnx tokenizer minilm int8 cosine distance query result rank fusion lexical semantic "
    "paraphrase overlay frontier node edge graph spawned recent turn prompt thought response "
    "user operator release backfill ingestion benchmark floor ratio median percentile profile "
    "cache page btree rowid primary unique constraint foreign cascade trigger view table column "
    "because therefore however instead decided chose measured observed expected found fixed "
    "kept dropped moved added removed renamed split merged tested shipped reviewed documented "
    "the a an of to in on for with by from at as is was are be it this that we they"
)
_WORDS = _VOCABULARY.split()


def memory_text(number: int, rng: random.Random, size: int = 600) -> str:
    """A memory of about ``size`` bytes; ``number`` makes it unique (so is its key)."""
    words = [f"note {number}:"]
    length = len(words[0])
    while length < size:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words) + "."


def memories(count: int, seed: int, size: int = 600, start: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [memory_text(start + number, rng, size) for number in range(count)]


def bench_settings(
    folder: Path, *, synchronous: str = "FULL", sinks: str = NOOP_SINK, **extra: Any
) -> Settings:
    """Settings for a scratch outbox in ``folder``, ignoring the caller's OUTBOX_* variables."""
    return load_settings(
        env={},
        home=folder / "home",
        markdown_dir=folder / "md",
        sinks=sinks,
        synchronous=synchronous,
        mirror_id=MIRROR_ID,
        **extra,
    )


def outbox_environ(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment that makes ``python -m outbox`` open the same outbox as ``settings``."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    env.update(
        OUTBOX_HOME=str(settings.home),
        OUTBOX_DB_URL=settings.db_url,
        OUTBOX_JSONL_PATH=str(settings.jsonl_path),
        OUTBOX_MARKDOWN_DIR=str(settings.markdown_dir),
        OUTBOX_SINKS=",".join(settings.sinks),
        OUTBOX_SYNCHRONOUS=settings.synchronous,
        OUTBOX_MIRROR_ID=settings.mirror_id,
        OUTBOX_CHROMA_PATH=str(settings.chroma_path),
        OUTBOX_BATCH_SIZE=str(settings.batch_size),
    )
    env.update(extra)
    return env


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment for the block (code that reads its settings
    from there, an in-process dispatcher say), the previous values put back after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def open_outbox(settings: Settings) -> Outbox:
    outbox = Outbox.open(settings)
    if outbox.unavailable:
        raise RuntimeError(f"the scratch outbox did not open: {outbox.unavailable}")
    return outbox


def percentile(samples: list[float], fraction: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def summarize(samples: list[float], wall: float, per_call: int = 1) -> dict[str, float]:
    """Median, p99 and max per item in µs, and items per second over ``wall`` seconds.

    ``samples`` are seconds per call; a call of ``per_call`` items counts as that many.
    """
    per_item = [sample / per_call * 1e6 for sample in samples]
    return {
        "calls": len(samples),
        "items": len(samples) * per_call,
        "median_us": statistics.median(per_item),
        "p99_us": percentile(per_item, 0.99),
        "max_us": max(per_item),
        "per_s": len(samples) * per_call / wall if wall > 0 else 0.0,
    }


def lag_summary(lags: list[float]) -> dict[str, float]:
    """Commit-to-mirrors lag per record (seconds in), as median, p99 and max in ms."""
    if not lags:
        return {"records": 0, "median_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    return {
        "records": len(lags),
        "median_ms": statistics.median(lags) * 1000,
        "p99_ms": percentile(lags, 0.99) * 1000,
        "max_ms": max(lags) * 1000,
    }


def time_calls(
    call: Callable[[int], object], count: int, *, start: int = 0, pace: float | None = None
) -> tuple[list[float], float]:
    """Run ``call(i)`` ``count`` times; returns (seconds per call, wall seconds).

    With ``pace`` a call starts every ``pace`` seconds at most (a steady writer, not a
    flood): the wall time then includes the pauses and says nothing about throughput.
    """
    samples: list[float] = []
    begin = time.perf_counter()
    for number in range(start, start + count):
        tick = time.perf_counter()
        call(number)
        done = time.perf_counter()
        samples.append(done - tick)
        if pace is not None and done - tick < pace:
            time.sleep(pace - (done - tick))
    return samples, time.perf_counter() - begin


@contextmanager
def quiet_gc() -> Iterator[None]:
    """Collect before a timed section so one contender does not pay for another's garbage."""
    gc.collect()
    yield


def alternate(
    contenders: dict[str, Callable[[int], object]], count: int, rounds: int, warmup: int = 20
) -> dict[str, tuple[list[float], float]]:
    """Time contenders in alternating rounds, so a noisy neighbour's burst on a shared machine
    lands on all of them rather than on whichever ran during it.

    Each first makes ``warmup`` untimed calls (numbered -1, -2, ...): connections, caches
    and lazy imports are set up before the clock runs.
    """
    for call in contenders.values():
        for number in range(warmup):
            call(-1 - number)
    results: dict[str, tuple[list[float], float]] = {name: ([], 0.0) for name in contenders}
    per_round = max(1, count // rounds)
    for round_number in range(rounds):
        for name, call in contenders.items():
            with quiet_gc():
                samples, wall = time_calls(call, per_round, start=round_number * per_round)
            kept, total = results[name]
            results[name] = (kept + samples, total + wall)
    return results


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def head_commit() -> str:
    """The commit the benchmark ran on, for its results file."""
    return os.popen("git rev-parse --short HEAD").read().strip()


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Save one benchmark's figures as JSON under ``benchmarks/results/``."""
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
