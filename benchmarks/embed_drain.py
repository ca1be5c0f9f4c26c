"""The drain into Chroma beside the embedder's own best throughput on the same texts.

The drain is what a user runs: LoCoMo turns written with ``add_many``, then one
``python -m outbox run`` with the daemon's default settings (its priority, its embedding
threads, the shared Chroma server), its rate read from the database as in ``drain``. The
embedder's own rate is the same model on the same texts in batches of the dispatcher's size,
in a child process at the daemon's priority and thread count, with no outbox and no Chroma:
every way of cutting a batch into runs is tried (the library's, and fixed counts from 1 to
64), and the fastest on this machine is the reference. The two alternate in rounds, so a busy
neighbour lands on both.

``python -m benchmarks.embed_drain`` runs it alone and writes ``results/embed-drain.json``;
``benchmarks.compare`` runs it as its ``embed`` section.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import bench_settings, head_commit, load_average, open_outbox, write_result
from benchmarks.drain import drain_run
from benchmarks.recall import DEFAULT_LOCOMO, conversation_turns, load
from outbox.core.config import Settings
from outbox.sinks.embedding import MiniLMEmbedding

if TYPE_CHECKING:
    from outbox.sinks.embedding import Vector

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "embed-drain.json"
FIXED_RUNS = (1, 2, 4, 8, 16, 32)  # 64 a run was the slowest of all in every trial
LIBRARY_CUT = "runs of like length (the library's)"
GOAL = 0.8  # the drain's rate / the embedder's best, at least


def locomo_texts(path: Path, count: int) -> list[str]:
    """The first ``count`` LoCoMo turns as an agent stores them (speaker, text, caption)."""
    texts = [
        turn.text for sample in load(path) for turn in conversation_turns(sample["conversation"])
    ]
    return texts[:count]


def fixed_cut(size: int) -> Any:
    """Runs of ``size`` sorted texts each, as the embedder did before it cut by length."""

    def cut(lengths: Sequence[int]) -> list[tuple[int, int]]:
        return [(start, min(len(lengths), start + size)) for start in range(0, len(lengths), size)]

    return cut


class RunsOf32(MiniLMEmbedding):
    """The embedder as it was before runs were cut by length: 32 sorted texts a run, and no
    run-by-run vectors, so the sink upserts only after the whole batch is embedded, as it
    did. The drain runs it through ``OUTBOX_EMBEDDING=benchmarks.embed_drain:RunsOf32``,
    as the "before" of the same run."""

    runs = None  # type: ignore[assignment]

    def __call__(self, input: list[str]) -> list[Vector]:
        return self.embed_in_runs(list(input), fixed_cut(32))

    def embed_in_runs(self, texts: list[str], cut: Any) -> list[Vector]:
        import numpy as np

        vectors: list[Vector] = [np.empty(0, dtype=np.float32)] * len(texts)
        for run, pooled in MiniLMEmbedding.runs(self, texts, cut):
            for row, i in enumerate(run):
                vectors[i] = pooled[row]
        return vectors

    @staticmethod
    def name() -> str:
        return "bench_minilm_runs_of_32"


EMBEDDINGS = {"after": "minilm", "before": "benchmarks.embed_drain:RunsOf32"}


def embedder_rates(texts: list[str], batch: int) -> dict[str, float]:
    """Texts per second for each way of cutting, every batch embedded once per cut; the cuts
    take turns batch by batch, so a slow moment lands on all of them."""
    from outbox.sinks.embed_runs import cut_runs

    cuts = {LIBRARY_CUT: cut_runs, **{f"{n} a run": fixed_cut(n) for n in FIXED_RUNS}}
    model = MiniLMEmbedding()
    model(texts[:batch])  # warm-up, untimed
    spent = dict.fromkeys(cuts, 0.0)
    for start in range(0, len(texts), batch):
        chunk = texts[start : start + batch]
        for name, cut in cuts.items():
            tick = time.perf_counter()
            model.embed_in_runs(chunk, cut)
            spent[name] += time.perf_counter() - tick
    return {name: len(texts) / seconds for name, seconds in spent.items()}


def reference(locomo: Path, count: int, settings: Settings) -> dict[str, float]:
    """``embedder_rates`` in a child at the dispatcher's priority and embedding threads."""
    env = dict(os.environ, OUTBOX_EMBED_THREADS=str(settings.embed_threads))
    command = [sys.executable, "-m", "benchmarks.embed_drain", "--rates-only"]
    command += ["--locomo", str(locomo), "--count", str(count)]
    command += ["--batch", str(settings.batch_size), "--nice", str(settings.run_nice)]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, check=True, text=True)
    rates: dict[str, float] = json.loads(done.stdout)
    return rates


