"""``outbox rebuild``: recreate a lost or corrupt database from the JSONL log, the markdown
files and the fallback queue. Long-running: each phase's progress goes to stderr; a run that
is killed can simply be run again."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from outbox.faces.cli.common import EXIT_OK, AddCommand, emit
from outbox.faces.cli.progress import StatusLine

if TYPE_CHECKING:
    from outbox.operations.rebuild import RebuildReport


class _Progress:
    """Phase and count; a new phase starts its own line."""

    def __init__(self) -> None:
        self.line = StatusLine()
        self.phase = ""

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        changed = phase != self.phase
        if changed:
            self.line.finish()
        self.phase = phase
        count = f"{done}/{total}" if total else (str(done) if done else "")
        final = total is not None and done >= total
        self.line.show(f"rebuild: {phase} {count}".rstrip(), always=changed or final)

    def finish(self) -> None:
        self.line.finish()


def _text(report: RebuildReport) -> str:
    lines = [
        f"rebuilt {report.database}: {report.restored} records back "
        f"({report.from_log} from the log, {report.from_markdown} only in markdown files), "
        f"{report.already_there} already there",
        f"deliveries the log recorded: {report.delivered} delivered, {report.dead} dead, "
        f"{report.discarded} discarded; {report.pending} pending (a sink takes a repeat by key)",
        f"mirrors: {report.lines_appended} log lines appended, "
        f"{report.files_written} markdown files written",
    ]
    if report.forgotten_left_out:
        lines.append(
            f"forgotten records: {report.forgotten_left_out}, put back as "
            f"{report.tombstones} tombstones without content"
        )
    if report.forgets_applied or report.forgets_finished:
        lines.append(
            f"forgets the log records: {report.forgets_applied} live records of the database "
            f"made tombstones, {report.forgets_finished} cut-off forgets finished"
        )
    if report.unkeyed_files:
        lines.append(
            f"markdown files without a key left for `outbox replay`: {report.unkeyed_files}"
        )
    lines += [f"moved aside: {path}" for path in report.moved_aside]
    lines += [f"problem: {problem}" for problem in report.problems]
    resumed = ", resuming an unfinished run" if report.resumed else ""
    lines.append(f"done in {report.seconds:.1f}s{resumed}; `outbox verify` checks the result")
    return "\n".join(lines)


def cmd_rebuild(args: argparse.Namespace) -> int:
    from outbox.core.config import load_settings
    from outbox.operations.rebuild import rebuild

    progress = _Progress()
    try:
        report = rebuild(load_settings(), merge=args.merge, progress=progress)
    finally:
        progress.finish()
    emit(args, report.to_dict(), _text(report))
    return EXIT_OK


def register(command: AddCommand) -> None:
    rebuild = command(
        "rebuild",
        cmd_rebuild,
        "recreate a lost or corrupt database from the JSONL log, markdown files and fallback queue",
    )
    rebuild.add_argument(
        "--merge",
        action="store_true",
        help="the database is readable and holds records: add only what it lacks",
    )
