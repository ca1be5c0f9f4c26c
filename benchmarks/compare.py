"""The outbox side by side with its floor and its rivals, in one run, on this machine.

    .venv/bin/python -m benchmarks.compare            # the full run (about 19 minutes)
    .venv/bin/python -m benchmarks.compare --quick    # a smoke run (under 3 minutes)

Sections (``--only write,threads,writers,inline,backfill,drain,embed,scale,rss,startup`` runs a
subset): the write path against the bare-SQLite floors and two SQLite queues at FULL and NORMAL;
the same with 1, 4 and 8 writer threads in one process (group commit); bulk writes as a user
does them, ``add_many`` beside one queue writer's ``put`` and 1, 2 and 4 writer processes on one
store beside the queues' (``benchmarks/writers.py``); the inline embed +
``collection.add`` path; ``add`` latency while a dispatcher process drains a backlog into
embedded Chroma, and beside ``outbox drain``, ``outbox run`` and an in-process dispatcher
(``backfill_modes``); drain throughput per sink with 1 and 2 dispatcher processes; the Chroma
drain of LoCoMo turns beside the embedder's own best throughput on them; ``add`` and
claim cost at growing outbox sizes; peak RSS of a dispatcher draining a big backlog; the
command line's start beside the interpreter's.
Prints tables and ratios, writes them to ``benchmarks/results/latest.json`` (and the
tables to ``latest.md``) and draws the PNG figures in ``docs/img/``. Scratch data goes to
``--dir`` (default: a new temporary folder, removed afterwards unless ``--keep``). Only
ratios measured in the same run are meaningful.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks import (
    backfill_modes,
    drain,
    embed_drain,
    plots,
    scale,
    startup,
    threads,
    writepath,
    writers,
)
from benchmarks.common import (
    NOOP_SINK,
    bench_settings,
    environment,
    load_average,
    percentile,
    summarize,
)
from outbox.sinks.chroma_service import SharedServer

REPO = Path(__file__).resolve().parent.parent
SECTIONS = (
    "write",
    "threads",
    "writers",
    "inline",
    "backfill",
    "drain",
    "embed",
    "scale",
    "rss",
    "startup",
)

FULL_PLAN: dict[str, Any] = {
    "write_calls": 2000,
    "write_batch_calls": 40,
    "write_rounds": 8,
    "threads_counts": [1, 4, 8],
    "threads_seconds": 9.0,
    "threads_rounds": 3,
    "writers_records": 30_000,
    "writers_counts": [1, 2, 4],
    "writers_seconds": 3.0,
    "writers_rounds": 3,
    "inline_calls": 200,
    "backfill_records": 10_000,
    "backfill_idle_calls": 1000,
    "backfill_pace_s": 0.01,
    "backfill_modes": ["drain", "run", "inproc"],
    "backfill_mode_writes": 1000,
    "backfill_mode_backlog": 3000,
    "backfill_mode_rounds": 2,
    "drain_noop_records": 20_000,
    "drain_chroma_records": 2000,
    "drain_brainlayer_records": 1500,
    "embed_turns": 768,
    "embed_rounds": 2,
    "scale_sizes": [10_000, 100_000, 1_000_000],
    "scale_adds": 500,
    "scale_claims": 50,
    "scale_lookups": 20,
    "rss_records": 100_000,
    "startup_rounds": 15,
    "startup_search_records": 10_000,
}
QUICK_PLAN: dict[str, Any] = {
    "write_calls": 300,
    "write_batch_calls": 10,
    "write_rounds": 3,
    "threads_counts": [1, 4],
    "threads_seconds": 1.0,
    "threads_rounds": 1,
    "writers_records": 3000,
    "writers_counts": [1, 2],
    "writers_seconds": 1.0,
    "writers_rounds": 1,
    "inline_calls": 30,
    "backfill_records": 300,
    "backfill_idle_calls": 150,
    "backfill_pace_s": 0.01,
    "backfill_modes": ["drain", "run", "inproc"],
    "backfill_mode_writes": 150,
    "backfill_mode_backlog": 600,
    "backfill_mode_rounds": 1,
    "drain_noop_records": 1000,
    "drain_chroma_records": 150,
    "drain_brainlayer_records": 100,
    "embed_turns": 192,
    "embed_rounds": 1,
    "scale_sizes": [1000, 10_000],
    "scale_adds": 100,
    "scale_claims": 10,
    "scale_lookups": 5,
    "rss_records": 3000,
    "startup_rounds": 3,
    "startup_search_records": 300,
}

RAW_CHROMADB = "chromadb embed + upsert"

# The goals, checked on this run's figures: issue 14's where it set one, issue 6's otherwise.
GOAL_FLOOR_RATIO = 1.3
GOAL_MISSION_FLOOR_RATIO = 2.0
GOAL_SAME_WORK_RATIO = 1.5  # issue 24
GOAL_BACKFILL_P99_RATIO = 2.0
GOAL_MIRROR_LAG_P99_MS = 20.0
GOAL_START_MS = 150.0
GOAL_SEARCH_MS = 500.0  # issue 22: the whole command, wall, on a 10,000-record store
GOAL_INLINE_SPEEDUP = 30.0
GOAL_DISPATCHER_OVERHEAD = 0.10
GOAL_SCALE_RATIO = 1.5
GOAL_PROCESS_SCALING = 1.5  # issue 24: 2 writer processes / 1
GOAL_NOOP_DRAIN_PER_S = 5000.0  # issue 24: one dispatcher on SQLite, no-op sink


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def curve(samples: list[float]) -> list[float]:
    """A compact latency distribution for the JSON file: p0.5 .. p100 in ms, 200 points."""
    if not samples:
        return []
    return [round(percentile(samples, step / 200) * 1000, 4) for step in range(1, 201)]


def fs_baseline(folder: Path, count: int = 300) -> dict[str, float]:
    """What the scratch filesystem charges for the steps a write is made of."""
    probe = folder / "fs-probe"
    probe.mkdir(parents=True, exist_ok=True)
    creates, fsyncs = [], []
    for number in range(count):
        tick = time.perf_counter()
        fd = os.open(probe / f"{number}.md", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"x" * 700)
        middle = time.perf_counter()
        os.fsync(fd)
        done = time.perf_counter()
        os.close(fd)
        creates.append(middle - tick)
        fsyncs.append(done - middle)
    shutil.rmtree(probe)
    return {
        "create_700b_median_us": summarize(creates, 1.0)["median_us"],
        "fsync_median_us": summarize(fsyncs, 1.0)["median_us"],
        "fsync_p99_us": summarize(fsyncs, 1.0)["p99_us"],
    }


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine(folder: Path) -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info if "model name" in line), cpu)
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_gib, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        **{
            name: _version(name)
            for name in (
                "chromadb",
                "onnxruntime",
                "brainlayer",
                "persist-queue",
                "litequeue",
                "sqlalchemy",
                "pyyaml",
            )
        },
        "filesystem": fs_baseline(folder),
    }


# -- sections ----------------------------------------------------------------------------


def section_write(folder: Path, plan: dict[str, Any]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for level in ("FULL", "NORMAL"):
        results[level] = writepath.run(
            folder / level,
            level,
            plan["write_calls"],
            plan["write_batch_calls"],
            plan["write_rounds"],
        )
        results[level]["breakdown"] = writepath.breakdown(
            folder / f"{level}-steps", level, plan["write_calls"] // 2
        )
    return results


def section_threads(folder: Path, plan: dict[str, Any]) -> dict[str, Any]:
    return threads.run(
        folder,
        "FULL",
        tuple(plan["threads_counts"]),
        plan["threads_seconds"],
        plan["threads_rounds"],
    )


def section_writers(folder: Path, plan: dict[str, Any]) -> dict[str, Any]:
    return {
        "batches": writers.batches(
            folder / "batches", plan["writers_records"], plan["writers_rounds"]
        ),
        "processes": writers.processes(
            folder / "processes",
            tuple(plan["writers_counts"]),
            plan["writers_seconds"],
            plan["writers_rounds"],
        ),
    }


def section_inline(folder: Path, plan: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.inline import inline_writes

    result = inline_writes(folder, plan["inline_calls"])
    result["curve_ms"] = curve(result.pop("samples"))
    return result


def section_backfill(folder: Path, plan: dict[str, Any]) -> dict[str, Any]:
    settings = bench_settings(folder, sinks="chroma")
    try:
        result = drain.backfill_run(
            settings,
            plan["backfill_records"],
            plan["backfill_idle_calls"],
            plan["backfill_pace_s"],
            folder / "logs",
        )
    finally:
        with SharedServer(settings.chroma_path, 0.0).stopped():
            pass  # the server the dispatcher started ends with the section, not 10 min later
    idle, busy = result.pop("idle_samples"), result.pop("busy_samples")
    result["idle"] = summarize(idle, 1.0)
    result["busy"] = summarize(busy, 1.0)
    result["idle_curve_ms"] = curve(idle)
    result["busy_curve_ms"] = curve(busy)
    result["idle_lock_wait"] = summarize(result.pop("idle_lock_waits"), 1.0)
    result["busy_lock_wait"] = summarize(result.pop("busy_lock_waits"), 1.0)
    # Issue 24: the ways a user meets it, each mode against its own idle phase.
    result["modes"] = backfill_modes.run(
        [backfill_modes.Mode.parse(name) for name in plan["backfill_modes"]],
        plan["backfill_mode_writes"],
        plan["backfill_mode_backlog"],
        plan["backfill_mode_rounds"],
        plan["backfill_pace_s"],
    )
    return result


def _brainlayer_env(root: Path) -> dict[str, str] | str:
    """BrainLayer's paths inside ``root`` (as the tests set them), or why it cannot run."""
    try:
        from outbox.sinks.brainlayer import load_api

        load_api()
        sys.path.insert(0, str(REPO))
        from tests.brainlayer_env import brainlayer_environ
    except ImportError as exc:
        return f"BrainLayer unavailable: {exc}"
    (root / "home").mkdir(parents=True, exist_ok=True)
    return brainlayer_environ(root)