def prefill_texts(settings: Settings, texts: list[str]) -> None:
    with open_outbox(settings) as outbox:
        outbox.add_many({"content": text, "tags": ["locomo"]} for text in texts)


def drain_once(folder: Path, texts: list[str], embedding: str, nice: int) -> dict[str, Any]:
    """One ``outbox run`` draining ``texts`` into a fresh store's shared Chroma server."""
    from tests.chroma_server import stop_servers_under

    settings = bench_settings(folder, sinks="chroma", embedding=embedding, run_nice=nice)
    prefill_texts(settings, texts)
    env = {"OUTBOX_EMBEDDING": embedding, "OUTBOX_RUN_NICE": str(nice), "PYTHONPATH": str(REPO)}
    try:
        return drain_run(settings, "chroma", len(texts), 1, folder / "logs", extra_env=env)
    finally:
        stop_servers_under(folder)


def run(folder: Path, locomo: Path, count: int, rounds: int, nice: int | None) -> dict[str, Any]:
    """Reference and drains (the embedder now, and as it was) in alternating rounds; each
    figure is the median of its rounds, and the goal's ratio the median of each round's
    drain over that round's best cut.
    ``nice`` None: the daemon's default priority, for the child and the dispatcher alike."""
    texts = locomo_texts(locomo, count)
    defaults = bench_settings(folder / "defaults")
    if nice is not None:
        defaults = bench_settings(folder / "defaults", run_nice=nice)
    references: list[dict[str, float]] = []
    drains: dict[str, list[dict[str, Any]]] = {name: [] for name in EMBEDDINGS}
    for number in range(rounds):
        references.append(reference(locomo, len(texts), defaults))
        for name, embedding in EMBEDDINGS.items():
            where = folder / f"drain-{name}-{number}"
            drains[name].append(drain_once(where, texts, embedding, defaults.run_nice))
    per_cut = {name: statistics.median(r[name] for r in references) for name in references[0]}
    best = max(per_cut, key=per_cut.__getitem__)
    rates = {name: statistics.median(d["per_s"] for d in runs) for name, runs in drains.items()}
    # Each round's drain over that round's best cut: a neighbour's burst in one round moves
    # one ratio, and the median of them stands.
    ratios = [
        drained["per_s"] / max(reference.values())
        for drained, reference in zip(drains["after"], references, strict=True)
    ]
    ratio = statistics.median(ratios)
    return {
        "texts": len(texts),
        "rounds": rounds,
        "batch": defaults.batch_size,
        "nice": defaults.run_nice,
        "embedder_per_s": per_cut,
        "references": references,
        "best_cut": best,
        "best_per_s": per_cut[best],
        "drain_per_s": rates,
        "drains": drains,
        "round_ratios": ratios,
        "ratio": ratio,
        "goal": GOAL,
        "met": ratio >= GOAL,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--count", type=int, default=768, help="LoCoMo turns to drain")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--priority", type=int, default=None, help="nice for both sides (default: the daemon's)"
    )
    parser.add_argument("--folder", type=Path, default=None, help="scratch folder")
    parser.add_argument("--rates-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--nice", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rates_only:
        os.nice(args.nice)
        print(json.dumps(embedder_rates(locomo_texts(args.locomo, args.count), args.batch)))
        return 0
    import tempfile

    with tempfile.TemporaryDirectory(dir=args.folder) as scratch:
        before = load_average()
        result = run(Path(scratch), args.locomo, args.count, args.rounds, args.priority)
    result.update(commit=head_commit(), load_before=before, load_after=load_average())
    write_result(RESULTS, result)
    print(json.dumps({k: v for k, v in result.items() if k != "drains"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
