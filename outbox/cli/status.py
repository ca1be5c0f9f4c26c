"""``outbox status`` and ``outbox verify``: how far delivery got, and whether the mirrors
still agree with the database."""

from __future__ import annotations

import argparse
from typing import Any

from outbox.cli.common import EXIT_FAILED, EXIT_OK, AddCommand, emit, open_outbox


def status_text(status: dict[str, Any]) -> str:
    """``Outbox.status()`` as a table, with one line per sink that is failing right now."""
    lines = [f"records: {status['records']}"]
    header = f"{'sink':<24}{'pending':>9}{'leased':>8}{'delivered':>11}{'dead':>6}  oldest pending"
    lines.append(header)
    for sink, row in status["sinks"].items():
        age = row["oldest_pending_age"]
        age_text = "-" if age is None else f"{age:.1f}s"
        lines.append(
            f"{sink:<24}{row['pending']:>9}{row['leased']:>8}{row['delivered']:>11}"
            f"{row['dead']:>6}  {age_text}"
        )
    for sink, row in status["sinks"].items():
        if row["retrying"]:
            lines.append(
                f"{sink}: {row['retrying']} pending after a failure, "
                f"the latest {row['last_failure']}"
            )
    lines.append(f"dead letters: {status['dead_letters']}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    with open_outbox() as ob:
        status = ob.status()
    emit(args, status, status_text(status))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    # A plain verify only reads: it must not repair what it is there to report.
    with open_outbox(repair=args.repair) as ob:
        if args.repair:
            ob.sync_mirrors(full=True)
        report = ob.verify()
    payload = {
        "ok": report.ok,
        "records": report.records,
        "jsonl_lines": report.jsonl_lines,
        "markdown_files": report.markdown_files,
        "problems": report.problems,
    }
    summary = (
        f"{'OK' if report.ok else 'MISMATCH'}: {report.records} records, "
        f"{report.jsonl_lines} JSONL lines, {report.markdown_files} markdown files"
    )
    emit(args, payload, "\n".join([summary, *report.problems]))
    return EXIT_OK if report.ok else EXIT_FAILED


def register(command: AddCommand) -> None:
    command("status", cmd_status, "counts per sink and state, oldest pending age, dead letters")
    verify = command("verify", cmd_verify, "check that mirrors and database agree")
    verify.add_argument(
        "--repair", action="store_true", help="first rewrite whatever any record's mirrors lack"
    )
