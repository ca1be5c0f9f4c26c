"""``outbox search``, ``outbox recent``, ``outbox demo`` and ``outbox mcp``: memory-core's
recall and tools on the command line. Results print one memory per table line."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from outbox.faces.cli import numbers
from outbox.faces.cli.common import EXIT_FAILED, EXIT_OK, AddCommand, emit, open_outbox

if TYPE_CHECKING:
    from outbox import RecallHit
    from outbox.memory_core import MemoryService

Row = TypeVar("Row")

# Wide enough for every leg at once: lexical+vector+context+date.
_LEGS = 27


def _clip(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _memory_cell(row: dict[str, Any]) -> str:
    """One result's memory on one table line, alike in ``search`` and ``recent``: a plain
    memory's content, or a turn's prompt and response."""
    text = row.get("content") or f"{row.get('prompt', '')} → {row.get('response', '')}"
    return _clip(text, 80)


def _ask(question: Callable[[MemoryService], dict[str, Any]]) -> dict[str, Any]:
    """One memory-core call on a service of its own, closed however the call ends."""
    from outbox.memory_core import MemoryService

    service = MemoryService(open_outbox())
    try:
        return question(service)
    finally:
        service.close()


def _table(rows: Sequence[Row], header: str, line: Callable[[Row], str], empty: str) -> list[str]:
    """``header`` and one line per row, each ending with its memory; ``empty`` alone when
    there are no rows."""
    if not rows:
        return [empty]
    return [f"{header} memory", *(line(row) for row in rows)]


def _search_line(hit: RecallHit) -> str:
    """Which legs found a hit, how relevant it reads, its bm25 and vector distance, and
    the memory."""
    from outbox.memory_core import record_view

    legs = "+".join(hit.legs)
    bm25 = "-" if hit.bm25 is None else f"{hit.bm25:.2f}"
    distance = "-" if hit.distance is None else f"{hit.distance:.3f}"
    found = f"{legs:<{_LEGS}} {hit.relevance:>9.2f} {bm25:>7} {distance:>8}"
    return f"{found}  {hit.timestamp:<27} {_memory_cell(record_view(hit.content, hit.metadata))}"


def cmd_search(args: argparse.Namespace) -> int:
    """``Outbox.recall`` as a table of typed hits; ``--json`` prints memory-core's answer.

    A store in its steady state is searched without the full outbox (SQLAlchemy), through
    the same recall (``recall/direct.py``). Otherwise the full open runs, without mirror
    repair (a read changes no hit; the next write or dispatcher does it), as ``show`` does;
    waiting fallback files are still imported, so a memory the database could not take at
    first is found by its words as before."""
    from outbox.core.config import load_settings
    from outbox.memory_core import recall_view
    from outbox.recall.direct import recall

    options: dict[str, Any] = {
        "limit": args.n,
        "session_id": args.session,
        "agent": args.agent,
        "tags": args.tag,
        "min_importance": args.min_importance,
        "since": args.since,
        "until": args.until,
        "min_relevance": args.min_relevance,
    }
    settings = load_settings()
    answer = recall(settings, args.query, **options) if settings.home.is_dir() else None
    if answer is None:
        with open_outbox(repair=False) as ob:
            if ob.unavailable is None:
                ob.import_fallback()
            answer = ob.recall(args.query, **options)
    lines = _table(
        answer.hits,
        f"{'legs':<{_LEGS}} {'relevance':>9} {'bm25':>7} {'distance':>8}  {'timestamp':<27}",
        _search_line,
        f"no memories match (relevance below {answer.min_relevance:.2f} left out)",
    )
    if answer.degraded:
        lines.append(f"note: {answer.degraded}; showing memories found by their words only")
    emit(args, recall_view(answer), "\n".join(lines))
    return EXIT_OK


def cmd_recent(args: argparse.Namespace) -> int:
    """memory-core's ``query_recent_turns`` as a table; a steady SQLite store is read
    without the full outbox, as ``search`` reads it (``recall/direct.py``)."""
    from outbox.core.config import load_settings
    from outbox.memory_core import parse_cursor, recent_limit, recent_view
    from outbox.recall.direct import recent

    settings = load_settings()
    limit = recent_limit(args.limit)
    rows = (
        recent(
            settings,
            limit=limit,
            session_id=args.session,
            agent=args.agent,
            before=parse_cursor(args.before),
        )
        if settings.home.is_dir()
        else None
    )
    if rows is not None:
        answer = recent_view(rows, limit)
    else:
        answer = _ask(
            lambda service: service.query_recent_turns(
                session_id=args.session, agent=args.agent, limit=args.limit, before=args.before
            )
        )
    lines = _table(
        answer["turns"],
        f"{'timestamp':<27} {'session':<12}",
        lambda row: (
            f"{row['timestamp']:<27} {str(row['sessionId'] or '-')[:12]:<12} {_memory_cell(row)}"
        ),
        "no memories yet",
    )
    if answer["turns"] and answer["nextCursor"]:
        cursor = answer["nextCursor"]
        lines.append(f"more: --before '{cursor['timestamp']}|{cursor['id']}'")
    emit(args, answer, "\n".join(lines))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from outbox.faces.demo import run

    ok = run(Path(args.dir))
    print("demo complete" if ok else "demo finished with a surprise: see the lines above")
    return EXIT_OK if ok else EXIT_FAILED


def cmd_mcp(args: argparse.Namespace) -> int:
    from outbox.faces.mcp_server import serve

    serve(drain=args.drain, store_wait=args.store_wait)
    return EXIT_OK


def register(command: AddCommand) -> None:
    search = command("search", cmd_search, "recall by meaning and by words")
    search.add_argument("query", metavar="QUERY")
    search.add_argument(
        "-n", type=numbers.results, default=10, help="how many results, 1..100 (default 10)"
    )
    search.add_argument("--session", help="only this session")
    search.add_argument("--agent", help="only this agent's memories")
    search.add_argument(
        "--tag", action="append", help="only memories with this tag (repeat: all of them)"
    )
    search.add_argument(
        "--min-importance", type=numbers.importance, help="only importance N (1..10) or more"
    )
    search.add_argument("--since", help="only memories at or after this ISO 8601 time")
    search.add_argument("--until", help="only memories before this ISO 8601 time")
    search.add_argument(
        "--min-relevance",
        type=numbers.fraction,
        help="leave out hits less relevant than this, 0..1 (default: the library's)",
    )
    recent = command("recent", cmd_recent, "the newest memories first")
    recent.add_argument(
        "--limit", type=numbers.results, default=20, help="how many, 1..100 (default 20)"
    )
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
        type=numbers.seconds,
        default=0.0,
        help="brain_store waits up to S seconds (0 or more) for a concrete sink id",
    )
