"""``add`` while a backfill embeds, the ways a user meets it: the backlog drained by ``outbox
drain`` or ``outbox run`` in another process with the daemon's default settings, or by a
dispatcher thread inside the writer's own process (issue 24).

    python -m benchmarks.backfill_modes [--writes 1000] [--backlog 3000] [--rounds 2]
        [--modes drain,run,inproc] [--raise-priority 20] [--save] [--json]

Each mode gets a fresh store holding ``--backlog`` undelivered records bound for embedded
Chroma with the package's MiniLM model. The writer (this process) times paced ``Outbox.add``
calls, one every 10 ms: half of ``--writes`` with nothing draining, then ``--writes`` once the
drainer has delivered a first batch (busy), then the other idle half after the drainer
stopped. Idle and busy come from the same minutes of the same run, so their ratio is not a
comparison between two moments of a shared machine. Each write is split into the wait for
the mirror lock, ``BEGIN IMMEDIATE``, the statements, ``COMMIT`` and the rest, and the slowest
1% of each phase is reported by those parts. A mode may carry ``+NAME=VALUE`` settings for
its drainer (``drain+OUTBOX_RUN_NICE=0`` is the drain before it lowered its priority) and
``@TREE`` for a drainer process running another checkout's ``outbox``, so a change is
measured against what it replaced in one run, the modes alternating round by round.
``--raise-priority`` lifts the writer and its drainers above other users' CPU load (not
their disk load), keeping their priorities relative to each other.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    bench_settings,
    environment,
    head_commit,
    load_average,
    memories,
    open_outbox,
    outbox_environ,
    percentile,
    write_result,
)
from benchmarks.drain import counts, prefill
from outbox import Outbox, Settings
from outbox.sinks.chroma_service import SharedServer, read_state

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "backfill-modes.json"
PACE = 0.01
STARTED = 64  # delivered records that show the embedder is under way
GOAL = 2.0
KINDS = ("drain", "run", "inproc")
DESCRIBED = {
    "drain": "an outbox drain process",
    "run": "an outbox run process",
    "inproc": "a dispatcher thread in the writer's process",
}


@dataclass
class Mode:
    """A drainer: ``kind`` (``drain``, ``run`` or ``inproc``) and settings it runs with."""

    kind: str
    env: dict[str, str] = field(default_factory=dict)
    tree: str | None = None  # a drainer process runs the outbox package found there

    @classmethod
    def parse(cls, text: str) -> Mode:
        """``KIND[+NAME=VALUE...][@TREE]``: TREE, a checkout of another commit, is where a
        drainer process imports ``outbox`` from (before and after a change, in one run)."""
        text, _, tree = text.partition("@")
        kind, *pairs = text.split("+")
        if kind not in KINDS or (tree and kind == "inproc"):
            raise SystemExit(f"unknown mode {text!r}: one of {', '.join(KINDS)} (@ not inproc)")
        return cls(kind, dict(pair.split("=", 1) for pair in pairs), tree or None)

    @property
    def name(self) -> str:
        name = "+".join([self.kind, *(f"{k}={v}" for k, v in self.env.items())])
        return f"{name}@{Path(self.tree).name}" if self.tree else name


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds ``pid`` has used so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _nice(pid: int) -> int | None:
    """Field 19 of ``/proc/<pid>/stat``: the process's nice value."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
    except OSError:
        return None


PARTS = ("mirror_lock", "begin", "body", "commit")


class _Paced:
    """Paced ``add`` calls of one writer, each timed, and split into where the time went:
    the wait for the mirror lock, ``BEGIN IMMEDIATE`` (the wait for the database's write
    lock), the statements, and ``COMMIT`` (the fsync, and a WAL checkpoint when one lands on
    it); the rest is Python around them. What did not come back ``queued`` is counted."""

    def __init__(self, outbox: Outbox, pace: float) -> None:
        self.outbox = outbox
        self.pace = pace
        self.texts = memories(500, seed=62)
        self.number = 0
        self.errors = 0
        self.fallbacks = 0
        self.parts: dict[str, float] = {}
        hold = outbox.mirrors.lock.hold
        transaction = outbox.writer.transactions.transaction

        @contextlib.contextmanager
        def timed_hold(deadline: float | None = None, **options: Any) -> Iterator[None]:
            tick = time.perf_counter()
            with hold(deadline, **options):
                self.parts["mirror_lock"] = time.perf_counter() - tick
                yield

        @contextlib.contextmanager
        def timed_transaction(lock_wait: float | None) -> Iterator[Any]:
            tick = time.perf_counter()
            with transaction(lock_wait) as conn:
                began = time.perf_counter()
                yield conn
                done = time.perf_counter()
            self.parts.update(begin=began - tick, body=done - began)
            self.parts["commit"] = time.perf_counter() - done

        outbox.mirrors.lock.hold = timed_hold  # type: ignore[method-assign]
        outbox.writer.transactions.transaction = timed_transaction  # type: ignore[method-assign]

    def phase(self, count: int) -> list[tuple[float, ...]]:
        """(total, *PARTS) seconds of each of ``count`` paced writes."""
        samples: list[tuple[float, ...]] = []
        for _ in range(count):
            text = self.texts[self.number % len(self.texts)]
            self.parts = dict.fromkeys(PARTS, 0.0)
            tick = time.perf_counter()
            try:
                receipt = self.outbox.add(f"turn {self.number}: {text}", tags=["turn"])
            except Exception:
                self.errors += 1
            else:
                self.fallbacks += receipt.status != "queued"
            took = time.perf_counter() - tick
            samples.append((took, *(self.parts[part] for part in PARTS)))
            self.number += 1
            time.sleep(max(0.0, self.pace - took))
        return samples


