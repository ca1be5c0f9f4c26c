"""The ``outbox`` command (contract section 8).

Errors are one line on stderr, never a traceback; ``--json`` prints one object on stdout.
Heavy modules are imported inside the command that needs them so ``outbox add`` starts fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from outbox.errors import ConfigError, OutboxError, ValidationError

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def _emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(payload, ensure_ascii=False, default=str) + "\n")
    elif text:
        sys.stdout.write(text.rstrip("\n") + "\n")


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"outbox: {message}\n")
    return code


def _open() -> Any:
    from outbox.api import Outbox

    return Outbox.open()


# -- add ---------------------------------------------------------------------------------


def _read_content(text: str | None) -> str:
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
    from outbox.config import load_settings
    from outbox.record import build_record

    settings = load_settings()
    content = _read_content(args.text)
    # Validate before opening anything, so bad input leaves no trace at all.
    build_record(
        content,
        importance=args.importance,
        tags=args.tag,
        timestamp=args.timestamp,
        slug=args.slug,
        min_length=settings.min_content_length,
        max_bytes=settings.max_content_bytes,
    )
    from outbox.api import Outbox
    from outbox.fallback import UNAVAILABLE
    from outbox.receipt import FALLBACK

    # The write first, the open-time repair after it: on a locked database the command then
    # waits one busy timeout, not two (one for the repair, another for the write).
    with Outbox.open(settings, repair=False) as ob:
        receipt = ob.add(
            content,
            importance=args.importance,
            tags=args.tag,
            timestamp=args.timestamp,
            slug=args.slug,
        )
        if receipt.status != FALLBACK:
            try:
                ob.sync_mirrors()
            except UNAVAILABLE as exc:  # the write stands; the next open repairs
                logging.getLogger("outbox").warning(
                    "mirror repair after the write skipped (%s)", exc.__class__.__name__
                )
    _emit(args, receipt.to_dict(), receipt.text)
    return EXIT_OK


# -- status / verify ---------------------------------------------------------------------


def _status_text(status: dict[str, Any]) -> str:
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
    with _open() as ob:
        status = ob.status()
    _emit(args, status, _status_text(status))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    with _open() as ob:
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
    _emit(args, payload, "\n".join([summary, *report.problems]))
    return EXIT_OK if report.ok else EXIT_FAILED


# -- delivery ----------------------------------------------------------------------------


class _ProgressLine:
    """A one-line progress display on a terminal, plain lines otherwise (both on stderr)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stderr.isatty()
        self.done: dict[str, int] = {}

    def __call__(self, progress: Any) -> None:
        self.done[progress.sink] = progress.delivered + progress.dead
        if self.tty:
            parts = []
            for sink, count in self.done.items():
                share = count / self.total if self.total else 1.0
                bar = "#" * int(share * 20)
                parts.append(f"{sink} [{bar:<20}] {count}/{self.total}")
            sys.stderr.write("\r" + "  ".join(parts))
            sys.stderr.flush()
        else:
            sys.stderr.write(
                f"{progress.sink}: delivered {progress.delivered}, retrying {progress.retried}, "
                f"dead {progress.dead}\n"
            )

    def finish(self) -> None:
        if self.tty and self.done:
            sys.stderr.write("\n")


