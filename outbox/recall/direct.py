"""``outbox search`` on a SQLite store in its steady state, without importing SQLAlchemy.

Importing the database toolkit and opening the full outbox takes most of a search's time
from a shell (docs/benchmarks.md, "Start of the command line"), and a read needs neither: on
a store whose schema is current, whose mirrors are where it recorded them, whose log names
no record it lacks and with no fallback file waiting to be imported, the full open would
change nothing the search reads. Then the search reads through SQLite's bare recall reads
(``store/sqlite_recall.py``, the same code the full outbox runs on SQLite) and the same
``Recaller``; anything else is the full open's to handle, as ``outbox add`` does
(``write/direct.py``).
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Any

from outbox.core.safe_files import check_store
from outbox.mirror.jsonl import named_keys
from outbox.recall.service import Recaller
from outbox.store.sqlite_recall import SqliteRecallReads
from outbox.store.sqlite_writes import connect_reader, sqlite_file
from outbox.store.steady import SteadyCheck
from outbox.write.fallback import FallbackQueue

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.recall.service import RecallAnswer


def recall(settings: Settings, query: str, **options: Any) -> RecallAnswer | None:
    """``Outbox.recall(query, **options)`` on the bare driver; None, having read nothing,
    when the store needs the full open first (no SQLite file, another backend or URL form,
    a schema to migrate, mirror places to record, a gap in the database, fallback files to
    import, or a database the driver cannot open or read)."""
    path = sqlite_file(settings.db_url)
    if path is None or not path.is_file():
        return None
    check_store(settings, path)
    if FallbackQueue(settings.markdown_dir, settings.sinks).pending_count():
        return None
    try:
        conn = connect_reader(
            path, busy_timeout=settings.busy_timeout, synchronous=settings.synchronous
        )
    except sqlite3.Error:
        return None
    try:
        steady = SteadyCheck(conn)
        try:
            ready = steady.ready(settings) and steady.holds(named_keys(settings.jsonl_path))
        except sqlite3.Error:
            return None
        if not ready:
            return None
        recaller = Recaller(SqliteRecallReads(conn), settings)
        try:
            return recaller.recall(query, **options)
        except sqlite3.Error:  # nothing was written: the full open meets it and says what
            return None
        finally:
            recaller.close()
    finally:
        conn.close()
