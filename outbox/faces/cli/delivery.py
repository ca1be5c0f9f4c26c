"""``outbox drain``, ``outbox run`` and ``outbox dead``: delivering, and steering what could
not be delivered. The dispatcher and sinks load only inside these commands."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from outbox.core.errors import ValidationError
from outbox.faces.cli import numbers
from outbox.faces.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    AddCommand,
    Subcommands,
    add_verbosity,
    emit,
    lower_priority,
    open_outbox,
)

if TYPE_CHECKING:
    from outbox import DeliveryRow, Outbox
    from outbox.dispatch.dispatcher import Dispatcher, DrainReport
    from outbox.dispatch.worker import SinkProgress

log = logging.getLogger(__name__)


class _ProgressLine:
    """A one-line progress bar on a terminal's stderr. Off a terminal there is none: the
    summary on stdout says it once, and ``-v`` logs a line per batch."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done: dict[str, int] = {}

    def __call__(self, progress: SinkProgress) -> None:
        self.done[progress.sink] = progress.delivered + progress.dead
        parts = []
        for sink, count in self.done.items():
            share = count / self.total if self.total else 1.0
            bar = "#" * int(share * 20)
            parts.append(f"{sink} [{bar:<20}] {count}/{self.total}")
        sys.stderr.write("\r" + "  ".join(parts))
        sys.stderr.flush()

    def finish(self) -> None:
        if self.done:
            sys.stderr.write("\n")


def _drain_text(report: DrainReport) -> str:
    lines = []
    for sink, progress in report.sinks.items():
        left = report.remaining.get(sink, {})
        lines.append(
            f"{sink}: delivered {progress.delivered}"
            + (f", deleted {progress.deleted}" if progress.deleted else "")
            + f"; now pending {left.get('pending', 0)}, "
            f"leased {left.get('leased', 0)}, dead {left.get('dead', 0)}"
        )
    if report.timed_out:
        lines.append(
            f"the timeout ran out after {report.elapsed:.1f}s with rows another dispatcher holds"
        )
    lines.append("all delivered" if report.ok else "some records are still pending or dead")
    return "\n".join(lines)


def _source(ob: Outbox) -> str:
    """Where a dispatcher drains from and to, for its first log line (no password)."""
    from sqlalchemy.engine import make_url

    database = make_url(ob.settings.db_url).render_as_string(hide_password=True)
    return f"{database} into {', '.join(ob.settings.sinks)}"


def _totals(progress: dict[str, SinkProgress]) -> str:
    """What each sink did, for the last log line."""
    return "; ".join(
        f"{sink}: delivered {p.delivered}"
        + (f", deleted {p.deleted}" if p.deleted else "")
        + f", retried {p.retried}, dead {p.dead}"
        for sink, p in progress.items()
    )


