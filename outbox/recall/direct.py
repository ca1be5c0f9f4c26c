"""``outbox search`` and ``outbox recent`` on a SQLite store in its steady state, without
importing SQLAlchemy.

Importing the database toolkit and opening the full outbox took most of a read's time from
a shell (docs/benchmarks.md, "Start of the command line"), and a read needs neither: on a
store whose schema is current, whose mirrors are where it recorded them, whose log names no
record it lacks and with no fallback file waiting to be imported, the full open would change
nothing a read sees. Then the read goes through SQLite's bare recall reads
(``store/sqlite_recall.py``, the same code the full outbox runs on SQLite) and, for a
search, the same ``Recaller``; anything else is the full open's to handle, as ``outbox add``
does (``write/direct.py``).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from outbox.mirror.gap import bare_file, steady
from outbox.recall.service import Recaller
from outbox.store.sqlite_recall import SqliteRecallReads
from outbox.store.sqlite_writes import connect_reader
from outbox.store.steady import SteadyCheck
from outbox.write.fallback import FallbackQueue

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.recall.service import RecallAnswer
    from outbox.store.rows import RecentRow


class NeedsFullOpen(Exception):
    """The store is not one a bare read may serve; nothing was read or written."""


def recall(settings: Settings, query: str, **options: Any) -> RecallAnswer | None:
    """``Outbox.recall(query, **options)`` on the bare driver; None, having read nothing,
    when the store needs the full open first."""
    try:
        with _steady_reads(settings) as reads:
            recaller = Recaller(reads, settings)
            try:
                return recaller.recall(query, **options)
            finally:
                recaller.close()
    except NeedsFullOpen:
        return None


def recent(
    settings: Settings,
    *,
    limit: int,
    session_id: str | None = None,
    agent: str | None = None,
    before: tuple[str, str] | None = None,
) -> list[RecentRow] | None:
    """``Outbox.recent_memories`` on the bare driver; None when the store needs the full
    open first."""
    try:
        with _steady_reads(settings) as reads:
            return reads.recent(limit=limit, session_id=session_id, agent=agent, before=before)
    except NeedsFullOpen:
        return None


@contextlib.contextmanager
def _steady_reads(settings: Settings) -> Iterator[SqliteRecallReads]:
    """Recall's reads on a read-only connection to a steady store. Raises NeedsFullOpen
    for anything else: no SQLite file, another backend or URL form, a schema to migrate,
    mirror places to record, a gap in the database, fallback files to import, or a database
    the driver cannot open or read (the full open meets it and says what)."""
    path = bare_file(settings)
    if path is None:
        raise NeedsFullOpen
    if FallbackQueue(settings.markdown_dir, settings.sinks).pending_count():
        raise NeedsFullOpen
    try:
        conn = connect_reader(
            path, busy_timeout=settings.busy_timeout, synchronous=settings.synchronous
        )
    except sqlite3.Error:
        raise NeedsFullOpen from None
    try:
        if not steady(SteadyCheck(conn), settings):
            raise NeedsFullOpen
        yield SqliteRecallReads(conn)
    except sqlite3.Error:
        raise NeedsFullOpen from None
    finally:
        conn.close()
