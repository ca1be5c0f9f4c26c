"""How long the command line takes, beside the interpreter's own start.

Each command runs as a real process (``python -m outbox ...`` with the same interpreter),
in alternating rounds with ``python -c pass``, so the difference is the command's own start:
its imports and its work. ``outbox add`` writes to a store that already exists (its schema
current, so no migration runs), delivering to the no-op sink; ``import sqlalchemy`` is
there to show that one library's share. ``outbox recent`` and ``outbox search`` read a second
store of ``records`` memories, drained once into its shared Chroma server (the offline MiniLM
model), which stays up while they run, as it does for a user: the search's vector leg asks it.

Run alone (the ``startup`` section of ``benchmarks.compare`` runs the same)::

    python -m benchmarks.startup                      # 15 rounds, 10,000 records
    python -m benchmarks.startup --store DIR          # fill and drain DIR once, reuse it
    git archive COMMIT outbox | tar -x -C OLD         # an earlier version of the package...
    python -m benchmarks.startup --baseline OLD       # ...timed in the same rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    NOOP_SINK,
    bench_settings,
    head_commit,
    load_average,
    memories,
    open_outbox,
    outbox_environ,
    percentile,
    write_result,
)
from outbox import Settings
from outbox.sinks.chroma_service import SharedServer

RESULTS = Path(__file__).with_name("results") / "startup.json"
SEARCH_RECORDS = 10_000
# Words of the synthetic memories, asked as a person would: both legs find something.
QUERY = "which lease and retry settings did the dispatcher use"


def _timed(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    tick = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, check=False)
    elapsed = time.perf_counter() - tick
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} exited {done.returncode}: {done.stderr!r}")
    return elapsed


def _environ(settings: Settings) -> dict[str, str]:
    """The store's environment; pyc files are written (the warm-up rounds make them), as
    an installed package has them."""
    env = outbox_environ(settings)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def search_store(folder: Path, records: int) -> Settings:
    """A store of ``records`` memories (about 200 bytes each), all delivered to its shared
    Chroma server, which is left running; a store a previous run filled is reused."""
    settings = bench_settings(folder, sinks="chroma")
    with open_outbox(settings) as ob:
        held = int(ob.status()["records"])
        if held < records:
            texts = memories(records - held, seed=22, size=200, start=held)
            for start in range(0, len(texts), 1000):
                ob.add_many(texts[start : start + 1000])
        report = ob.drain(timeout=3600)
        if report.remaining["chroma"]["pending"]:
            raise RuntimeError(f"the search store did not drain: {report.remaining}")
    return settings


def run(
    folder: Path, rounds: int, records: int = SEARCH_RECORDS, baseline: Path | None = None
) -> dict[str, Any]:
    """Median, p90 and min wall ms per command over ``rounds`` alternating rounds, and each
    median's difference from ``python -c pass`` measured in the same rounds. ``baseline``:
    a folder holding another version's ``outbox`` package, whose ``recent`` and ``search``
    run in the same rounds (a before and after under the same load)."""
    settings = bench_settings(folder, sinks=NOOP_SINK)
    open_outbox(settings).close()  # the store exists and is migrated
    searched = search_store(folder / "search", records)
    env, read_env = _environ(settings), _environ(searched)
    python = sys.executable
    commands = {
        "python -c pass": ([python, "-c", "pass"], env),
        "outbox --help": ([python, "-m", "outbox", "--help"], env),
        "outbox add": ([python, "-m", "outbox", "add", "{n} a memory saved from the shell"], env),
        "outbox recent": ([python, "-m", "outbox", "recent"], read_env),
        "outbox search": ([python, "-m", "outbox", "search", QUERY], read_env),
        "python -c 'import sqlalchemy'": ([python, "-c", "import sqlalchemy"], env),
    }
    if baseline is not None:
        old_env = dict(read_env, PYTHONPATH=str(baseline.resolve()))
        commands["outbox recent, baseline"] = (commands["outbox recent"][0], old_env)
        commands["outbox search, baseline"] = (commands["outbox search"][0], old_env)
    samples: dict[str, list[float]] = {name: [] for name in commands}
    first: dict[str, float] = {}
    try:
        for number in range(-2, rounds):  # two warm-up rounds: the page cache, pyc files
            for name, (argv, environ) in commands.items():
                command = [arg.replace("{n}", str(number)) for arg in argv]
                elapsed = _timed(command, environ, folder) * 1000
                first.setdefault(name, elapsed)
                if number >= 0:
                    samples[name].append(elapsed)
    finally:
        with SharedServer(searched.chroma_path, 0.0).stopped():
            pass  # the server the drain started ends with the run
    base = statistics.median(samples["python -c pass"])
    return {
        name: {
            "median_ms": statistics.median(values),
            "p90_ms": percentile(values, 0.9),
            "min_ms": min(values),
            "first_ms": first[name],
            "above_python_ms": statistics.median(values) - base,
            "runs": len(values),
            **({"records": records} if name.startswith(("outbox recent", "outbox search")) else {}),
        }
        for name, values in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--records", type=int, default=SEARCH_RECORDS)
    parser.add_argument("--store", type=Path, help="a folder to fill once and keep")
    parser.add_argument("--baseline", type=Path, help="a folder holding another outbox package")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    began = load_average()
    with tempfile.TemporaryDirectory(prefix="outbox-startup-") as scratch:
        folder = args.store or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        figures = run(folder, args.rounds, args.records, args.baseline)
    result = {
        "commit": head_commit(),
        "baseline": str(args.baseline) if args.baseline else None,
        "load_average": {"start": began, "end": load_average()},
        "cpus": os.cpu_count(),
        "startup": figures,
    }
    write_result(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
