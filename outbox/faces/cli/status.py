"""``outbox status`` and ``outbox verify``: how far delivery got, and whether the mirrors
still agree with the database."""

from __future__ import annotations

import argparse
import time
from typing import Any

from outbox.core.states import DeliveryState
from outbox.faces.cli.common import EXIT_FAILED, EXIT_OK, AddCommand, emit, open_outbox


def status_text(status: dict[str, Any], now: float | None = None) -> str:
    """``Outbox.status()`` as a table sized to its longest sink name, one line per sink that is
    failing right now (with the error), and the dispatchers: alive, gone or stopped."""
    now = time.time() if now is None else now
    forgotten = status.get("forgotten", 0)
    lines = [f"records: {status['records']}" + (f" (forgotten: {forgotten})" if forgotten else "")]
    missing = status.get("missing")
    if missing:
        waiting = missing["fallback_waiting"]
        wait = "write waits" if waiting == 1 else "writes wait"
        lines.append(
            f"warning: the database holds {missing['database_records']} records; the log holds "
            f"{missing['log_records']}; {waiting} {wait} in the fallback queue; "
            f"run `{missing['run']}`"
        )
    states = [str(state) for state in DeliveryState]
    width = max([len("sink"), *map(len, status["sinks"])]) + 2
    header = "".join(f"{state:>{max(len(state), 4) + 2}}" for state in states)
    lines.append(f"{'sink':<{width}}{header}  oldest pending")
    for sink, row in status["sinks"].items():
        age = row["oldest_pending_age"]
        cells = "".join(f"{row.get(state, 0):>{max(len(state), 4) + 2}}" for state in states)
        lines.append(f"{sink:<{width}}{cells}  {'-' if age is None else f'{age:.1f}s'}")
    for sink, row in status["sinks"].items():
        if row["retrying"]:
            latest = row.get("last_error") or {}
            lines.append(
                f"{sink}: {row['retrying']} pending after a failure; the latest "
                f"({latest.get('key', '?')}, {row['last_failure']}): "
                f"{_one_line(latest.get('error'))}"
            )
    lines.append(f"dead letters: {status['dead_letters']}")
    waiting = status.get("fallback_waiting", 0)
    if waiting and not missing:
        lines.append(
            f"fallback queue: {waiting} {'write waits' if waiting == 1 else 'writes wait'} for "
            "the database (outbox replay imports them; so does a running outbox run)"
        )
    lines += _dispatcher_lines(status.get("dispatchers", []), now)
    return "\n".join(lines)


def _one_line(text: str | None, limit: int = 300) -> str:
    flat = " ".join((text or "no error text recorded").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _dispatcher_lines(dispatchers: list[dict[str, Any]], now: float) -> list[str]:
    """One line per ``outbox run`` on record; a gone one says when it was last heard of."""
    if not dispatchers:
        return ["dispatchers: none running (start one with outbox run)"]
    lines = ["dispatchers:"]
    for d in dispatchers:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["started_at"]))
        batch = d["last_batch_at"]
        since = "no batch yet" if batch is None else f"last batch {now - batch:.1f}s ago"
        if d["state"] == "alive":
            health = f"{d['records_per_second']:.1f} records/s, {since}"
        elif d["state"] == "gone":
            health = (
                f"no heartbeat for {d['beat_age']:.1f}s (bound {d['gone_after']:.0f}s): "
                "it died without stopping; the next drain or run takes back its leased rows"
            )
        else:
            health = f"stopped {now - d['stopped_at']:.0f}s ago"
        lines.append(
            f"  {d['host']}:{d['pid']}  {d['state']:<7}  started {started}  "
            f"delivered {d['delivered']}, failed {d['failed']}  {health}"
        )
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    with open_outbox() as ob:
        status = ob.status()
    emit(args, status, status_text(status))
    return EXIT_OK


# Key prefixes a ``--repair`` line names before it says only how many more there are.
SHOWN_KEYS = 10


def _restored_lines(restored: dict[str, list[str]], temps_removed: int) -> list[str]:
    """What a repair put back, a line per kind: how many, and the records' key prefixes
    (never a file's name, which carries the first words of its memory); and how many temp
    files of killed writers it removed."""
    lines = []
    for what, prefixes in restored.items():
        shown = ", ".join(prefixes[:SHOWN_KEYS])
        more = f" and {len(prefixes) - SHOWN_KEYS} more" if len(prefixes) > SHOWN_KEYS else ""
        lines.append(f"restored {what}: {len(prefixes)} ({shown}{more})")
    if temps_removed:
        lines.append(f"removed stale temporary files: {temps_removed}")
    return lines or ["repair: nothing to restore"]


def cmd_verify(args: argparse.Namespace) -> int:
    from outbox.core.naming import key_prefix

    # A plain verify only reads: it must not repair what it is there to report. A repair
    # is the full one alone, so its report holds everything the open would have put back.
    with open_outbox(repair=False) as ob:
        repaired = ob.sync_mirrors(full=True) if args.repair else None
        report = ob.verify()
    payload: dict[str, Any] = {
        "ok": report.ok,
        "records": report.records,
        "forgotten": report.forgotten,
        "jsonl_lines": report.jsonl_lines,
        "markdown_files": report.markdown_files,
        "problems": report.problems,
    }
    lines = []
    if repaired is not None:
        restored = {
            str(what): [key_prefix(key) for key in dict.fromkeys(keys)]
            for what, keys in repaired.restored.items()
        }
        payload["restored"] = restored
        payload["temps_removed"] = repaired.temps_removed
        lines = _restored_lines(restored, repaired.temps_removed)
    forgotten = f" ({report.forgotten} forgotten)" if report.forgotten else ""
    summary = (
        f"{'OK' if report.ok else 'MISMATCH'}: {report.records} records{forgotten}, "
        f"{report.jsonl_lines} JSONL lines, {report.markdown_files} markdown files"
    )
    emit(args, payload, "\n".join([*lines, summary, *report.problems]))
    return EXIT_OK if report.ok else EXIT_FAILED


def register(command: AddCommand) -> None:
    command(
        "status",
        cmd_status,
        "counts per sink and state, oldest pending age, dead letters, dispatchers alive or gone",
    )
    verify = command("verify", cmd_verify, "check that mirrors and database agree")
    verify.add_argument(
        "--repair", action="store_true", help="first rewrite whatever any record's mirrors lack"
    )
