"""What a forget costs on a big store (issue 13's goals: ``forget`` answers in under 50 ms,
and a running dispatcher carries out its sink delete within one poll).

The store is built the way a user builds one (``add_many``, a drain to the no-op sink), the
same as ``benchmarks.rebuild``. Then, in one run:

- ``Outbox.forget`` of records spread over the whole log (old and new), one at a time: the
  answer's latency (commit, log redaction, file deletion), median, p95 and max;
- the purge that follows (secure delete, search index merge, WAL truncate), once after one
  forget and once after the whole batch;
- ``outbox forget`` as a command, wall time (interpreter start and the purge included);
- with ``outbox run`` polling every ``--poll`` seconds in another process, the time from a
  forget's answer to its delete row being settled.

    python -m benchmarks.forget                 # 100,000 records
    python -m benchmarks.forget --count 10000   # a quick run
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    head_commit,
    load_average,
    open_outbox,
    outbox_environ,
    percentile,
    write_result,
)
from benchmarks.rebuild import build_store
from outbox import Outbox, Settings

RESULTS = Path(__file__).with_name("results") / "forget.json"


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def forget_latencies(settings: Settings, keys: list[str]) -> dict[str, Any]:
    """Each forget's answer, then the purges: one forget's, and a batch's."""
    with open_outbox(settings) as ob:
        single = keys[0]
        began = time.perf_counter()
        ob.forget(single)
        first = time.perf_counter() - began
        began = time.perf_counter()
        ob.forgetter.purge()
        purge_one = time.perf_counter() - began
        samples = [first]
        for key in keys[1:]:
            began = time.perf_counter()
            ob.forget(key)
            samples.append(time.perf_counter() - began)
        began = time.perf_counter()
        result = ob.forgetter.purge()
        purge_batch = time.perf_counter() - began
    return {
        "forgets": len(samples),
        "median_ms": _ms(percentile(samples, 0.5)),
        "p95_ms": _ms(percentile(samples, 0.95)),
        "max_ms": _ms(max(samples)),
        "purge_after_one_ms": _ms(purge_one),
        "purge_after_batch_ms": _ms(purge_batch),
        "purge_complete": result.complete,
    }


def cli_forget(settings: Settings, key: str) -> float:
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "outbox", "forget", key[:16]],
        env=outbox_environ(settings),
        cwd=settings.home.parent,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - began


def delete_after_poll(settings: Settings, keys: list[str], poll: float) -> dict[str, Any]:
    """Seconds from each forget's answer until a running dispatcher settled its delete."""
    env = outbox_environ(settings, OUTBOX_POLL_INTERVAL=str(poll))
    daemon = subprocess.Popen(
        [sys.executable, "-m", "outbox", "run"],
        env=env,
        cwd=settings.home.parent,
        stderr=subprocess.DEVNULL,
    )
    waits: list[float] = []
    try:
        with open_outbox(settings) as ob:
            time.sleep(3 * poll)  # the daemon is up and idle
            for key in keys:
                ob.forget(key)
                answered = time.perf_counter()
                while not _settled(ob, key):
                    if time.perf_counter() - answered > 60:
                        raise RuntimeError("a delete was not carried out within 60 s")
                    time.sleep(0.005)
                waits.append(time.perf_counter() - answered)
                time.sleep(random.random() * poll)  # forgets land anywhere in the poll
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    return {
        "poll_seconds": poll,
        "forgets": len(waits),
        "median_s": round(percentile(waits, 0.5), 3),
        "max_s": round(max(waits), 3),
        "max_over_poll": round(max(waits) / poll, 2),
    }


def _settled(ob: Outbox, key: str) -> bool:
    return all(row.state == "forgotten" for row in ob.deliveries_of([key]).get(key, []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100_000)
    parser.add_argument("--forgets", type=int, default=50)
    parser.add_argument("--poll", type=float, default=1.0)
    args = parser.parse_args()
    rng = random.Random(5)
    with tempfile.TemporaryDirectory(prefix="outbox-forget-") as scratch:
        settings, store = build_store(Path(scratch), args.count, pending_share=0.0)
        with open_outbox(settings) as ob:
            keys = [item.record.key for item in ob.storage.records.iter_records()]
        chosen = rng.sample(keys, args.forgets + 2 + 10)
        began_load = load_average()
        latencies = forget_latencies(settings, chosen[: args.forgets])
        command = cli_forget(settings, chosen[args.forgets])
        polled = delete_after_poll(settings, chosen[args.forgets + 2 :], args.poll)
        with open_outbox(settings) as ob:
            verified = ob.verify().ok
    result = {
        "count": args.count,
        "store": store,
        "load_average_at_start": began_load,
        "api": latencies,
        "cli_forget_seconds": round(command, 3),
        "delete_after_forget": polled,
        "verify_ok": verified,
        "commit": head_commit(),
    }
    write_result(RESULTS, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
