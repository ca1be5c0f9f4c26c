"""One ``python -m outbox run`` draining a prefilled backlog into the no-op sink, each
contender (this tree, another version's ``outbox`` package, a batch size) on its own fresh
store, alternating within every round so a neighbour's burst lands on all of them.

The rate is read from the database between 10% and 90% of the backlog delivered, as in
``benchmarks.drain``; the no-op sink answers at once, so it is the dispatcher's own cost.
``--steps`` instead drains in process with each step of a batch timed by wrapping the
library's own functions (slower than unwrapped: read the shares).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    NOOP_SINK,
    bench_settings,
    head_commit,
    load_average,
    open_outbox,
    write_result,
)
from benchmarks.drain import drain_run, prefill
from outbox.mirror import markdown, repair

_REPO = Path(__file__).resolve().parent.parent
RESULTS = _REPO / "benchmarks/results/noop-drain.json"


@dataclass(frozen=True)
class Contender:
    """A dispatcher to time: the ``outbox`` package under ``tree`` (None: this checkout),
    with ``env`` added to its environment."""

    name: str
    tree: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Contender:
        """``NAME[=DIR][+VAR=VALUE...]``: DIR holds another version's ``outbox`` package
        (a ``git archive`` of it, say)."""
        head, *pairs = text.split("+")
        name, _, tree = head.partition("=")
        return cls(
            name, Path(tree).resolve() if tree else None, dict(p.split("=", 1) for p in pairs)
        )

    def environ(self) -> dict[str, str]:
        extra = dict(self.env)
        if self.tree is not None:
            extra["PYTHONPATH"] = str(self.tree)  # ahead of the installed package
        return extra


def measure(contender: Contender, folder: Path, records: int) -> dict[str, Any]:
    """Prefill a fresh store with ``records`` memories, then drain it with one process."""
    settings = bench_settings(folder)
    prefill(settings, records, seed=21)
    row = drain_run(settings, NOOP_SINK, records, 1, folder / "logs", extra_env=contender.environ())
    return {"contender": contender.name, **row, "load": load_average()[0]}


def run(contenders: list[Contender], records: int, rounds: int) -> dict[str, Any]:
    """Every contender once per round, in turn; the order flips each round."""
    result: dict[str, Any] = {
        "commit": head_commit(),
        "records": records,
        "rounds": rounds,
        "load_start": load_average(),
        "contenders": {c.name: {"tree": str(c.tree or ""), "env": c.env} for c in contenders},
        "runs": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(rounds):
            order = contenders if number % 2 == 0 else contenders[::-1]
            for contender in order:
                folder = Path(scratch) / f"r{number}-{contender.name}"
                row = measure(contender, folder, records) | {"round": number}
                result["runs"].append(row)
                print(
                    f"round {number} {contender.name}: {row['per_s']:,.0f}/s, "
                    f"load {row['load']:.2f}, not delivered {row['not_delivered']}",
                    file=sys.stderr,
                    flush=True,
                )
    result["load_end"] = load_average()
    result["median_per_s"] = {
        c.name: statistics.median(r["per_s"] for r in result["runs"] if r["contender"] == c.name)
        for c in contenders
    }
    return result


# Each step of a batch: (label, the object, the name of its function).
def _steps(outbox: Any) -> list[tuple[str, Any, str]]:
    storage = outbox.storage
    return [
        ("claim (one transaction, one fsync)", storage.deliveries, "claim"),
        ("reading the batch's records", storage.records, "get_records"),
        ("settle (one transaction, one fsync)", storage.deliveries, "settle"),
        ("mirror sync, all of it (under the mirror lock)", outbox.mirrors, "sync_deliveries"),
        (
            "mirror: the owed outcomes and their records' rows (one read)",
            storage.mirror_state,
            "owed",
        ),
        ("mirror: front matter, open + read + parse", markdown.Opened, "__init__"),
        ("mirror: front matter, work on the open file", repair.MirrorSync, "_update_opened"),
        ("mirror: front matter, writing it in place", markdown.Opened, "overwrite"),
        ("mirror: appending the JSONL lines", outbox.mirrors.jsonl, "append"),
        (
            "mirror: clearing the pending flags (one transaction, one fsync)",
            storage.mirror_state,
            "clear_mirror_pending",
        ),
    ]


def _timed(totals: collections.Counter[str], label: str, call: Callable[..., Any]) -> Any:
    @functools.wraps(call)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tick = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - tick

    return wrapper


def steps(records: int, batch: int) -> dict[str, Any]:
    """One in-process drain of ``records`` into the no-op sink, each step timed per record."""
    totals: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as scratch:
        settings = bench_settings(Path(scratch), batch_size=batch)
        prefill(settings, records, seed=21)
        with open_outbox(settings) as outbox, outbox.dispatcher() as dispatcher:
            for label, owner, name in _steps(outbox):
                setattr(owner, name, _timed(totals, label, getattr(owner, name)))
            try:
                cpu, tick = time.process_time(), time.perf_counter()
                report = dispatcher.drain()
                wall, cpu = time.perf_counter() - tick, time.process_time() - cpu
            finally:
                for _label, owner, name in _steps(outbox):
                    if isinstance(owner, type):  # the class's own function back
                        setattr(owner, name, getattr(owner, name).__wrapped__)
    if report.delivered != records:
        raise RuntimeError(f"the drain delivered {report.delivered} of {records}")
    return {
        "records": records,
        "batch": batch,
        "per_s": records / wall,
        "wall_us": wall / records * 1e6,
        "cpu_us": cpu / records * 1e6,
        "steps_us": {label: seconds / records * 1e6 for label, seconds in totals.items()},
        "load": load_average()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--contender",
        action="append",
        default=[],
        metavar="NAME[=DIR][+VAR=VALUE...]",
        help="a dispatcher to time (default: this tree alone); DIR holds another version's "
        "outbox package, VAR=VALUE an OUTBOX_* setting for it",
    )
    parser.add_argument("--save", action="store_true", help=f"write {RESULTS.name} (or --out)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--steps", type=int, default=0, metavar="BATCH", help="time each step in process instead"
    )
    args = parser.parse_args()
    if args.steps:
        print(json.dumps(steps(args.records, args.steps), indent=2))
        return
    contenders = [Contender.parse(text) for text in args.contender] or [Contender("this")]
    result = run(contenders, args.records, args.rounds)
    if args.save:
        write_result(args.out, result)
    print(json.dumps(result["median_per_s"], indent=2))


if __name__ == "__main__":
    main()
