"""Recall by meaning on the paraphrase set (``benchmarks/paraphrase_set.py``): does a
question that shares no content word with a memory still find it, and does a question
nothing answers get nothing?

Each memory is written through ``Outbox.add`` into one store with Chroma as its sink and
drained with the offline MiniLM. Then, for each question: does the vector leg alone rank its
memory first, and does ``Outbox.recall`` with default settings keep it first; for each
unrelated question: does the default recall return anything. Both with the shipped relevance
and, in the same run, with the vector leg's absolute reading alone (relevance before issue 23).

``python -m benchmarks.paraphrase`` writes ``benchmarks/results/paraphrase.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import bench_settings, open_outbox
from benchmarks.paraphrase_set import PAIRS, UNRELATED
from outbox import Outbox
from outbox.core.recall_filter import RecallFilter
from outbox.recall import service as recall_service
from outbox.recall.fusion import MIN_RELEVANCE
from outbox.recall.service import LEG_DEPTH
from outbox.sinks.chroma_service import SharedServer

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "paraphrase.json"


@contextlib.contextmanager
def absolute_only() -> Iterator[None]:
    """Recall with no background: the vector leg's relevance from its distance alone."""
    saved = recall_service.background
    recall_service.background = lambda distances: None
    try:
        yield
    finally:
        recall_service.background = saved


def asked(outbox: Outbox, keys: list[str]) -> dict[str, Any]:
    """The paraphrase questions and the unrelated ones, scored on ``outbox`` as it stands."""
    first_by_vector: list[int] = []
    kept_first: list[int] = []
    rows = []
    for index, ((_memory, question), key) in enumerate(zip(PAIRS, keys, strict=True)):
        hits, _ = outbox.recaller.vector_leg(question, LEG_DEPTH, RecallFilter())
        alone = bool(hits) and hits[0][0] == key
        answer = outbox.recall(question)
        kept = bool(answer.hits) and answer.hits[0].key == key
        first_by_vector += [index] if alone else []
        kept_first += [index] if kept else []
        top = answer.hits[0] if answer.hits else None
        rows.append(
            {
                "question": question,
                "vector_first": alone,
                "kept_first": kept,
                "returned": len(answer.hits),
                "first_relevance": round(top.relevance, 3) if top else None,
                "first_legs": list(top.legs) if top else [],
            }
        )
    unrelated = {}
    for question in UNRELATED:
        hits = outbox.recall(question).hits
        loose = outbox.recall(question, min_relevance=0.0).hits
        unrelated[question] = {
            "returned": len(hits),
            "best_relevance": round(max((h.relevance for h in loose), default=0.0), 3),
            "best_legs": list(max(loose, key=lambda h: h.relevance).legs) if loose else [],
        }
    return {
        "first_by_vector": len(first_by_vector),
        "kept_first_of_those": len(set(first_by_vector) & set(kept_first)),
        "kept_first": len(kept_first),
        "no_answer": sum(row["returned"] == 0 for row in rows),
        "unrelated_answered": sum(row["returned"] > 0 for row in unrelated.values()),
        "questions": rows,
        "unrelated": unrelated,
    }


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="paraphrase-bench-") as folder:
        settings = bench_settings(Path(folder), sinks="chroma", synchronous="NORMAL")
        outbox = open_outbox(settings)
        try:
            keys = [outbox.add(memory).key for memory, _question in PAIRS]
            report = outbox.drain(timeout=300)
            if not report.ok:
                raise RuntimeError(f"the drain did not finish: {report}")
            with absolute_only():
                before = asked(outbox, keys)
            after = asked(outbox, keys)
        finally:
            outbox.close()
            with SharedServer(settings.chroma_path, 0.0).stopped():
                pass  # the server the drain started ends with the run, not 10 min later
    return {"absolute relevance (before)": before, "calibrated relevance (shipped)": after}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paraphrase", description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    result: dict[str, Any] = {
        "memories": len(PAIRS),
        "unrelated_questions": len(UNRELATED),
        "min_relevance": MIN_RELEVANCE,
        "load_average": [round(value, 2) for value in os.getloadavg()],
    }
    result.update(run())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    summary = {
        name: {k: v for k, v in part.items() if k not in ("questions", "unrelated")}
        for name, part in result.items()
        if isinstance(part, dict) and "first_by_vector" in part
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
