"""``outbox reindex``: re-embed every record for ``OUTBOX_EMBEDDING`` into a new Chroma
collection, then switch recall and delivery to it. Long-running: progress goes to stderr, a
SIGINT or SIGTERM stops it after the batch under way, and running it again resumes."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import TYPE_CHECKING

from outbox.faces.cli import numbers
from outbox.faces.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    AddCommand,
    emit,
    fail,
    lower_priority,
    open_outbox,
)
from outbox.faces.cli.progress import StatusLine

if TYPE_CHECKING:
    from outbox.operations.reindex import ReindexProgress, ReindexReport


class _Progress:
    """done/total, rate and time left."""

    def __init__(self) -> None:
        self.line = StatusLine()

    def __call__(self, progress: ReindexProgress) -> None:
        eta = "-" if progress.eta is None else f"{progress.eta:.0f}s"
        text = (
            f"reindex: {progress.done}/{progress.total} records, {progress.rate:.0f}/s, ETA {eta}"
        )
        self.line.show(text, always=progress.done >= progress.total)

    def finish(self) -> None:
        self.line.finish()


def _text(report: ReindexReport) -> str:
    if report.status == "nothing to do":
        return (
            f"nothing to do: collection {report.collection!r} already holds vectors from "
            f"OUTBOX_EMBEDDING={report.embedding}"
        )
    if report.status == "interrupted":
        return f"interrupted after {report.records} records; run `outbox reindex` again to resume"
    previous = f", {report.previous!r} dropped" if report.previous else ""
    forgotten = f", {report.forgotten} forgotten left out" if report.forgotten else ""
    return (
        f"done: {report.records} records in {report.collection!r} "
        f"({report.embedded} embedded by this run{forgotten}, {report.seconds:.1f}s){previous}"
    )


def cmd_reindex(args: argparse.Namespace) -> int:
    lower_priority()  # it embeds every record, as a backfill does
    stop = threading.Event()

    def _stop(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    progress = _Progress()
    try:
        with open_outbox() as ob:
            report = ob.reindex(progress=progress, stop=stop, batch=args.batch)
    finally:
        progress.finish()
    emit(args, report.to_dict(), _text(report))
    if not report.ok:
        return fail("reindex interrupted; run it again to resume", EXIT_FAILED)
    return EXIT_OK


def register(command: AddCommand) -> None:
    reindex = command(
        "reindex",
        cmd_reindex,
        "re-embed every record into a new Chroma collection for OUTBOX_EMBEDDING, then switch",
    )
    reindex.add_argument(
        "--batch",
        type=numbers.positive_int,
        default=256,
        help="records per embedding batch, 1 or more (default 256)",
    )