def section_drain(folder: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """Dispatcher processes per sink; the dispatcher's share of one in-process drain per
    sink; and each sink's own library called directly, with no outbox."""
    from outbox.sinks.chroma import ChromaSink
    from outbox.testing.sinks import NoopSink

    runs: list[dict[str, Any]] = []
    share: dict[str, Any] = {}
    raw: dict[str, Any] = {}

    def processes_run(name: str, sinks: str, records: int, processes: int, **options: Any) -> None:
        target = folder / name
        settings = bench_settings(target, sinks=sinks, **options.pop("settings", {}))
        log(f"  drain {name}: prefill {records}, then {processes} dispatcher process(es)")
        drain.prefill(settings, records, seed=21)
        result = drain.drain_run(
            settings, settings.sinks[0], records, processes, target / "logs", **options
        )
        result["name"] = name
        runs.append(result)

    def share_run(name: str, sinks: str, records: int, make_sink: Callable[[Any], Any]) -> None:
        log(f"  dispatcher share, {name}: {records} records in process")
        settings = bench_settings(folder / f"share-{name}", sinks=sinks)
        share[name] = drain.dispatcher_share(settings, make_sink(settings), records)

    processes_run("noop-2", NOOP_SINK, plan["drain_noop_records"], 2)
    share_run("noop", NOOP_SINK, plan["drain_noop_records"] // 4, NoopSink)
    records = plan["drain_chroma_records"]
    processes_run("chroma-embedded-1", "chroma", records, 1)
    share_run("chroma", "chroma", records, ChromaSink.from_settings)
    log("  raw: chromadb embed + upsert, no outbox")
    raw[RAW_CHROMADB] = drain.raw_chromadb(folder / "raw-chromadb", records)
    try:
        sys.path.insert(0, str(REPO))
        from tests.chroma_server import ChromaServer
    except ImportError as exc:
        raw["chroma server"] = f"no Chroma server helper: {exc}"
    else:
        for processes in (1, 2):
            with ChromaServer(folder / f"chroma-server-{processes}") as server:
                processes_run(
                    f"chroma-server-{processes}",
                    "chroma",
                    records,
                    processes,
                    settings={"chroma_url": server.url},
                    extra_env={"OUTBOX_CHROMA_URL": server.url},
                )
    env = _brainlayer_env(folder / "brainlayer")
    if isinstance(env, str):
        raw["brainlayer"] = env
    else:
        from outbox.sinks.brainlayer import BrainLayerSink

        records = plan["drain_brainlayer_records"]
        for processes in (1, 2):
            db = folder / "brainlayer" / f"drain-{processes}.db"
            processes_run(
                f"brainlayer-{processes}",
                "brainlayer",
                records,
                processes,
                settings={"brainlayer_db": db},
                extra_env={**env, "OUTBOX_BRAINLAYER_DB": str(db)},
            )
        with environment(env):
            share_run(
                "brainlayer",
                "brainlayer",
                records,
                lambda _settings: BrainLayerSink(folder / "brainlayer" / "share.db"),
            )
            log("  raw: brainlayer store_memory, no outbox")
            raw["brainlayer store_memory"] = drain.raw_store_memory(
                folder / "brainlayer" / "raw-direct.db", records
            )
    return {"runs": runs, "share": share, "raw": raw}


def section_embed(folder: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """The Chroma drain of LoCoMo turns beside the embedder's best cut on them (issue 24)."""
    from benchmarks.recall import DEFAULT_LOCOMO

    if not DEFAULT_LOCOMO.exists():
        return {"skipped": f"no LoCoMo file at {DEFAULT_LOCOMO}"}
    return embed_drain.run(folder, DEFAULT_LOCOMO, plan["embed_turns"], plan["embed_rounds"], None)


def section_scale(folder: Path, plan: dict[str, Any]) -> list[dict[str, Any]]:
    return scale.run(
        folder,
        plan["scale_sizes"],
        plan["scale_adds"],
        plan["scale_claims"],
        plan["scale_lookups"],
    )


def section_rss(folder: Path, plan: dict[str, Any]) -> dict[str, Any]:
    records = plan["rss_records"]
    settings = bench_settings(folder)
    log(f"  rss: prefill {records} through add_many")
    prefill_s = drain.prefill(settings, records, seed=61)
    log("  rss: one dispatcher draining into the no-op sink")
    result = drain.drain_run(settings, NOOP_SINK, records, 1, folder / "logs")
    result["prefill_s"] = prefill_s
    return result


def section_startup(folder: Path, plan: dict[str, Any]) -> dict[str, Any]:
    return startup.run(folder, plan["startup_rounds"], plan["startup_search_records"])


RUNNERS: dict[str, Callable[[Path, dict[str, Any]], Any]] = {
    "write": section_write,
    "threads": section_threads,
    "writers": section_writers,
    "inline": section_inline,
    "backfill": section_backfill,
    "drain": section_drain,
    "embed": section_embed,
    "scale": section_scale,
    "rss": section_rss,
    "startup": section_startup,
}


# -- reading the figures -----------------------------------------------------------------


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("inf")


def goals(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal of the issue with its measured ratio and whether this run met it."""
    found: list[dict[str, Any]] = []

    def goal(name: str, value: float, limit: float, met: bool, detail: str) -> None:
        found.append(
            {"goal": name, "value": round(value, 3), "limit": limit, "met": met, "detail": detail}
        )

    def throughput(table: dict[str, Any], where: str, detail: str) -> None:
        for rival in ("persist-queue put", "litequeue put"):
            ratio = _ratio(table["add"]["per_s"], table[rival]["per_s"])
            goal(f"add throughput / {rival}{where} (FULL)", ratio, 1.0, ratio >= 1.0, detail)

    write = results.get("write", {})
    if write:
        full = write["FULL"]
        ratio = _ratio(full["add"]["median_us"], full["floor"]["median_us"])
        goal(
            "add median / bare commit floor of its own rows (FULL)",
            ratio,
            GOAL_FLOOR_RATIO,
            ratio <= GOAL_FLOOR_RATIO,
            "one record per call, same rows, same synchronous",
        )
        ratio = _ratio(full["add"]["median_us"], full["mission floor"]["median_us"])
        goal(
            "add median / mission floor: one node row + one outbox row (FULL)",
            ratio,
            GOAL_MISSION_FLOOR_RATIO,
            ratio <= GOAL_MISSION_FLOOR_RATIO,
            "bare sqlite3, WAL, two small tables",
        )
        if "same-work floor" in full:
            ratio = _ratio(full["add"]["median_us"], full["same-work floor"]["median_us"])
            goal(
                "add median / same-work floor: node row + outbox row + FTS entry (FULL)",
                ratio,
                GOAL_SAME_WORK_RATIO,
                ratio <= GOAL_SAME_WORK_RATIO,
                "issue 24: bare sqlite3, WAL, the outbox's FTS tokenizer",
            )
        throughput(full, "", "writes per second, one per call, back to back")
    overlapping = results.get("threads")
    if overlapping:
        most = max(overlapping, key=int)
        ratio = _ratio(
            overlapping[most]["add"]["per_s"], overlapping["1"]["persist-queue put"]["per_s"]
        )
        goal(
            f"add throughput, {most} writer threads / persist-queue put, one writer (FULL)",
            ratio,
            1.0,
            ratio >= 1.0,
            "writes per second, same run",
        )
    bulk = results.get("writers")
    if bulk:
        one_put = bulk["batches"]["persist-queue put"]["per_s"]
        for size in writers.BATCH_SIZES:
            ratio = _ratio(bulk["batches"][f"add_many {size}"]["per_s"], one_put)
            goal(
                f"add_many of {size:,} / persist-queue put, one writer (FULL)",
                ratio,
                1.0,
                ratio >= 1.0,
                "records per second, alternating rounds, same run",
            )
        scaled = bulk["processes"]["add"].get("2")
        if scaled:
            goal(
                "add, 2 writer processes / 1 process, one store (FULL)",
                scaled["scaling"],
                GOAL_PROCESS_SCALING,
                scaled["scaling"] >= GOAL_PROCESS_SCALING,
                "records per second, alternating rounds; persist-queue "
                f"{bulk['processes']['persist-queue put']['2']['scaling']:.2f}x, litequeue "
                f"{bulk['processes']['litequeue put']['2']['scaling']:.2f}x",
            )
    backfill = results.get("backfill")
    if backfill:
        ratio = _ratio(backfill["busy"]["p99_us"], backfill["idle"]["p99_us"])
        clean = backfill["errors"] == 0 and backfill["fallbacks"] == 0
        goal(
            "add p99 during backfill / idle p99",
            ratio,
            GOAL_BACKFILL_P99_RATIO,
            ratio <= GOAL_BACKFILL_P99_RATIO and clean,
            f"errors {backfill['errors']}, fallbacks {backfill['fallbacks']}",
        )
        for mode, rows in backfill_modes.by_mode(backfill.get("modes", {})).items():
            ratio = max(row["p99_ratio"] for row in rows)
            clean = all(backfill_modes.clean(row) for row in rows)
            goal(
                f"add p99 beside {backfill_modes.DESCRIBED.get(mode, mode)} / idle p99",
                ratio,
                GOAL_BACKFILL_P99_RATIO,
                ratio <= GOAL_BACKFILL_P99_RATIO and clean,
                f"the worst of {len(rows)} rounds, writer in its own process"
                if mode != "inproc"
                else f"the worst of {len(rows)} rounds",
            )
        lag = backfill.get("idle_mirror_lag", {})
        if lag.get("records"):
            goal(
                "mirror lag p99 (commit to written files), idle, ms",
                lag["p99_ms"],
                GOAL_MIRROR_LAG_P99_MS,
                lag["p99_ms"] < GOAL_MIRROR_LAG_P99_MS,
                f"{lag['records']:,} paced writes, no dispatcher",
            )
    started = results.get("startup")
    if started:
        for command in ("outbox --help", "outbox add"):
            own = started[command]["above_python_ms"]
            goal(
                f"{command}: ms above python -c pass",
                own,
                GOAL_START_MS,
                own < GOAL_START_MS,
                f"medians of {started[command]['runs']} alternating runs",
            )
        search = started.get("outbox search")
        if search:
            goal(
                "outbox search: median wall ms",
                search["median_ms"],
                GOAL_SEARCH_MS,
                search["median_ms"] < GOAL_SEARCH_MS,
                f"{search['records']:,} records, shared Chroma server up, "
                f"p90 {search['p90_ms']:.0f} ms",
            )
    inline = results.get("inline")
    if inline and write:
        ratio = _ratio(inline["inline"]["median_us"], write["FULL"]["add"]["median_us"])
        goal(
            "inline embed+add median / add median (FULL)",
            ratio,
            GOAL_INLINE_SPEEDUP,
            ratio >= GOAL_INLINE_SPEEDUP,
            "how many times faster add is",
        )
    drains = results.get("drain")
    if drains and "chroma" in drains["share"]:
        chroma = drains["share"]["chroma"]
        goal(
            "dispatcher overhead / the sink's embed + upsert (Chroma)",
            chroma["overhead"],
            GOAL_DISPATCHER_OVERHEAD,
            chroma["overhead"] <= GOAL_DISPATCHER_OVERHEAD,
            f"{chroma['dispatcher_ms_per_record']:.2f} ms against "
            f"{chroma['sink_ms_per_record']:.2f} ms per record, one in-process drain",
        )
    embedded = results.get("embed")
    if embedded and "ratio" in embedded:
        goal(
            "Chroma drain / the embedder's best, same LoCoMo turns",
            embedded["ratio"],
            embed_drain.GOAL,
            embedded["met"],
            f"{embedded['drain_per_s']['after']:.1f} against {embedded['best_per_s']:.1f} "
            f"texts/s ({embedded['best_cut']}), nice {embedded['nice']}",
        )
    rss = results.get("rss")
    if rss:
        goal(
            "no-op drain, one dispatcher on SQLite: records per second",
            rss["per_s"],
            GOAL_NOOP_DRAIN_PER_S,
            rss["per_s"] >= GOAL_NOOP_DRAIN_PER_S,
            f"{rss['records']:,} records, one dispatcher process",
        )
    sizes = results.get("scale")
    if sizes and len(sizes) > 1:
        for key, label in (("add", "add median"), ("claim", "claim median")):
            ratio = _ratio(sizes[-1][key]["median_us"], sizes[0][key]["median_us"])
            goal(
                f"{label} at {sizes[-1]['rows']:,} / at {sizes[0]['rows']:,} rows",
                ratio,
                GOAL_SCALE_RATIO,
                ratio <= GOAL_SCALE_RATIO,
                "flat means within 1.5x",
            )
    return found


def _ms(us: float) -> str:
    return f"{us / 1000:.3f}" if us < 10_000 else f"{us / 1000:.1f}"


def report(results: dict[str, Any]) -> str:
    """The tables, as GitHub markdown (also readable on a terminal)."""
    lines: list[str] = []
    write = results.get("write")
    if write:
        for level, table in write.items():
            floor = table["floor"]["median_us"]
            lines += [
                f"\n### Write path, synchronous={level} (per record)\n",
                "| path | median ms | p99 ms | per second | median / floor |",
                "|---|---:|---:|---:|---:|",
            ]
            for name, stats in table.items():
                if name in ("pragmas", "breakdown", "mirror_lag"):
                    continue
                lines.append(
                    f"| {name} | {_ms(stats['median_us'])} | {_ms(stats['p99_us'])} | "
                    f"{stats['per_s']:,.0f} | {stats['median_us'] / floor:.2f}x |"
                )
            lines.append(f"\nsynchronous read back from each connection: {table['pragmas']}")
            lag = table["mirror_lag"]
            lines.append(
                f"\nMirror lag of the add rows (commit to written files, {lag['records']:,} "
                f"records): median {lag['median_ms']:.2f} ms, p99 {lag['p99_ms']:.2f} ms, "
                f"max {lag['max_ms']:.1f} ms."
            )
            steps = table["breakdown"]
            lines += [
                f"\nWhere one add spends its time at {level} (medians, µs; floor median "
                f"{floor:.0f} µs):\n",
                "| step | µs |",
                "|---|---:|",
                *(f"| {step} | {value:.0f} |" for step, value in steps.items()),
            ]
    overlapping = results.get("threads")
    if overlapping:
        lines += [
            "\n### Writer threads in one process (synchronous=FULL)\n",
            "| threads | path | writes | per second | median ms | p99 ms | per second / floor |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for count, table in overlapping.items():
            floor = table["floor"]["per_s"]
            for name, stats in table.items():
                lines.append(
                    f"| {count} | {name} | {stats['writes']:,} | {stats['per_s']:,.0f} | "
                    f"{_ms(stats['median_us'])} | {_ms(stats['p99_us'])} | "
                    f"{stats['per_s'] / floor:.2f}x |"
                )
    bulk = results.get("writers")
    if bulk:
        one_put = bulk["batches"]["persist-queue put"]["per_s"]
        lines += [
            "\n### Bulk writes: add_many beside one queue writer (synchronous=FULL)\n",
            "| path | records | records/s | median ms per call | / persist-queue put |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {name} | {stats['records']:,} | {stats['per_s']:,.0f} | "
                f"{stats['call_median_ms']:.2f} | {stats['per_s'] / one_put:.2f}x |"
                for name, stats in bulk["batches"].items()
            ),
            "\n### Writer processes on one store (synchronous=FULL)\n",
            "| processes | path | writes | records/s | / one process | CPU µs per record "
            "| p99 ms | max ms |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, table in bulk["processes"].items():
            lines += [
                f"| {count} | {name} | {stats['writes']:,} | {stats['per_s']:,.0f} | "
                f"{stats['scaling']:.2f}x | {stats['cpu_us_per_record']:,.0f} | "
                f"{stats.get('p99_ms', 0.0):.1f} | {stats.get('max_ms', 0.0):.1f} |"
                for count, stats in table.items()
            ]
    inline = results.get("inline")
    if inline:
        add = write["FULL"]["add"]["median_us"] if write else None
        lines += [
            "\n### Inline embed + collection.add (embedded Chroma, MiniLM int8)\n",
            "| path | median ms | p99 ms | per second | median / add (FULL) |",
            "|---|---:|---:|---:|---:|",
        ]
        for name in ("inline", "embed_only"):
            stats = inline[name]
            versus = f"{stats['median_us'] / add:.1f}x" if add else "-"
            lines.append(
                f"| {name.replace('_', ' ')} | {_ms(stats['median_us'])} | "
                f"{_ms(stats['p99_us'])} | {stats['per_s']:,.0f} | {versus} |"
            )
    backfill = results.get("backfill")
    if backfill:
        idle, busy = backfill["idle"], backfill["busy"]
        lines += [
            f"\n### add during a {backfill['records']:,}-record backfill into embedded Chroma"
            f" (one write every {backfill['pace_ms']:.0f} ms)\n",
            "| phase | writes | median ms | p99 ms | max ms | errors | fallbacks |",
            "|---|---:|---:|---:|---:|---:|---:|",
            f"| idle | {idle['calls']} | {_ms(idle['median_us'])} | {_ms(idle['p99_us'])} | "
            f"{_ms(idle['max_us'])} | {backfill['idle_errors']} | {backfill['idle_fallbacks']} |",
            f"| backfill | {busy['calls']} | {_ms(busy['median_us'])} | {_ms(busy['p99_us'])} | "
            f"{_ms(busy['max_us'])} | {backfill['errors']} | {backfill['fallbacks']} |",
            f"| of which waiting for the mirror lock, idle | | "
            f"{_ms(backfill['idle_lock_wait']['median_us'])} | "
            f"{_ms(backfill['idle_lock_wait']['p99_us'])} | "
            f"{_ms(backfill['idle_lock_wait']['max_us'])} | | |",
            f"| of which waiting for the mirror lock, backfill | | "
            f"{_ms(backfill['busy_lock_wait']['median_us'])} | "
            f"{_ms(backfill['busy_lock_wait']['p99_us'])} | "
            f"{_ms(backfill['busy_lock_wait']['max_us'])} | | |",
            *(
                f"| mirror lag (commit to files), {phase} | {lag['records']:,} | "
                f"{lag['median_ms']:.3f} | {lag['p99_ms']:.3f} | {lag['max_ms']:.1f} | | |"
                for phase, lag in (
                    ("idle", backfill["idle_mirror_lag"]),
                    ("backfill", backfill["busy_mirror_lag"]),
                )
            ),
            f"\np99 ratio {busy['p99_us'] / idle['p99_us']:.2f}x, median ratio "
            f"{busy['median_us'] / idle['median_us']:.2f}x; the dispatcher drained "
            f"{backfill['drain_per_s']:,.0f} records/s ({backfill['drain_wall_s']:.0f} s from "
            f"launch to the last record).",
        ]
        if backfill.get("modes"):
            lines += ["", backfill_modes.table(backfill["modes"])]
    drains = results.get("drain")
    if drains:
        lines += [
            "\n### Drain throughput (steady state, records/s)\n",
            "| sink | dispatcher processes | records | records/s | wall s | not delivered |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        rss = results.get("rss")
        rows = ([rss | {"name": "noop-1"}] if rss else []) + drains["runs"]
        for run in rows:
            lines.append(
                f"| {run['name']} | {run['processes']} | {run['records']:,} | "
                f"{run['per_s']:,.0f} | {run['wall_s']:.1f} | {run['not_delivered']} |"
            )
        for name, value in drains["raw"].items():
            if isinstance(value, dict):
                lines.append(
                    f"| raw: {name}, no outbox | - | {value['records']:,} | "
                    f"{value['per_s']:,.0f} | {value['wall_s']:.1f} | - |"
                )
            else:
                lines.append(f"| {name} | {value} | | | | |")
        lines += [
            "\n### The dispatcher's share of a drain (one in-process drain per sink)\n",
            "| sink | records | records/s | sink ms/record | dispatcher ms/record "
            "| dispatcher / sink |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, value in drains["share"].items():
            ratio = f"{value['overhead']:.1%}" if value["sink_s"] > 0.01 * value["wall_s"] else "-"
            lines.append(
                f"| {name} | {value['records']:,} | {value['per_s']:,.0f} | "
                f"{value['sink_ms_per_record']:.3f} | {value['dispatcher_ms_per_record']:.3f} | "
                f"{ratio} |"
            )
    embedded = results.get("embed")
    if embedded and "ratio" in embedded:
        lines += [
            f"\n### The Chroma drain beside the embedder ({embedded['texts']} LoCoMo turns, "
            f"batches of {embedded['batch']}, nice {embedded['nice']}, "
            f"{embedded['rounds']} alternating rounds)\n",
            "| what | texts/s | / the embedder's best |",
            "|---|---:|---:|",
        ]
        best = embedded["best_per_s"]
        for name, rate in embedded["embedder_per_s"].items():
            lines.append(f"| embedder alone, {name} | {rate:.1f} | {rate / best:.2f}x |")
        for name, rate in embedded["drain_per_s"].items():
            lines.append(
                f"| `outbox run` into Chroma, embedder {name} | {rate:.1f} | {rate / best:.2f}x |"
            )
    sizes = results.get("scale")
    if sizes:
        base = sizes[0]
        lines += [
            "\n### Scale (rows in the outbox, all pending; medians, ms)\n",
            "| rows | build s | db MiB | add | add p99 | claim 64 | settle 64 "
            "| pending FTS lookup | add / smallest | claim / smallest |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for entry in sizes:
            lines.append(
                f"| {entry['rows']:,} | {entry['build_s']:.0f} | {entry['db_mib']:,.0f} | "
                f"{_ms(entry['add']['median_us'])} | {_ms(entry['add']['p99_us'])} | "
                f"{_ms(entry['claim']['median_us'])} | {_ms(entry['settle']['median_us'])} | "
                f"{_ms(entry['pending_matches']['median_us'])} | "
                f"{entry['add']['median_us'] / base['add']['median_us']:.2f}x | "
                f"{entry['claim']['median_us'] / base['claim']['median_us']:.2f}x |"
            )
    started = results.get("startup")
    if started:
        lines += [
            "\n### Start of the command line (real processes, alternating rounds)\n",
            "| command | median ms | p90 ms | min ms | above python -c pass, ms |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {name} | {value['median_ms']:.1f} | {value.get('p90_ms', 0.0):.1f} | "
                f"{value['min_ms']:.1f} | {value['above_python_ms']:.1f} |"
                for name, value in started.items()
            ),
        ]
    rss = results.get("rss")
    if rss:
        lines.append(
            f"\nPeak RSS of one dispatcher draining {rss['records']:,} records into the no-op "
            f"sink: {', '.join(f'{value} MiB' for value in rss['peak_rss_mib'])}."
        )
    found = results.get("goals")
    if found:
        lines += ["\n### Goals\n", "| goal | measured | limit | met |", "|---|---:|---:|---|"]
        for entry in found:
            lines.append(
                f"| {entry['goal']} | {entry['value']:.2f} | {entry['limit']} | "
                f"{'yes' if entry['met'] else 'no'} ({entry['detail']}) |"
            )
    return "\n".join(lines)


def draw(results: dict[str, Any], img_dir: Path) -> list[str]:
    img_dir.mkdir(parents=True, exist_ok=True)
    drawn: list[str] = []
    curves: dict[str, list[float]] = {}
    if "backfill" in results:
        backfill = results["backfill"]
        curves[f"add, idle ({backfill['idle']['calls']:,} writes)"] = backfill["idle_curve_ms"]
        curves[f"add, during the backfill ({backfill['busy']['calls']:,} writes)"] = backfill[
            "busy_curve_ms"
        ]
    if "inline" in results:
        inline = results["inline"]
        label = f"inline embed + collection.add ({inline['inline']['calls']:,} writes)"
        curves[label] = inline["curve_ms"]
    if curves:
        records = results.get("backfill", {}).get("records", 0)
        plots.latency_figure(
            curves,
            img_dir / plots.LATENCY_PNG,
            f"One memory write: add idle, add during a {records:,}-record backfill, inline",
        )
        drawn.append(plots.LATENCY_PNG)
    if "drain" in results:
        bars: list[tuple[str, float]] = []
        if "rss" in results:
            bars.append(("no-op, 1 process", results["rss"]["per_s"]))
        for run in results["drain"]["runs"]:
            sink = run["name"].rsplit("-", 1)[0].replace("noop", "no-op")
            plural = "es" if run["processes"] > 1 else ""
            bars.append((f"{sink}, {run['processes']} process{plural}", run["per_s"]))
        for name, value in results["drain"]["raw"].items():
            if isinstance(value, dict):
                bars.append((f"raw: {name}", value["per_s"]))
        plots.drain_figure(bars, img_dir / plots.DRAIN_PNG)
        drawn.append(plots.DRAIN_PNG)
    if results.get("scale"):
        plots.scale_figure(results["scale"], img_dir / plots.SCALE_PNG)
        drawn.append(plots.SCALE_PNG)
    return drawn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma list of sections")
    parser.add_argument("--dir", type=Path, help="scratch folder (default: a new temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/latest.json")
    parser.add_argument("--img-dir", type=Path, default=REPO / "docs/img")
    parser.add_argument(
        "--replot", action="store_true", help="redraw figures and tables from --out; no run"
    )
    args = parser.parse_args(argv)
    if args.replot:
        stored: dict[str, Any] = json.loads(args.out.read_text(encoding="utf-8"))
        stored["figures"] = draw(stored, args.img_dir)
        tables = report(stored)
        args.out.with_suffix(".md").write_text(tables.lstrip() + "\n", encoding="utf-8")
        print(tables)
        return 0
    wanted = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="outbox-bench-", dir=args.dir))
    began = time.monotonic()
    results: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.compare" + (" --quick" if args.quick else ""),
        "plan": plan,
        "scratch": str(scratch),
        "load_before": load_average(),
    }
    try:
        results["machine"] = machine(scratch)
        durations: dict[str, float] = {}
        failures: dict[str, str] = {}
        for name in wanted:
            log(f"{name} ...")
            tick = time.monotonic()
            try:
                results[name] = RUNNERS[name](scratch / name, plan)
            except Exception as exc:  # one broken section must not cost the others' figures
                failures[name] = f"{type(exc).__name__}: {exc}"
                log(f"{name} FAILED: {failures[name]}")
            durations[name] = round(time.monotonic() - tick, 1)
            log(f"{name} done in {durations[name]:.0f} s")
        results["durations_s"] = durations
        results["failures"] = failures
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    results["load_after"] = load_average()
    results["elapsed_s"] = round(time.monotonic() - began, 1)
    results["goals"] = goals(results)
    results["figures"] = draw(results, args.img_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    tables = report(results)
    args.out.with_suffix(".md").write_text(tables.lstrip() + "\n", encoding="utf-8")
    print(tables)
    for name, failure in results.get("failures", {}).items():
        print(f"\nsection {name} failed: {failure}")
    print(f"\n{results['elapsed_s']:.0f} s; results in {args.out}; figures in {args.img_dir}")
    return 1 if results.get("failures") else 0


if __name__ == "__main__":
    raise SystemExit(main())