@contextlib.contextmanager
def _drainer(mode: Mode, settings: Settings, outbox: Outbox, log: Path) -> Iterator[int]:
    """The backlog's drainer running for the block; yields the pid doing the embedding."""
    if mode.kind == "inproc":
        stop = threading.Event()
        with environment(mode.env), outbox.dispatcher() as dispatcher:
            thread = threading.Thread(target=dispatcher.run, args=(stop,), daemon=True)
            thread.start()
            try:
                yield os.getpid()
            finally:
                stop.set()
                thread.join(timeout=120)
        return
    command = [sys.executable, "-m", "outbox", mode.kind]
    with log.open("ab") as out:
        process = subprocess.Popen(
            command,
            cwd=mode.tree or REPO,
            env=outbox_environ(settings, **mode.env),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        yield process.pid
        if process.poll() is not None:
            raise RuntimeError(f"{mode.name} exited early ({process.returncode}); see {log}")
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _summary(samples: list[tuple[float, ...]]) -> dict[str, Any]:
    """Median, p99 and max of the writes in ms; and, over the slowest 1% of them, the mean
    of each part and of the rest (what the tail is made of)."""
    ms = [sample[0] * 1000 for sample in samples]
    tail = sorted(samples, reverse=True)[: max(1, len(samples) // 100)]
    made_of = {
        part: sum(row[i + 1] for row in tail) * 1000 / len(tail) for i, part in enumerate(PARTS)
    }
    made_of["python"] = sum(row[0] - sum(row[1:]) for row in tail) * 1000 / len(tail)
    return {
        "writes": len(ms),
        "median_ms": percentile(ms, 0.5),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms),
        "tail_ms": made_of,
    }


def measure(
    mode: Mode, folder: Path, writes: int, backlog: int, pace: float, sink: str = "chroma"
) -> dict[str, Any]:
    """One mode on a fresh store: idle writes, then the same number while the backlog drains."""
    settings = bench_settings(folder, sinks=sink)
    prefill(settings, backlog, seed=61)
    outbox = open_outbox(settings)
    writer = _Paced(outbox, pace)
    try:
        writer.phase(20)  # warm-up, untimed
        outbox.wait_mirrored()
        idle = writer.phase(writes // 2)  # half before the drainer, half after: load drifts
        outbox.wait_mirrored()
        with _drainer(mode, settings, outbox, folder / f"{mode.kind}.log") as pid:
            deadline = time.monotonic() + 600
            while counts(settings, sink).get("delivered", 0) < STARTED:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{mode.name} delivered nothing in 600 s")
                time.sleep(0.05)
            server = read_state(settings.chroma_path)
            pids = [pid] + ([server.pid] if server else [])
            cpu_before = [_cpu_seconds(p) for p in pids]
            nice = [_nice(p) for p in pids]
            began = time.monotonic()
            busy = writer.phase(writes)
            wall = time.monotonic() - began
            cpu = [_cpu_seconds(p) - c for p, c in zip(pids, cpu_before, strict=True)]
            left = counts(settings, sink)
        outbox.wait_mirrored()
        idle += writer.phase(writes - writes // 2)
    finally:
        outbox.close()
        with SharedServer(settings.chroma_path, 0.0).stopped():
            pass  # the server the drainer started ends with the mode
    idle_s, busy_s = _summary(idle), _summary(busy)
    return {
        "mode": mode.name,
        "idle": idle_s,
        "busy": busy_s,
        "p99_ratio": busy_s["p99_ms"] / idle_s["p99_ms"],
        "median_ratio": busy_s["median_ms"] / idle_s["median_ms"],
        "errors": writer.errors,
        "fallbacks": writer.fallbacks,
        "drainer_nice": nice[0],
        "server_nice": nice[1] if len(nice) > 1 else None,
        "drainer_cpu_share": cpu[0] / wall,
        "server_cpu_share": cpu[1] / wall if len(cpu) > 1 else 0.0,
        "busy_wall_s": wall,
        "pending_after": left.get("pending", 0) + left.get("leased", 0),
    }


def run(
    modes: list[Mode], writes: int, backlog: int, rounds: int, pace: float, sink: str = "chroma"
) -> dict[str, Any]:
    """Every mode once per round, in turn, each on its own fresh store."""
    load_start = load_average()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_number in range(rounds):
            for mode in modes:
                folder = Path(tmp) / f"r{round_number}-{mode.kind}-{len(results)}"
                row = measure(mode, folder, writes, backlog, pace, sink)
                row["round"] = round_number
                row["load"] = load_average()[0]
                results.append(row)
                print(_line(row), file=sys.stderr, flush=True)
    return {
        "commit": head_commit(),
        "started": started,
        "load_start": load_start,
        "load_end": load_average(),
        "writes": writes,
        "backlog": backlog,
        "sink": sink,
        "pace_ms": pace * 1000,
        "rounds": rounds,
        "cores": len(os.sched_getaffinity(0)),
        "writer_nice": os.nice(0),
        "runs": results,
    }


def clean(row: dict[str, Any]) -> bool:
    """No write failed or fell back, and the backlog outlasted the busy phase (else part of
    it was timed with nothing left to embed)."""
    return bool(row["errors"] == 0 and row["fallbacks"] == 0 and row["pending_after"] > 0)


def by_mode(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each mode's rows, one per round, in the order the modes ran."""
    found: dict[str, list[dict[str, Any]]] = {}
    for row in result.get("runs", []):
        found.setdefault(row["mode"], []).append(row)
    return found


def table(result: dict[str, Any]) -> str:
    """The markdown table docs/benchmarks.md shows: each mode's rounds, and whether the
    worst of them meets the goal."""
    lines = [
        f"Run `{result['commit']}`, {result['started']}, {result['cores']} cores, load "
        f"{result['load_start'][0]:.2f} at the start and {result['load_end'][0]:.2f} at the "
        f"end, writer nice {result['writer_nice']}, {result['writes']:,} writes per phase "
        f"every {result['pace_ms']:.0f} ms, a {result['backlog']:,}-record backlog, "
        f"{result['rounds']} round(s):\n",
        "| drainer | round | idle p99 ms | idle max ms | busy median ms | busy p99 ms | "
        "busy max ms | p99 ratio | drainer nice | drainer CPU | busy tail: mirror lock / "
        "db lock / commit / rest ms | goal 2x |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for mode, rows in by_mode(result).items():
        for row in rows:
            idle, busy = row["idle"], row["busy"]
            tail = busy["tail_ms"]
            met = row["p99_ratio"] <= GOAL and clean(row)
            lines.append(
                f"| {mode} | {row['round'] + 1} | {idle['p99_ms']:.2f} | {idle['max_ms']:.1f} | "
                f"{busy['median_ms']:.2f} | {busy['p99_ms']:.2f} | {busy['max_ms']:.1f} | "
                f"{row['p99_ratio']:.2f}x | {row['drainer_nice']} | "
                f"{row['drainer_cpu_share']:.2f} | {tail['mirror_lock']:.1f} / "
                f"{tail['begin']:.1f} / {tail['commit']:.1f} / {tail['python']:.1f} | "
                f"{'met' if met else 'not met'} |"
            )
    return "\n".join(lines)


def _line(row: dict[str, Any]) -> str:
    idle, busy = row["idle"], row["busy"]
    met = "met" if row["p99_ratio"] <= GOAL and clean(row) else "NOT met"
    return (
        f"{row['mode']:<28} idle p99 {idle['p99_ms']:6.2f} max {idle['max_ms']:6.1f} | busy "
        f"p99 {busy['p99_ms']:6.2f} max {busy['max_ms']:6.1f} median {busy['median_ms']:5.2f}"
        f" | {row['p99_ratio']:4.2f}x ({met}) | nice {row['drainer_nice']}/"
        f"{row['server_nice']}, drainer "
        f"{row['drainer_cpu_share']:.2f} cpu, server {row['server_cpu_share']:.2f} | left "
        f"{row['pending_after']} | load {row['load']:.2f} | err {row['errors']}/"
        f"{row['fallbacks']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=1000)
    parser.add_argument("--backlog", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pace", type=float, default=PACE)
    parser.add_argument("--modes", default=",".join(KINDS))
    parser.add_argument(
        "--sink",
        default="chroma",
        help="the sink drained into (the no-op sink isolates the lock and the database from "
        "the model)",
    )
    parser.add_argument(
        "--raise-priority",
        type=int,
        default=0,
        metavar="N",
        help="run this process (the writer) and every drainer it starts N nice steps above "
        "the rest of the machine (needs the right to), so other users' load weighs less while "
        "the writer and drainers keep their priorities relative to each other",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--save", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args()
    modes = [Mode.parse(text) for text in args.modes.split(",")]
    if args.raise_priority:
        os.nice(-args.raise_priority)
    result = run(modes, args.writes, args.backlog, args.rounds, args.pace, args.sink)
    if args.save:
        write_result(RESULTS, result)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(table(result))


if __name__ == "__main__":
    main()
