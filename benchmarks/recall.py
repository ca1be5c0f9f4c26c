"""Recall on LoCoMo: does ``query_raw_memories`` find the turn that answers a question?

Every turn is written through memory-core (``MemoryService.remember``, one session per
conversation, the speaker in the text, speaker and date in metadata, timestamped when its
conversation session took place, as an agent's turns are), all conversations in one store.
Each question with evidence (categories 1-4) asks ``query_raw_memories`` within its
conversation's session, before the embed and after a full drain into Chroma with the offline
MiniLM, and is scored for each leg alone, fused, and beside a baseline from the same run: a
plain FTS5 bm25 over the same turns in a separate in-memory sqlite3, and the naive
reciprocal-rank fusion of that bm25 with the vector leg. ``--ablation`` scores each part of
the fusion alone and left out. Then query latency at the dataset's size and with filler
records in the store, in both legs: the filler's vectors are random unit vectors written
straight into the collection (embedding 100,000 texts would take half an hour; a search's
cost depends on how many vectors there are, not on what they mean). Recall with relevance from
distance alone and as shipped is also timed in alternating rounds, so their ratio holds on a
busy machine, and the store's and Chroma's size on disk are recorded.

The dataset is read from its path and never copied: ``python -m benchmarks.recall --locomo
PATH`` (default ``../shared/data/locomo/locomo-dev.json`` beside the repository).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from benchmarks.bulk import BULK_ORIGIN, bulk_insert
from benchmarks.common import bench_settings, open_outbox, percentile
from benchmarks.paraphrase import absolute_only
from outbox.core.recall_filter import RecallFilter
from outbox.memory_core import MemoryService
from outbox.recall import service as recall_service
from outbox.recall.fusion import CONTEXT_REACH, MIN_RELEVANCE, Fusion, rrf
from outbox.sinks.chroma_service import SharedServer
from outbox.store import recall as store_recall
from outbox.store.sqlite_writes import sqlite_path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_LOCOMO = REPO.parent / "shared" / "data" / "locomo" / "locomo-dev.json"
RESULTS = REPO / "benchmarks" / "results" / "recall.json"
DEPTH = 30  # hits each leg (and the baseline's bm25) hands to a fusion
UNRELATED = (
    "banana smoothie recipe",
    "how to configure a kubernetes ingress controller",
    "quarterly corporate tax filing deadline",
    "replace the timing belt on a diesel engine",
    "python asyncio event loop tutorial",
)


SESSION_DATE = "%I:%M %p on %d %B, %Y"  # LoCoMo's "1:56 pm on 8 May, 2023"
TURN_GAP = timedelta(seconds=30)


@dataclass
class Turn:
    dia_id: str
    speaker: str
    text: str
    date: str
    at: datetime | None = None


@dataclass
class Question:
    session: str
    text: str
    category: int
    evidence: set[str] = field(default_factory=set)  # record keys


def turn_text(turn: dict[str, Any]) -> str:
    """What an agent would store for a turn: who said it, what, and a shared photo's caption."""
    text = f"{turn['speaker']}: {turn['text']}"
    if turn.get("blip_caption"):
        text += f" [shares {turn['blip_caption']}]"
    return text


def load(path: Path) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    return data


def session_start(date: str) -> datetime | None:
    """When a conversation session began, from LoCoMo's wording (None: not that wording)."""
    try:
        return datetime.strptime(date.strip(), SESSION_DATE).replace(tzinfo=UTC)
    except ValueError:
        return None


def conversation_turns(conversation: dict[str, Any]) -> list[Turn]:
    """Every turn in order, each timestamped 30 s after the one before from its session's
    start (a session without a readable date leaves its turns to be stamped on writing)."""
    turns = []
    number = 1
    while f"session_{number}" in conversation:
        date = conversation.get(f"session_{number}_date_time", "")
        start = session_start(date)
        for index, turn in enumerate(conversation[f"session_{number}"]):
            at = None if start is None else start + index * TURN_GAP
            turns.append(Turn(turn["dia_id"], turn["speaker"], turn_text(turn), date, at))
        number += 1
    return turns