def cmd_drain(args: argparse.Namespace) -> int:
    lower_priority()
    with open_outbox() as ob:
        shown = sys.stderr.isatty() and not (args.json or args.quiet)
        progress = _ProgressLine(ob.undelivered_count()) if shown else None
        log.info("draining %s", _source(ob))
        report = ob.drain(timeout=args.timeout, on_progress=progress)
        if progress:
            progress.finish()
    log.info("drain done in %.1f s: %s", report.elapsed, _totals(report.sinks))
    emit(args, report.to_dict(), _drain_text(report))
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_run(args: argparse.Namespace) -> int:
    import signal
    import threading

    lower_priority()
    stop = threading.Event()

    def _stop(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    started = time.monotonic()
    with open_outbox(create=True) as ob, ob.dispatcher() as dispatcher:
        port = ob.settings.metrics_port if args.metrics_port is None else args.metrics_port
        with _metrics(dispatcher, port) as url:
            served = f"; metrics on {url}" if url else ""
            log.info("dispatcher %s running: draining %s%s", dispatcher.owner, _source(ob), served)
            dispatcher.run(stop)
        done = {name: worker.progress for name, worker in dispatcher.workers.items()}
    log.info("dispatcher stopped after %.1f s: %s", time.monotonic() - started, _totals(done))
    return EXIT_OK


def _metrics(dispatcher: Dispatcher, port: int) -> contextlib.AbstractContextManager[str | None]:
    """The Prometheus endpoint on 127.0.0.1:``port`` for the daemon's life (0: none)."""
    if not port:
        return contextlib.nullcontext()
    from outbox.faces.metrics import serve_metrics

    return serve_metrics(dispatcher, port)


def _dead_view(row: DeliveryRow) -> dict[str, Any]:
    return {
        "key": row.key,
        "sink": row.sink,
        "attempts": row.attempts,
        "reason": row.error_class,
        "error": row.last_error,
    }


def _one_line(error: str | None, limit: int = 200) -> str:
    """A stored error as one line of at most ``limit`` characters (the full text: dead show)."""
    text = " ".join((error or "none recorded").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _dead_list(args: argparse.Namespace, ob: Outbox) -> None:
    rows = ob.dead.list(sink=args.sink, limit=args.limit)
    text = "\n".join(
        f"{row.key}  {row.sink}  attempts={row.attempts}  reason={row.error_class}  "
        f"error: {_one_line(row.last_error)}"
        for row in rows
    )
    emit(args, {"dead": [_dead_view(row) for row in rows]}, text or "no dead letters")


def _dead_show(args: argparse.Namespace, ob: Outbox) -> None:
    found = ob.deliveries_of(args.keys)
    shown: list[dict[str, Any]] = []
    for key in args.keys:
        rows = found.get(key, [])
        markdown: Path | None = ob.markdown_path(key) if rows else None
        shown += [
            {**_dead_view(row), "state": row.state, "markdown": markdown and str(markdown)}
            for row in rows
        ]
    if not shown:
        raise ValidationError("keys", "no record with those keys")
    text = "\n".join(
        f"{d['key']}  {d['sink']}  {d['state']}  attempts={d['attempts']}  "
        f"reason={d['reason']}\n  error: {d['error']}\n  file: {d['markdown']}"
        for d in shown
    )
    emit(args, {"deliveries": shown}, text)


def cmd_dead(args: argparse.Namespace) -> int:
    acts = args.action in ("retry", "discard")
    if acts and not args.keys and not args.all:
        raise ValidationError("keys", "name the keys to act on, or pass --all")
    with open_outbox() as ob:
        args.keys = [ob.catalog.resolve(key) for key in args.keys]  # a unique prefix serves
        if args.action == "list":
            _dead_list(args, ob)
        elif args.action == "show":
            _dead_show(args, ob)
        else:
            keys = None if args.all else args.keys
            change = ob.dead.retry if args.action == "retry" else ob.dead.discard
            verb = "requeued" if args.action == "retry" else "discarded"
            count = change(keys, sink=args.sink)
            emit(args, {verb: count}, f"{verb} {count} dead letter(s)")
    return EXIT_OK


def register_drain_run(command: AddCommand) -> None:
    drain = command("drain", cmd_drain, "deliver what is due, then stop")
    drain.add_argument(
        "--timeout",
        type=numbers.positive_seconds,
        default=None,
        metavar="S",
        help="wait up to S seconds (above 0) for rows another dispatcher holds",
    )
    run = command(
        "run", cmd_run, "the dispatcher daemon (stops cleanly on SIGTERM/SIGINT)", json_flag=False
    )
    run.add_argument(
        "--metrics-port",
        type=numbers.port_or_zero,
        metavar="N",
        help="serve Prometheus metrics on 127.0.0.1:N (default OUTBOX_METRICS_PORT; 0: none)",
    )


def register_dead(command: AddCommand) -> None:
    dead = command("dead", cmd_dead, "list, show, retry or discard dead letters")
    actions = Subcommands(dead, "action", "ACTION")

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add(name, help_text)
        # Also after the action (``dead list --json``), without undoing ``dead --json list``.
        sub.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON object"
        )
        add_verbosity(sub, subcommand=True)
        return sub

    listing = action("list", "every dead letter: key, sink, attempts, reason")
    listing.set_defaults(keys=[])
    listing.add_argument("--sink", help="only this sink")
    listing.add_argument(
        "--limit", type=numbers.positive_int, default=100, help="how many to list, 1 or more"
    )
    show = action("show", "every sink's row of these records, the last error, the file")
    show.add_argument("keys", nargs="+", metavar="KEY", help="a key or a unique prefix of one")
    for name, does in (("retry", "fresh attempts for"), ("discard", "never retry")):
        change = action(name, f"{does} these dead letters (KEY…, or --all)")
        change.add_argument("keys", nargs="*", metavar="KEY", help="a key or a unique prefix")
        change.add_argument("--all", action="store_true", help="every dead letter")
        change.add_argument("--sink", help="only this sink")