def cmd_drain(args: argparse.Namespace) -> int:
    from outbox.dispatch.dispatcher import Dispatcher

    with _open() as ob:
        due = sum(row["pending"] + row["leased"] for row in ob.status()["sinks"].values())
        progress = None if args.json else _ProgressLine(due)
        with Dispatcher(ob, on_progress=progress) as dispatcher:
            report = dispatcher.drain(timeout=args.timeout)
        if progress:
            progress.finish()
    lines = []
    for sink, entry in report.to_dict()["sinks"].items():  # type: ignore[union-attr]
        left = entry["remaining"]
        lines.append(
            f"{sink}: delivered {entry['delivered']}; now pending {left.get('pending', 0)}, "
            f"leased {left.get('leased', 0)}, dead {left.get('dead', 0)}"
        )
    lines.append("all delivered" if report.ok else "some records are still pending or dead")
    _emit(args, report.to_dict(), "\n".join(lines))
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_run(args: argparse.Namespace) -> int:
    import signal
    import threading

    from outbox.dispatch.dispatcher import Dispatcher

    stop = threading.Event()

    def _stop(_signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    with _open() as ob, Dispatcher(ob) as dispatcher:
        logging.getLogger("outbox").info("dispatcher %s running", dispatcher.owner)
        dispatcher.run(stop)
    return EXIT_OK


def cmd_dead(args: argparse.Namespace) -> int:
    with _open() as ob:
        if args.action == "list":
            rows = ob.storage.list_deliveries("dead", sink=args.sink, limit=args.limit)
            payload = {
                "dead": [
                    {
                        "key": r.key,
                        "sink": r.sink,
                        "attempts": r.attempts,
                        "reason": r.error_class,
                        "error": r.last_error,
                    }
                    for r in rows
                ]
            }
            text = (
                "\n".join(
                    f"{r.key}  {r.sink}  attempts={r.attempts}  reason={r.error_class}"
                    for r in rows
                )
                or "no dead letters"
            )
            _emit(args, payload, text)
            return EXIT_OK
        if args.action == "show":
            found = ob.storage.deliveries_for(args.keys)
            shown = [
                {
                    "key": r.key,
                    "sink": r.sink,
                    "state": r.state,
                    "attempts": r.attempts,
                    "reason": r.error_class,
                    "error": r.last_error,
                    "markdown": str(ob.markdown_dir / stored.markdown_name) if stored else None,
                }
                for key in args.keys
                for r in found.get(key, [])
                for stored in [ob.storage.get_record(key)]
            ]
            if not shown:
                raise ValidationError("keys", "no record with those keys")
            text = "\n".join(
                f"{d['key']}  {d['sink']}  {d['state']}  attempts={d['attempts']}  "
                f"reason={d['reason']}\n  error: {d['error']}\n  file: {d['markdown']}"
                for d in shown
            )
            _emit(args, {"deliveries": shown}, text)
            return EXIT_OK
        if not args.keys and not args.all:
            raise ValidationError("keys", "name the keys to act on, or pass --all")
        keys = None if args.all else args.keys
        if args.action == "retry":
            count = ob.storage.requeue_dead(keys, sink=args.sink)
            verb = "requeued"
        else:
            count = ob.storage.discard_dead(keys, sink=args.sink)
            verb = "discarded"
        ob.sync_delivery_mirrors()
    _emit(args, {verb: count}, f"{verb} {count} dead letter(s)")
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    from pathlib import Path

    with _open() as ob:
        folder = Path(args.dir) if args.dir else ob.markdown_dir
        bar = None if args.json or not sys.stderr.isatty() else _replay_bar
        report = ob.replay(folder, budget=args.budget, progress=bar)
        if bar:
            sys.stderr.write("\n")
    lines = [
        f"{len(report.imported)} imported, {len(report.already)} already in the outbox, "
        f"{len(report.skipped)} skipped, {report.not_reached} left for a later run"
    ]
    lines += [f"skipped {name}: {why}" for name, why in report.skipped]
    lines += [f"warning: {text}" for text in report.warnings]
    if report.refused:
        lines = [f"refused: {report.refused}; nothing imported"]
    _emit(args, report.to_dict(), "\n".join(lines))
    return EXIT_OK if report.ok else EXIT_FAILED


def _replay_bar(done: int, total: int) -> None:
    share = done / total if total else 1.0
    sys.stderr.write(f"\rreplay [{'#' * int(share * 30):<30}] {done}/{total}")
    sys.stderr.flush()


# -- recall and MCP ----------------------------------------------------------------------


def _clip(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _memory_cell(row: dict[str, Any]) -> str:
    """One result's memory on one table line, alike in ``search`` and ``recent``: a plain
    memory's content, or a turn's prompt and response."""
    text = row.get("content") or f"{row.get('prompt', '')} → {row.get('response', '')}"
    return _clip(text, 80)


def cmd_search(args: argparse.Namespace) -> int:
    from outbox.memory_core import MemoryService

    service = MemoryService(_open())
    try:
        answer = service.query_raw_memories(args.query, n_results=args.n, session_id=args.session)
    finally:
        service.close()
    lines = [f"{'source':<8} {'score':>8}  {'timestamp':<27} memory"]
    for row in answer["results"]:
        lines.append(
            f"{row['source']:<8} {row['score']:>8.4f}  {row['timestamp']:<27} {_memory_cell(row)}"
        )
    if not answer["results"]:
        lines = ["no memories match"]
    if answer.get("degraded"):
        lines.append(f"note: {answer['degraded']}; showing memories found by their words only")
    _emit(args, answer, "\n".join(lines))
    return EXIT_OK


def cmd_recent(args: argparse.Namespace) -> int:
    from outbox.memory_core import MemoryService

    service = MemoryService(_open())
    try:
        answer = service.query_recent_turns(
            session_id=args.session, agent=args.agent, limit=args.limit, before=args.before
        )
    finally:
        service.close()
    lines = [f"{'timestamp':<27} {'session':<12} memory"]
    for row in answer["turns"]:
        lines.append(
            f"{row['timestamp']:<27} {str(row['sessionId'] or '-')[:12]:<12} {_memory_cell(row)}"
        )
    if not answer["turns"]:
        lines = ["no memories yet"]
    elif answer["nextCursor"]:
        cursor = answer["nextCursor"]
        lines.append(f"more: --before '{cursor['timestamp']}|{cursor['id']}'")
    _emit(args, answer, "\n".join(lines))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from outbox.demo import run

    ok = run(Path(args.dir))
    print("demo complete" if ok else "demo finished with a surprise: see the lines above")
    return EXIT_OK if ok else EXIT_FAILED


def cmd_mcp(args: argparse.Namespace) -> int:
    from outbox.mcp_server import serve

    serve(drain=args.drain, store_wait=args.store_wait)
    return EXIT_OK


# -- parser ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox", description="Durable, never-lying write path for agent memory."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO on stderr")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str,
        handler: Callable[[argparse.Namespace], int],
        help_text: str,
        json_flag: bool = True,
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if json_flag:
            sub.add_argument("--json", action="store_true", help="print one JSON object")
        sub.set_defaults(handler=handler)
        return sub

    add = command("add", cmd_add, "one durable write (TEXT, or - for standard input)")
    add.add_argument("text", nargs="?", metavar="TEXT")
    add.add_argument("--importance", type=str, default="5", help="1..10 (default 5)")
    add.add_argument("--tag", action="append", default=[], help="a tag; repeat for more")
    add.add_argument("--timestamp", help="ISO 8601 instant (default: now)")
    add.add_argument("--slug", help="markdown file slug (default: derived from the content)")

    command("status", cmd_status, "counts per sink and state, oldest pending age, dead letters")
    verify = command("verify", cmd_verify, "check that mirrors and database agree")
    verify.add_argument(
        "--repair", action="store_true", help="first rewrite whatever any record's mirrors lack"
    )

    drain = command("drain", cmd_drain, "deliver what is due, then stop")
    drain.add_argument("--timeout", type=float, default=None, help="stop claiming after S seconds")
    command(
        "run", cmd_run, "the dispatcher daemon (stops cleanly on SIGTERM/SIGINT)", json_flag=False
    )

    replay = command("replay", cmd_replay, "import pending fallback or legacy markdown files")
    replay.add_argument("dir", nargs="?", metavar="DIR", help="default: OUTBOX_MARKDOWN_DIR")
    replay.add_argument("--budget", type=int, default=None, help="import at most N files")

    search = command("search", cmd_search, "recall by meaning and by words")
    search.add_argument("query", metavar="QUERY")
    search.add_argument("-n", type=int, default=10, help="how many results (default 10)")
    search.add_argument("--session", help="only this session")
    recent = command("recent", cmd_recent, "the newest memories first")
    recent.add_argument("--limit", type=int, default=20)
    recent.add_argument("--session", help="only this session")
    recent.add_argument("--agent", help="only this agent")
    recent.add_argument("--before", help="cursor 'TIMESTAMP|KEY' from the previous page")
    demo = command("demo", cmd_demo, "the whole loop on the embedded default", json_flag=False)
    demo.add_argument(
        "--dir", default="outbox-demo", help="folder for the demo (default ./outbox-demo)"
    )
    mcp = command("mcp", cmd_mcp, "serve the memory tools over MCP on stdio", json_flag=False)
    mcp.add_argument("--drain", action="store_true", help="also deliver in the background")
    mcp.add_argument(
        "--store-wait",
        type=float,
        default=0.0,
        help="brain_store waits up to S seconds for a concrete sink id",
    )

    dead = command("dead", cmd_dead, "list, show, retry or discard dead letters")
    dead.add_argument("action", choices=["list", "show", "retry", "discard"])
    dead.add_argument("keys", nargs="*", metavar="KEY")
    dead.add_argument("--all", action="store_true", help="act on every dead letter")
    dead.add_argument("--sink", help="only this sink")
    dead.add_argument("--limit", type=int, default=100, help="how many to list")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return EXIT_INVALID if exc.code not in (0, None) else EXIT_OK
    # A one-shot command speaks through its result and one error line; the long-running ones
    # (run, drain, mcp) also log warnings, since nobody reads their return value.
    quiet = logging.ERROR if args.command not in ("run", "drain", "mcp") else logging.WARNING
    logging.basicConfig(
        level=logging.INFO if args.verbose else quiet,
        format="outbox: %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.handler(args))
    except (ValidationError, ConfigError) as exc:
        return _fail(str(exc), EXIT_INVALID)
    except OutboxError as exc:
        return _fail(str(exc), EXIT_FAILED)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as exc:  # the contract forbids tracebacks on the command line
        # One line: SQLAlchemy's messages go on with the statement and a help link.
        first = str(exc).splitlines()[0] if str(exc) else ""
        return _fail(f"{exc.__class__.__name__}: {first}", EXIT_FAILED)


if __name__ == "__main__":
    raise SystemExit(main())