def write_turns(service: MemoryService, data: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """Every turn through memory-core; returns (session, dia_id) → record key."""
    keys: dict[tuple[str, str], str] = {}
    for sample in data:
        session = sample["sample_id"]
        for turn in conversation_turns(sample["conversation"]):
            meta = {"dia_id": turn.dia_id, "speaker": turn.speaker, "date": turn.date}
            receipt = service.remember(
                turn.text, metadata=meta, session_id=session, timestamp=turn.at
            )
            keys[(session, turn.dia_id)] = receipt.key
    return keys


def questions(data: list[dict[str, Any]], keys: dict[tuple[str, str], str]) -> list[Question]:
    found = []
    for sample in data:
        session = sample["sample_id"]
        for qa in sample["qa"]:
            if qa.get("category") not in (1, 2, 3, 4):
                continue
            evidence = {keys[(session, d)] for d in qa.get("evidence", []) if (session, d) in keys}
            if evidence:
                found.append(Question(session, qa["question"], qa["category"], evidence))
    return found


def score(ranked: Sequence[Sequence[str]], asked: Sequence[Question]) -> dict[str, float]:
    """hit@5, hit@10, recall@10 and MRR (first answering turn within the top 10)."""
    hit5 = hit10 = recall10 = mrr = 0.0
    for keys, question in zip(ranked, asked, strict=True):
        top = list(keys)[:10]
        ranks = [rank for rank, key in enumerate(top, start=1) if key in question.evidence]
        hit5 += bool(ranks and ranks[0] <= 5)
        hit10 += bool(ranks)
        recall10 += len(ranks) / len(question.evidence)
        mrr += 1.0 / ranks[0] if ranks else 0.0
    n = max(len(asked), 1)
    return {
        "hit@5": round(hit5 / n, 4),
        "hit@10": round(hit10 / n, 4),
        "recall@10": round(recall10 / n, 4),
        "mrr": round(mrr / n, 4),
    }


class Bm25Baseline:
    """A plain FTS5 bm25 over the same turns, in its own in-memory sqlite3."""

    def __init__(self, rows: list[tuple[str, str, str]]) -> None:
        self.db = sqlite3.connect(":memory:")
        self.db.execute(
            "CREATE VIRTUAL TABLE t USING fts5(content, key UNINDEXED, session UNINDEXED, "
            "tokenize='porter unicode61 remove_diacritics 2')"
        )
        self.db.executemany("INSERT INTO t(content, key, session) VALUES (?, ?, ?)", rows)

    def search(self, query: str, session: str, limit: int = DEPTH) -> list[str]:
        words = {w.lower() for w in query.replace('"', " ").split()}
        terms = [w.strip("?.,!'()") for w in words]
        match = " OR ".join(f'"{term}"' for term in terms if term)
        if not match:
            return []
        rows = self.db.execute(
            "SELECT key FROM t WHERE t MATCH ? AND session = ? ORDER BY bm25(t) LIMIT ?",
            (match, session, limit),
        ).fetchall()
        return [row[0] for row in rows]


def vector_leg(service: MemoryService, question: Question) -> list[str]:
    hits, _degraded = service.outbox.recaller.vector_leg(
        question.text, DEPTH, RecallFilter(session_id=question.session)
    )
    return [key for key, _distance in hits]


def lexical_leg(service: MemoryService, question: Question) -> list[str]:
    filters = RecallFilter(session_id=question.session)
    return [
        k
        for k, _ in service.outbox.lexical_matches(question.text, limit=DEPTH, filters=filters).hits
    ]


def fused(service: MemoryService, question: Question, floor: float | None = 0.0) -> list[str]:
    answer = service.query_raw_memories(
        question.text, n_results=10, session_id=question.session, min_relevance=floor
    )
    return [row["id"] for row in answer["results"]]


def absolute(service: MemoryService, question: Question) -> list[str]:
    """The default recall with the vector leg's relevance read from distance alone (no
    background): relevance as it was before issue 23, in the same run."""
    with absolute_only():
        return fused(service, question, None)


def by_conversation(ranked: Sequence[Sequence[str]], asked: Sequence[Question]) -> dict[str, float]:
    """hit@10 within each conversation: a change that helps only one of them is a fit to it."""
    sessions = sorted({question.session for question in asked})
    return {
        session: score(
            [keys for keys, q in zip(ranked, asked, strict=True) if q.session == session],
            [q for q in asked if q.session == session],
        )["hit@10"]
        for session in sessions
    }


def evaluate(
    service: MemoryService, asked: list[Question], baseline: Bm25Baseline, embedded: bool
) -> dict[str, Any]:
    """Each leg alone, fused (no floor and at the default), the baseline and its naive RRF;
    fused and the naive RRF also per conversation."""
    runs: dict[str, Callable[[Question], list[str]]] = {
        "lexical leg": lambda q: lexical_leg(service, q),
        "fused": lambda q: fused(service, q),
        "fused, default min_relevance": lambda q: fused(service, q, None),
        "bm25 baseline": lambda q: baseline.search(q.text, q.session),
    }
    if embedded:
        runs["fused, default min_relevance, absolute relevance"] = lambda q: absolute(service, q)
        runs["vector leg"] = lambda q: vector_leg(service, q)
        runs["naive rrf baseline"] = lambda q: [
            k for k, _ in rrf([baseline.search(q.text, q.session), vector_leg(service, q)])
        ]
    found: dict[str, Any] = {}
    for name, run in runs.items():
        ranked = [run(q) for q in asked]
        found[name] = score(ranked, asked)
        if name in ("fused", "naive rrf baseline"):
            found[name]["hit@10 per conversation"] = by_conversation(ranked, asked)
    return found


# What each part of recall was before issue 12's second round (the fusion that measured
# 0.775), to score each part alone on top of it and the current recall without it.
PREVIOUS: dict[str, Any] = {
    "stop_words": False,
    "coverage_weight": 0.0,
    "reach": 1,
    "context_share": 0.3,
    "dates": False,
    "background": False,
    "lead_weight": 0.0,
}
PARTS: dict[str, tuple[str, ...]] = {
    "query stop words": ("stop_words",),
    "coverage in the score (0.2)": ("coverage_weight",),
    "context: 2 turns each way, share 0.5": ("reach", "context_share"),
    "dates named in the query": ("dates",),
    "relevance against the background": ("background",),
    "the nearest meaning's lead (issue 23)": ("lead_weight",),
}


def current() -> dict[str, Any]:
    """The shipped settings of every part in ``PREVIOUS``."""
    fusion = Fusion()
    return {
        "stop_words": True,
        "reach": CONTEXT_REACH,
        "dates": True,
        "background": True,
        **{name: getattr(fusion, name) for name in PREVIOUS if hasattr(fusion, name)},
    }


def all_words(query: str) -> list[str]:
    """The lexical leg's query words with its stop words kept, as before they were dropped."""
    words = dict.fromkeys(w.lower() for w in re.findall(r"\w+", query) if len(w) > 1)
    return sorted(words, key=len, reverse=True)[:16]


def reaching(neighbours: Callable[..., Any], reach: int) -> Callable[..., Any]:
    """``RecallQueries.neighbours`` held to ``reach`` whatever reach recall passes."""

    def held(self: Any, keys: Any, _reach: int = CONTEXT_REACH) -> Any:
        return neighbours(self, keys, reach)

    return held


@contextlib.contextmanager
def configured(parts: dict[str, Any]) -> Iterator[None]:
    """Recall run with ``parts`` instead of its shipped settings, for this block only."""
    neighbours = store_recall.RecallQueries.neighbours
    changes: list[tuple[object, str, object]] = [
        (
            recall_service,
            "FUSION",
            Fusion(**{k: v for k, v in parts.items() if hasattr(Fusion, k)}),
        ),
        (store_recall.RecallQueries, "neighbours", reaching(neighbours, parts["reach"])),
    ]
    if not parts["stop_words"]:
        changes.append((store_recall, "match_terms", all_words))
    if not parts["dates"]:  # neither the date bonus nor the date's words held
        changes.append((recall_service, "named_dates", lambda query: []))
    if not parts["background"]:  # the vector leg's relevance from distance alone
        changes.append((recall_service, "background", lambda distances: None))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in changes]
    for owner, name, value in changes:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def ablation(service: MemoryService, asked: list[Question]) -> dict[str, Any]:
    """Fused hit@10 etc. after the drain: the previous fusion, each part alone on top of it,
    the current one, and the current one without each part."""
    new = current()
    runs = {"previous fusion": PREVIOUS}
    runs |= {
        f"previous + {name}": {**PREVIOUS, **{k: new[k] for k in keys}}
        for name, keys in PARTS.items()
    }
    runs["current fusion"] = new
    runs |= {
        f"current - {name}": {**new, **{k: PREVIOUS[k] for k in keys}}
        for name, keys in PARTS.items()
    }
    found: dict[str, Any] = {}
    for name, parts in runs.items():
        with configured(parts):
            ranked = [fused(service, q) for q in asked]
        found[name] = {
            **score(ranked, asked),
            "hit@10 per conversation": by_conversation(ranked, asked),
        }
    return found


