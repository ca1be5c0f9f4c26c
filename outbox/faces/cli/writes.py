"""``outbox add`` and ``outbox replay``: the commands that bring records in.

``add`` validates before it opens anything and imports the write path only after that, so
bad input leaves no trace and a good one starts fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from outbox.core.errors import ValidationError
from outbox.faces.cli import numbers
from outbox.faces.cli.common import EXIT_FAILED, EXIT_OK, AddCommand, emit, open_outbox
from outbox.faces.cli.progress import StatusLine

if TYPE_CHECKING:
    from outbox.api import Outbox
    from outbox.core.config import Settings
    from outbox.core.errors import DatabaseLacksRecords
    from outbox.core.receipt import Receipt
    from outbox.write.replay import ReplayReport


def _read_content(text: str | None) -> str:
    """TEXT itself, or standard input for ``-`` (or no TEXT when input is piped)."""
    if text is not None and text != "-":
        return text
    if text is None and sys.stdin.isatty():
        raise ValidationError("content", "give TEXT, or - to read it from standard input")
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValidationError("content", "standard input is not valid UTF-8") from None


def cmd_add(args: argparse.Namespace) -> int:
    from outbox.core.config import load_settings
    from outbox.core.record import build_record

    settings = load_settings()
    content = _read_content(args.text)
    fields = {
        "importance": args.importance,
        "tags": args.tag,
        "timestamp": args.timestamp,
        "slug": args.slug,
    }
    # Validate before opening anything, so bad input leaves no trace at all.
    record = build_record(
        content,
        min_length=settings.min_content_length,
        max_bytes=settings.max_content_bytes,
        **fields,
    )
    from outbox.write.direct import add

    # A store in its steady state is written without loading the full outbox (SQLAlchemy).
    direct = add(settings, record)
    if direct is not None:
        receipt = direct.receipt
        if direct.repair_owed:
            _repair(settings)
    else:
        receipt, missing = _add_through_outbox(settings, content, fields)
        if missing is not None:  # the receipt says where the write is; this, what to run
            sys.stderr.write(f"outbox: {missing}\n")
    emit(args, receipt.to_dict(), receipt.text)
    return EXIT_OK


def _add_through_outbox(
    settings: Settings, content: str, fields: dict[str, Any]
) -> tuple[Receipt, DatabaseLacksRecords | None]:
    """The write through the full outbox: a new store, a schema to migrate, mirror places
    to record, or another backend; and what the database lacks, when the write fell back
    because its log names records it does not hold."""
    from outbox.api import Outbox
    from outbox.core.states import ReceiptStatus

    # The write first, the open-time repair after it: on a locked database the command then
    # waits one busy timeout, not two (one for the repair, another for the write).
    with Outbox.open(settings, repair=False) as ob:
        receipt = ob.add(content, **fields)
        if receipt.status != ReceiptStatus.FALLBACK:
            _sync(ob)
    return receipt, ob.missing


def _repair(settings: Settings) -> None:
    """The repair a direct write found owed (crash leftovers, fallback files, outcomes).
    The write is committed whatever happens here: a failure only leaves the repair to the
    next open."""
    from outbox.api import Outbox

    try:
        with Outbox.open(settings, repair=False) as ob:
            ob.sync_mirrors()
    except Exception as exc:
        _repair_skipped(exc)


def _sync(ob: Outbox) -> None:
    try:
        ob.sync_mirrors()
    except Exception as exc:  # the write stands, committed; the next open repairs
        _repair_skipped(exc)


def _repair_skipped(exc: Exception) -> None:
    logging.getLogger("outbox").warning(
        "mirror repair after the write skipped (%s)", exc.__class__.__name__
    )


def cmd_replay(args: argparse.Namespace) -> int:
    from outbox.core.config import load_settings

    settings = load_settings()
    folder = Path(args.dir) if args.dir else settings.markdown_dir
    if not settings.home.is_dir():
        # No store yet: only files to import make one; a refusal or nothing to do leaves
        # no trace.
        from outbox.write.replay import survey

        report = survey(folder, settings, args.budget)
        if report.refused or not report.pending:
            return _replay_report(args, report)
    with open_outbox(create=True) as ob:
        bar = None if args.json else _ReplayBar()
        report = ob.replay(folder, budget=args.budget, progress=bar)
        if bar:
            bar.line.finish()
    return _replay_report(args, report)


def _replay_report(args: argparse.Namespace, report: ReplayReport) -> int:
    """The owner's report: counts, then each skipped file by its path (they run replay in
    their own terminal, over their own files), warnings by key prefix."""
    lines = [
        f"{len(report.imported)} imported, {len(report.already)} already in the outbox, "
        f"{len(report.skipped)} skipped, {report.not_reached} left for a later run"
    ]
    lines += [f"skipped {report.path_of(path)}: {why}" for path, why in report.skipped]
    lines += [f"warning: {text}" for text in report.warnings]
    if report.refused:
        lines = [f"refused: {report.refused}; nothing imported"]
    emit(args, report.to_dict(), "\n".join(lines))
    return EXIT_OK if report.ok else EXIT_FAILED


class _ReplayBar:
    """Files imported out of all, as a bar on the long commands' shared progress line."""

    def __init__(self) -> None:
        self.line = StatusLine()

    def __call__(self, done: int, total: int) -> None:
        share = done / total if total else 1.0
        text = f"replay [{'#' * int(share * 30):<30}] {done}/{total}"
        self.line.show(text, always=done >= total)


def register_add(command: AddCommand) -> None:
    add = command("add", cmd_add, "one durable write (TEXT, or - for standard input)")
    add.add_argument("text", nargs="?", metavar="TEXT")
    add.add_argument("--importance", type=str, default="5", help="1..10 (default 5)")
    add.add_argument("--tag", action="append", default=[], help="a tag; repeat for more")
    add.add_argument("--timestamp", help="ISO 8601 instant (default: now)")
    add.add_argument("--slug", help="markdown file slug (default: derived from the content)")


def register_replay(command: AddCommand) -> None:
    replay = command("replay", cmd_replay, "import pending fallback or legacy markdown files")
    replay.add_argument("dir", nargs="?", metavar="DIR", help="default: OUTBOX_MARKDOWN_DIR")
    replay.add_argument(
        "--budget",
        type=numbers.positive_int,
        default=None,
        help="import at most N (1 or more) files",
    )
