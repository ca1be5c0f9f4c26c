"""``outbox reindex`` of 10,000 records, SIGKILLed halfway, then resumed (issue 12's goal:
it survives the kill and does not embed again what was done).

A store of ``--count`` records is delivered to Chroma with the fast ``hashing`` embedder,
then ``OUTBOX_EMBEDDING`` is switched to the default MiniLM and the real command runs in a
child process. When its state file says half the records are done, the child is SIGKILLed;
the command is run again to the end. The second run's report says where it resumed and how
many records it embedded; the new collection must then hold every record once.

    python -m benchmarks.reindex                # 10,000 records
    python -m benchmarks.reindex --count 2000   # a quick run
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.common import (
    bench_settings,
    head_commit,
    load_average,
    memories,
    open_outbox,
    outbox_environ,
    write_result,
)
from outbox import Settings

RESULTS = Path(__file__).with_name("results") / "reindex.json"
COLLECTION = "memories"


def build(folder: Path, count: int) -> Settings:
    settings = replace(
        bench_settings(
            folder,
            synchronous="NORMAL",
            sinks="chroma",
            embedding="hashing",
            chroma_mode="embedded",
            chroma_collection=COLLECTION,
        ),
        batch_size=500,
    )
    texts = memories(count, seed=17, size=300)
    with open_outbox(settings) as ob:
        for start in range(0, count, 1000):
            ob.add_many(texts[start : start + 1000])
        if not ob.drain(timeout=3600).ok:
            raise RuntimeError("the store did not drain before the reindex")
    return settings


def _state(settings: Settings) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = json.loads(
            (settings.home / f"reindex-{COLLECTION}.json").read_text(encoding="utf-8")
        )
    except (FileNotFoundError, ValueError):
        return None
    return found


def killed_then_resumed(settings: Settings, count: int) -> dict[str, Any]:
    env = outbox_environ(settings, OUTBOX_EMBEDDING="minilm", OUTBOX_CHROMA_MODE="embedded") | {
        "OUTBOX_CHROMA_COLLECTION": COLLECTION
    }
    command = [sys.executable, "-m", "outbox", "reindex", "--json"]
    began = time.perf_counter()
    first = subprocess.Popen(
        command,
        env=env,
        cwd=settings.home.parent,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    while ((_state(settings) or {}).get("seen", 0)) < count // 2:
        if first.poll() is not None:
            raise RuntimeError("the reindex ended before the kill")
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(60)
    killed_after = time.perf_counter() - began
    state = _state(settings) or {}
    began = time.perf_counter()
    second = subprocess.run(
        command, env=env, cwd=settings.home.parent, capture_output=True, check=False
    )
    resumed_seconds = time.perf_counter() - began
    if second.returncode != 0:
        raise RuntimeError(f"the resumed reindex failed: {second.stderr.decode()[-400:]}")
    report = json.loads(second.stdout)
    return {
        "killed_after_seconds": round(killed_after, 1),
        "seen_at_kill": state.get("seen"),
        "resumed_after_seq": report.get("resumed_after"),
        "embedded_after_resume": report.get("embedded"),
        "resumed_seconds": round(resumed_seconds, 1),
        "status": report.get("status"),
        "embedded_twice": (report.get("embedded") or 0) + (state.get("seen") or 0) - count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="outbox-reindex-") as scratch:
        began = time.perf_counter()
        settings = build(Path(scratch), args.count)
        built = time.perf_counter() - began
        load = load_average()
        run = killed_then_resumed(settings, args.count)
        with open_outbox(replace(settings, embedding="minilm")) as ob:
            verified = ob.verify().ok
            status = ob.status()
    result = {
        "count": args.count,
        "build_seconds": round(built, 1),
        "load_average_at_start": load,
        **run,
        "records_after": status["records"],
        "verify_ok": verified,
        "commit": head_commit(),
    }
    write_result(RESULTS, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
