"""``outbox show`` and ``outbox export``: one record whole, or every record for another tool.

Both take what the catalog gives (``Outbox.catalog``); a KEY is a key or a unique prefix.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from outbox.faces.cli.common import EXIT_FAILED, EXIT_OK, AddCommand, emit, fail, open_outbox


def cmd_show(args: argparse.Namespace) -> int:
    from outbox.operations.catalog import NoSuchRecord

    with open_outbox(repair=False) as ob:
        ob.refuse_if_empty()  # "no such record" would be untrue of a lost database
        try:
            view = ob.catalog.show(args.key)
        except NoSuchRecord as exc:
            return fail(str(exc), EXIT_FAILED)
    shown = view.to_dict()
    sinks = "\n".join(
        f"  {s['sink']}: {s['state']}, attempts {s['attempts']}"
        + (f", id {s['sink_id']}" if s["sink_id"] else "")
        + (f", last failure {s['reason']}" if s["reason"] else "")
        for s in shown["sinks"]
    )
    text = (
        f"key: {shown['key']}\ntimestamp: {shown['timestamp']}\n"
        f"importance: {shown['importance']}\ntags: {', '.join(shown['tags']) or '-'}\n"
        f"metadata: {shown['metadata'] or '-'}\nsinks:\n{sinks or '  (none)'}\n"
        f"markdown: {shown['markdown_path'] or '- (forgotten)'}\n"
        f"JSONL lines: {', '.join(map(str, shown['jsonl_lines'])) or '-'}\n"
        + (
            f"---\n{shown['content']}"
            if shown["forgotten_at"] is None
            else f"forgotten: {_utc(shown['forgotten_at'])} (content, tags and metadata removed)"
        )
    )
    emit(args, shown, text)
    return EXIT_OK


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat(timespec="seconds")


def _progress(count: int) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\rexported {count:,}")


def cmd_export(args: argparse.Namespace) -> int:
    with open_outbox(repair=False) as ob:
        ob.refuse_if_empty()  # an empty export would be untrue of a lost database
        if args.format == "markdown":
            if args.dest is None:
                return fail("DEST: name the folder to export markdown files into", 2)
            count = ob.catalog.export_markdown(Path(args.dest), _progress)
        elif args.dest is None or args.dest == "-":
            count = ob.catalog.export_jsonl(sys.stdout, None)
        else:
            with Path(args.dest).open("x", encoding="utf-8") as out:
                count = ob.catalog.export_jsonl(out, _progress)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    if args.dest not in (None, "-"):
        sys.stderr.write(f"exported {count} records to {args.dest}\n")
    return EXIT_OK


def register(command: AddCommand) -> None:
    show = command("show", cmd_show, "one record: content, metadata, each sink's state, files")
    show.add_argument("key", metavar="KEY", help="a key or a unique prefix of one")
    export = command("export", cmd_export, "every record, for another tool", json_flag=False)
    export.add_argument("--format", choices=["jsonl", "markdown"], default="jsonl")
    export.add_argument(
        "dest", nargs="?", metavar="DEST", help="file or folder (JSONL: - or none for stdout)"
    )