def latency(service: MemoryService, asked: list[Question], session: bool) -> dict[str, float]:
    """query_raw_memories' p50 and p99 in ms (default settings), after a few warm-up calls."""
    for question in asked[:5]:
        fused(service, question, None)
    samples = []
    for question in asked:
        began = time.perf_counter()
        service.query_raw_memories(
            question.text, n_results=10, session_id=question.session if session else None
        )
        samples.append((time.perf_counter() - began) * 1000)
    return {
        "calls": len(samples),
        "p50_ms": round(percentile(samples, 0.5), 2),
        "p99_ms": round(percentile(samples, 0.99), 2),
    }


def latency_ab(service: MemoryService, asked: list[Question], rounds: int = 4) -> dict[str, Any]:
    """query_raw_memories' p50 with relevance from distance alone (as before issue 23) and
    as shipped, in alternating rounds over the same questions, so load hits both alike."""
    samples: dict[str, list[float]] = {"distance alone": [], "shipped": []}
    for _ in range(rounds):
        for name, samples_of in samples.items():
            with absolute_only() if name == "distance alone" else contextlib.nullcontext():
                for question in asked:
                    began = time.perf_counter()
                    fused(service, question, None)
                    samples_of.append((time.perf_counter() - began) * 1000)
    p50 = {name: round(percentile(values, 0.5), 2) for name, values in samples.items()}
    return {
        "rounds": rounds,
        "p50_ms": p50,
        "shipped / distance alone": round(p50["shipped"] / p50["distance alone"], 3),
    }


