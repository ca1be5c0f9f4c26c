"""PNG figures for docs/benchmarks.md, drawn from one run's results (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LATENCY_PNG = "bench-add-latency.png"
DRAIN_PNG = "bench-drain-throughput.png"
SCALE_PNG = "bench-scale.png"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_figure(curves: dict[str, list[float]], path: Path, title: str) -> None:
    """Cumulative distribution of per-call latency (ms, log scale), one line per path; each
    curve is a list of percentiles (``compare.curve``), so the labels carry the call counts."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=110)
    for label, samples_ms in curves.items():
        ordered = sorted(samples_ms)
        if not ordered:
            continue
        fractions = [(rank + 1) / len(ordered) for rank in range(len(ordered))]
        axes.plot(ordered, fractions, label=label, linewidth=1.6)
    axes.set_xscale("log")
    axes.set_xlabel("latency per write (ms, log scale)")
    axes.set_ylabel("fraction of writes at or below")
    axes.set_ylim(0, 1.005)
    axes.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
    axes.text(axes.get_xlim()[0], 0.985, " p99", color="grey", va="top", fontsize=8)
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(loc="lower right", fontsize=8)
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def drain_figure(rows: list[tuple[str, float]], path: Path) -> None:
    """Records per second delivered, one bar per (sink, processes) configuration."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=110)
    labels = [label for label, _ in rows]
    values = [value for _, value in rows]
    bars = axes.barh(labels, values, color="#4c72b0")
    for bar, value in zip(bars, values, strict=True):
        axes.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {value:,.0f}/s",
            va="center",
            fontsize=8,
        )
    axes.set_xscale("log")
    axes.set_xlabel("records delivered per second (log scale; steady state, 10%-90% window)")
    axes.invert_yaxis()
    axes.grid(True, axis="x", which="both", linewidth=0.3)
    axes.set_title("Drain throughput by sink and dispatcher processes")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def scale_figure(scale: list[dict[str, Any]], path: Path) -> None:
    """Median add, claim, settle and pending-overlay lookup against rows in the outbox."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=110)
    rows = [entry["rows"] for entry in scale]
    for key, label in (
        ("add", "add (one write)"),
        ("claim", "claim 64"),
        ("settle", "settle 64"),
        ("pending_matches", "pending overlay FTS lookup"),
    ):
        medians = [entry[key]["median_us"] / 1000 for entry in scale]
        axes.plot(rows, medians, marker="o", label=label)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("rows in the outbox (all pending)")
    axes.set_ylabel("median (ms, log scale)")
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(fontsize=8)
    axes.set_title("Cost against outbox size")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def recall_figure(result: dict[str, Any], path: Path) -> None:
    """hit@10 of each leg, the fusion and the baselines, before the embed and after the drain."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=110)
    rows = [
        (f"{name} ({phase.replace('_', ' ')})", scores["hit@10"])
        for phase in ("before_embed", "after_drain")
        for name, scores in result[phase].items()
    ]
    bars = axes.barh([label for label, _ in rows], [value for _, value in rows], color="#4c72b0")
    for bar, (_, value) in zip(bars, rows, strict=True):
        axes.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.3f}", va="center")
    axes.set_xlim(0, 1)
    axes.set_xlabel("hit@10 (answering turn in the top 10)")
    axes.invert_yaxis()
    axes.set_title(f"Recall on {result['dataset']} ({result['questions']} questions)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
