"""One version of the library answering recall questions for ``benchmarks.recall_latency``.

Run as a script by its path (not ``-m``), so ``outbox`` comes from ``PYTHONPATH`` (another
version's package) or the installed tree, never from the current folder; it imports nothing
of ``benchmarks``. It opens the store the environment names and answers lines on stdin:
``round`` times every question once, ``answers`` returns what each question and each
unrelated query got; each reply is one JSON line on stdout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from outbox import Outbox
from outbox.memory_core import MemoryService

WARM_UP = 5


def ask(service: MemoryService, session: str | None, text: str, floor: float | None) -> list[str]:
    answer = service.query_raw_memories(text, n_results=10, session_id=session, min_relevance=floor)
    return [row["id"] for row in answer["results"]]


def timed_round(service: MemoryService, asked: list[list[str]]) -> list[float]:
    """Milliseconds of each question with default settings, as memory-core is called."""
    samples = []
    for session, text in asked:
        began = time.perf_counter()
        service.query_raw_memories(text, n_results=10, session_id=session)
        samples.append((time.perf_counter() - began) * 1000)
    return samples


def answers(service: MemoryService, asked: list[list[str]], unrelated: list[str]) -> dict[str, Any]:
    return {
        "fused": [ask(service, session, text, 0.0) for session, text in asked],
        "default floor": [ask(service, session, text, None) for session, text in asked],
        "unrelated": [ask(service, None, text, None) for text in unrelated],
    }


def main(argv: list[str]) -> int:
    task = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    asked, unrelated = task["questions"], task["unrelated"]
    service = MemoryService(Outbox.open())
    try:
        for session, text in asked[:WARM_UP]:
            ask(service, session, text, None)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() == "round":
                reply: dict[str, Any] = {"ms": timed_round(service, asked)}
            else:
                reply = answers(service, asked, unrelated)
            print(json.dumps(reply), flush=True)
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
