"""How long the command line takes to start, beside the interpreter's own start.

Each command runs as a real process (``python -m outbox ...`` with the same interpreter),
in alternating rounds with ``python -c pass``, so the difference is the command's own start:
its imports and its work. ``outbox add`` writes to a store that already exists (its schema
current, so no migration runs), delivering to the no-op sink; ``import sqlalchemy`` is
there to show that one library's share of ``add``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import NOOP_SINK, bench_settings, open_outbox, outbox_environ


def _timed(argv: list[str], env: dict[str, str], cwd: Path) -> float:
    tick = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, check=False)
    elapsed = time.perf_counter() - tick
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} exited {done.returncode}: {done.stderr!r}")
    return elapsed


def run(folder: Path, rounds: int) -> dict[str, Any]:
    """Median wall ms per command over ``rounds`` alternating rounds, and each one's
    difference from ``python -c pass`` measured in the same rounds."""
    settings = bench_settings(folder, sinks=NOOP_SINK)
    open_outbox(settings).close()  # the store exists and is migrated
    env = outbox_environ(settings)
    python = sys.executable
    commands = {
        "python -c pass": [python, "-c", "pass"],
        "outbox --help": [python, "-m", "outbox", "--help"],
        "outbox add": [python, "-m", "outbox", "add", "{n} a memory saved from the shell"],
        "python -c 'import sqlalchemy'": [python, "-c", "import sqlalchemy"],
    }
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for number in range(-2, rounds):  # two warm-up rounds: the page cache, pyc files
        for name, argv in commands.items():
            elapsed = _timed([arg.replace("{n}", str(number)) for arg in argv], env, folder)
            if number >= 0:
                samples[name].append(elapsed * 1000)
    base = statistics.median(samples["python -c pass"])
    return {
        name: {
            "median_ms": statistics.median(values),
            "min_ms": min(values),
            "above_python_ms": statistics.median(values) - base,
            "runs": len(values),
        }
        for name, values in samples.items()
    }
