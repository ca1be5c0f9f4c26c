"""memory-core's ``add_memory``: idle, during a heavy backfill, and beside the inline path.

    python -m benchmarks.add_memory [--calls 200] [--backlog 3000] [--json]

Issue 5's figures in one run: ``add_memory`` latency with an idle dispatcher; the same while
an ``outbox run`` process embeds a ``--backlog`` of records into embedded Chroma with the real
model (seed 001's AC7 case); and the synchronous embed + ``collection.add`` per write that
seed 001 replaces. A write every 20 ms, as an agent saving turns does.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import memories, outbox_environ, summarize, time_calls
from benchmarks.inline import inline_writes
from outbox import Outbox, load_settings
from outbox.memory_core import MemoryService

PACE = 0.02


def measure(calls: int, backlog: int, folder: Path) -> dict[str, Any]:
    settings = load_settings(
        env={},
        home=folder / ".outbox",
        markdown_dir=folder / "md",
        sinks="chroma",
        mirror_id="bench",
    )
    service = MemoryService(Outbox.open(settings))
    texts = memories(calls * 3, seed=51)
    errors = 0

    def turn(number: int) -> None:
        nonlocal errors
        answer = service.add_memory(f"question {number}", "thinking it over", texts[number])
        errors += answer["status"] != "queued"

    time_calls(turn, 10, start=calls * 2)  # warm-up
    idle = summarize(*time_calls(turn, calls, pace=PACE))
    service.outbox.add_many(
        {"content": f"backlog {i}: {text}"} for i, text in enumerate(memories(backlog, seed=52))
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox", "run"],
        env=outbox_environ(settings, OUTBOX_POLL_INTERVAL="0.1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while service.outbox.storage.deliveries.counts()["chroma"]["delivered"] < 64:
            time.sleep(0.05)  # the backfill is under way
        busy = summarize(*time_calls(turn, calls, start=calls, pace=PACE))
        left = service.outbox.storage.deliveries.counts()["chroma"]["pending"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    service.close()
    inline = inline_writes(folder, min(calls, 100))["inline"]
    return {
        "idle": idle,
        "busy": busy,
        "inline": inline,
        "errors": errors,
        "backlog_left_after": left,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--backlog", type=int, default=3000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.calls, args.backlog, Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    idle, busy, inline = result["idle"], result["busy"], result["inline"]
    for name, row in (
        ("add_memory idle", idle),
        ("add_memory during backfill", busy),
        ("inline embed + collection.add", inline),
    ):
        print(
            f"{name:<32} median {row['median_us'] / 1000:7.2f} ms   p99 "
            f"{row['p99_us'] / 1000:7.2f} ms"
        )
    print(
        f"backfill p99 / idle p99: {busy['p99_us'] / idle['p99_us']:.2f}x; inline median / "
        f"add_memory idle median: {inline['median_us'] / idle['median_us']:.1f}x; errors: "
        f"{result['errors']}; backlog still pending when measuring ended: "
        f"{result['backlog_left_after']}"
    )


if __name__ == "__main__":
    main()
