"""Recall's query latency at dataset size, one library version beside another in the same run.

The LoCoMo dev split is written through memory-core and drained into Chroma once (about a
minute; ``--store DIR`` keeps it for the next run). Each version then runs in a process of its
own (``recall_latency_worker.py``), opens the store and, round after round in turn (the order
reversed every round, so neither always follows the other), asks every question as
``query_raw_memories`` with default settings and a session filter. Before timing, each
version's answers are scored (hit@10, no floor and at the default floor; the unrelated
queries answered) and compared with the current one's: how many questions got other ids or
another order.

    python -m benchmarks.recall_latency --store DIR             # this version alone
    git archive COMMIT outbox | tar -x -C OLD                   # an earlier version...
    python -m benchmarks.recall_latency --store DIR --baseline before=OLD --rounds 8

Each version opens a copy of the drained store's database and Chroma folder of its own, so
each talks to the shared Chroma server its own code starts (one left running is stopped
first): what a version changed in the server counts for that version alone. Two copies of one
Chroma folder can answer one or two of the 382 questions differently even with the same code:
Chroma's approximate index, loaded again, does not always find the same 20th neighbour.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from benchmarks.common import (
    bench_settings,
    head_commit,
    load_average,
    open_outbox,
    outbox_environ,
    percentile,
    write_result,
)
from benchmarks.recall import DEFAULT_LOCOMO, UNRELATED, load, questions, score, write_turns
from outbox import Settings
from outbox.memory_core import MemoryService
from outbox.sinks.chroma_service import SharedServer
from outbox.store.sqlite_writes import sqlite_path

RESULTS = Path(__file__).with_name("results") / "recall-latency.json"
WORKER = Path(__file__).with_name("recall_latency_worker.py")
KEYS = "locomo-keys.json"
CURRENT = "current"
_SERVER_FILES = shutil.ignore_patterns("outbox-server.sock", "outbox-server.json")


def drained_store(folder: Path, locomo: Path) -> tuple[Settings, dict[tuple[str, str], str]]:
    """The store of the split's turns, all delivered to Chroma: written and drained once,
    then reused (its keys, by session and turn, are kept beside it)."""
    settings = bench_settings(folder, sinks="chroma", synchronous="NORMAL")
    saved = folder / KEYS
    if saved.exists():
        rows = json.loads(saved.read_text(encoding="utf-8"))
        return settings, {(session, turn): key for session, turn, key in rows}
    service = MemoryService(open_outbox(settings))
    try:
        keys = write_turns(service, load(locomo))
        report = service.outbox.drain(timeout=3600)
        if report.remaining["chroma"]["pending"]:
            raise RuntimeError(f"the store did not drain: {report.remaining}")
    finally:
        service.close()
    rows = [[session, turn, key] for (session, turn), key in keys.items()]
    saved.write_text(json.dumps(rows), encoding="utf-8")
    return settings, keys


def copied(folder: Path, settings: Settings, name: str) -> dict[str, str]:
    """The environment of a copy of the drained store's database and Chroma folder for one
    version alone (made once, kept with the store), with no Chroma server running on it. The
    copy shares the store's log and markdown folder, which recall only reads."""
    target = folder / "copies" / name
    database = sqlite_path(settings.db_url)
    assert database is not None
    if not target.exists():
        with SharedServer(settings.chroma_path, 0.0).stopped():
            shutil.copytree(settings.chroma_path, target / "chroma", ignore=_SERVER_FILES)
            for part in database.parent.glob(database.name + "*"):
                shutil.copy2(part, target / part.name)
    with SharedServer(target / "chroma", 0.0).stopped():
        pass  # the version's own code starts its server
    return outbox_environ(
        settings,
        OUTBOX_DB_URL=f"sqlite:///{target / database.name}",
        OUTBOX_CHROMA_PATH=str(target / "chroma"),
    )


class Worker:
    """One version's process, asked for a round or its answers a line at a time."""

    def __init__(self, name: str, env: dict[str, str], task: Path, cwd: Path) -> None:
        self.name = name
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), str(task)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=cwd,
            text=True,
        )
        self._read()  # ready: opened and warmed up

    def ask(self, what: str) -> dict[str, Any]:
        stdin: IO[str] | None = self.process.stdin
        assert stdin is not None
        stdin.write(what + "\n")
        stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited {self.process.wait()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def run(folder: Path, locomo: Path, rounds: int, baselines: dict[str, Path]) -> dict[str, Any]:
    """Each version's p50 and p99 over every round, its p50 per round, and its answers'
    agreement with the current version's."""
    settings, keys = drained_store(folder, locomo)
    asked = questions(load(locomo), keys)
    task = folder / "task.json"
    task.write_text(
        json.dumps(
            {"questions": [[q.session, q.text] for q in asked], "unrelated": list(UNRELATED)}
        ),
        encoding="utf-8",
    )
    copies = {name: copied(folder, settings, name) for name in [CURRENT, *baselines]}
    versions = {CURRENT: copies[CURRENT]} | {
        name: dict(copies[name], PYTHONPATH=str(path.resolve())) for name, path in baselines.items()
    }
    workers: list[Worker] = []
    try:
        for name, environ in versions.items():
            workers.append(Worker(name, environ, task, folder))
        found = {worker.name: worker.ask("answers") for worker in workers}
        samples: dict[str, list[float]] = {worker.name: [] for worker in workers}
        per_round: dict[str, list[float]] = {worker.name: [] for worker in workers}
        for number in range(rounds):
            for worker in workers if number % 2 == 0 else workers[::-1]:
                ms = worker.ask("round")["ms"]
                samples[worker.name].extend(ms)
                per_round[worker.name].append(round(percentile(ms, 0.5), 2))
    finally:
        for worker in workers:
            worker.close()
        for env in copies.values():
            with SharedServer(Path(env["OUTBOX_CHROMA_PATH"]), 0.0).stopped():
                pass  # each server ends with the run
    reference = found[CURRENT]
    figures: dict[str, Any] = {}
    for name, values in samples.items():
        figures[name] = {
            "p50_ms": round(percentile(values, 0.5), 2),
            "p99_ms": round(percentile(values, 0.99), 2),
            "p50_per_round_ms": per_round[name],
            "calls": len(values),
            "hit@10": score(found[name]["fused"], asked)["hit@10"],
            "hit@10, default floor": score(found[name]["default floor"], asked)["hit@10"],
            "unrelated answered": sum(bool(ids) for ids in found[name]["unrelated"]),
            "answers unlike current's": {
                part: sum(a != b for a, b in zip(answers, reference[part], strict=True))
                for part, answers in found[name].items()
            },
        }
    for name in baselines:
        figures[name]["p50 current / this"] = round(
            figures[CURRENT]["p50_ms"] / figures[name]["p50_ms"], 3
        )
    return {"questions": len(asked), "rounds": rounds, "versions": figures}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.recall_latency", description=__doc__
    )
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO, help="the LoCoMo JSON")
    parser.add_argument("--store", type=Path, help="a folder to fill and drain once, and keep")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds of every question")
    parser.add_argument("--baseline", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not args.locomo.exists():
        parser.error(f"no LoCoMo file at {args.locomo}")
    baselines = {
        name: Path(folder) for name, folder in (entry.split("=", 1) for entry in args.baseline)
    }
    result: dict[str, Any] = {"commit": head_commit(), "load_average": list(load_average())}
    with tempfile.TemporaryDirectory(prefix="recall-latency-") as scratch:
        folder = args.store or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        result.update(run(folder, args.locomo, args.rounds, baselines))
    result["load_average_after"] = list(load_average())
    write_result(args.out, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