def unrelated(service: MemoryService) -> dict[str, Any]:
    """What a few queries nothing in the store answers return at the default floor."""
    found = {}
    for query in UNRELATED:
        loose = service.query_raw_memories(query, n_results=10, min_relevance=0.0)["results"]
        kept = service.query_raw_memories(query, n_results=10)["count"]
        found[query] = {
            "returned": kept,
            "best_relevance": max((r["relevance"] for r in loose), default=0.0),
        }
    return found


def answer_relevance(service: MemoryService, asked: list[Question]) -> list[float]:
    """The relevance of the best-ranked answering turn of each question (0: not in top 10)."""
    values = []
    for question in asked:
        rows = service.query_raw_memories(
            question.text, n_results=10, session_id=question.session, min_relevance=0.0
        )["results"]
        values.append(next((r["relevance"] for r in rows if r["id"] in question.evidence), 0.0))
    return values


def embed_filler(service: MemoryService, db: Path, chunk: int = 2_000, seed: int = 11) -> float:
    """Write a random unit vector for every bulk-inserted record straight into the vector
    index, through the Chroma sink's own upsert (ids, documents and metadata as a delivery
    writes them); returns seconds taken."""
    import numpy as np

    began = time.perf_counter()
    with contextlib.closing(sqlite3.connect(db)) as conn:
        keys = [
            key
            for (key,) in conn.execute("SELECT key FROM records WHERE origin = ?", (BULK_ORIGIN,))
        ]
    sink = service.outbox.recaller.vector_index()
    rng = np.random.default_rng(seed)
    for start in range(0, len(keys), chunk):
        part = keys[start : start + chunk]
        stored = service.outbox.get_records(part)
        vectors = rng.standard_normal((len(part), 384)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        sink._upsert(
            [(stored[key].record, vector) for key, vector in zip(part, vectors, strict=True)]
        )
    return time.perf_counter() - began


def index_bytes(service: MemoryService) -> dict[str, int]:
    """Bytes on disk of the store (SQLite with its lexical index) and of Chroma's folder."""
    settings = service.outbox.settings
    db = sqlite_path(settings.db_url)
    store = sum(p.stat().st_size for p in db.parent.glob(db.name + "*")) if db else 0
    chroma = sum(p.stat().st_size for p in settings.chroma_path.rglob("*") if p.is_file())
    return {"sqlite": store, "chroma": chroma}


def run(path: Path, filler: int, ablate: bool) -> dict[str, Any]:
    data = load(path)
    with tempfile.TemporaryDirectory(prefix="recall-bench-") as folder:
        settings = bench_settings(Path(folder), sinks="chroma", synchronous="NORMAL")
        service = MemoryService(open_outbox(settings))
        try:
            return measure(service, data, filler, ablate)
        finally:
            service.close()
            with SharedServer(settings.chroma_path, 0.0).stopped():
                pass  # the server the drain started ends with the run, not 10 min later


def measure(
    service: MemoryService, data: list[dict[str, Any]], filler: int, ablate: bool
) -> dict[str, Any]:
    began = time.perf_counter()
    keys = write_turns(service, data)
    write_s = time.perf_counter() - began
    asked = questions(data, keys)
    stored = service.outbox.get_records(keys.values())
    baseline = Bm25Baseline(
        [(r.record.content, k, str(r.record.metadata["session_id"])) for k, r in stored.items()]
    )
    result: dict[str, Any] = {
        "turns": len(keys),
        "questions": len(asked),
        "write_s": round(write_s, 1),
    }
    result["before_embed"] = evaluate(service, asked, baseline, embedded=False)
    began = time.perf_counter()
    report = service.outbox.drain()
    result["drain_s"] = round(time.perf_counter() - began, 1)
    result["drained"] = str(report)[:200]
    result["index_bytes_dataset"] = index_bytes(service)
    result["after_drain"] = evaluate(service, asked, baseline, embedded=True)
    if ablate:
        result["ablation"] = ablation(service, asked)
    relevance = answer_relevance(service, asked)
    result["answer_relevance"] = {
        f"p{p}": round(percentile(relevance, p / 100), 3) for p in (5, 10, 25, 50)
    }
    result["unrelated"] = unrelated(service)
    result["latency_dataset"] = latency(service, asked, session=True)
    result["latency_ab_dataset"] = latency_ab(service, asked)
    if filler:
        db = sqlite_path(service.outbox.settings.db_url)
        assert db is not None
        result["filler_insert_s"] = round(bulk_insert(db, filler, sinks=("chroma",)), 1)
        result["filler_vectors_s"] = round(embed_filler(service, db), 1)
        result["filler"] = filler
        result["vectors"] = service.outbox.recaller.vector_index().count()
        result["index_bytes_filler"] = index_bytes(service)
        result["latency_filler"] = latency(service, asked, session=True)
        result["latency_filler_no_session"] = latency(service, asked, session=False)
    return result


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recall", description=__doc__)
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO, help="the LoCoMo JSON")
    parser.add_argument("--filler", type=int, default=100_000, help="filler records (0: none)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--ablation", action="store_true", help="also score each part of the fusion alone"
    )
    args = parser.parse_args(argv)
    if not args.locomo.exists():
        parser.error(f"no LoCoMo file at {args.locomo}")
    result = {"machine": machine(), "dataset": args.locomo.name, "min_relevance": MIN_RELEVANCE}
    result["load_average"] = [round(value, 2) for value in os.getloadavg()]
    result.update(run(args.locomo, args.filler, args.ablation))
    result["load_average_after"] = [round(value, 2) for value in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    with contextlib.suppress(ImportError):
        from benchmarks.plots import recall_figure

        recall_figure(result, REPO / "docs" / "img" / "bench-recall.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
