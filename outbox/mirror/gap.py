"""Whether the database holds the records its JSONL log names, checked by every open.

A log line is written only after its record commits, and a forgotten record keeps its
tombstone row, so every key the log names is a row of the database the log belongs to. A
database that lacks one was deleted, emptied (a dropped PostgreSQL schema, which the
migration brings back empty) or replaced by an older copy. The first line that names a
record catches the first two, the last one an older copy: two short reads and one indexed
lookup, however long the log. A new store has no log yet and passes.
"""

from __future__ import annotations

import os
import sqlite3
from typing import TYPE_CHECKING

from outbox.core.errors import DatabaseLacksRecords
from outbox.core.safe_files import check_store
from outbox.mirror.jsonl import named_keys
from outbox.store.sqlite_writes import sqlite_file

if TYPE_CHECKING:
    from pathlib import Path

    from outbox.core.config import Settings
    from outbox.store.steady import SteadyCheck
    from outbox.store.storage import Storage


def missing_file(settings: Settings, database: Path | None) -> DatabaseLacksRecords | None:
    """Before anything opens the database: a SQLite file that is gone while the log names
    records (opening it would create an empty one in its place, beside any WAL it left)."""
    if database is None or os.path.lexists(database) or not named_keys(settings.jsonl_path):
        return None
    return DatabaseLacksRecords(
        str(database), str(settings.jsonl_path), older_copy=False, gone=True
    )


def check_held(storage: Storage, settings: Settings, where: str) -> None:
    """Raise DatabaseLacksRecords when the open database (``where``, for people) lacks a
    record the log names; ``--merge`` is named when it holds records of this machine, which
    a plain rebuild refuses."""
    keys = named_keys(settings.jsonl_path)
    if not keys or storage.records.held(keys) == set(keys):
        return
    older_copy = bool(storage.records.records_after(settings.mirror_id, 0, limit=1))
    raise DatabaseLacksRecords(where, str(settings.jsonl_path), older_copy=older_copy)


def bare_file(settings: Settings) -> Path | None:
    """The store's SQLite file when a command may use it on the bare driver (``outbox add``,
    ``search``, ``recent``): a plain ``sqlite:///`` URL whose file exists, checked as the
    owner's; None for anything the full open must handle (another backend or URL form, no
    file yet)."""
    path = sqlite_file(settings.db_url)
    if path is None or not path.is_file():
        return None
    check_store(settings, path)
    return path


def steady(check: SteadyCheck, settings: Settings) -> bool:
    """Whether a bare-driver command may go on: the store is in its steady state (schema
    current, mirror places recorded) and holds the records its log names; a database the
    driver cannot read is not (the full open meets it and decides)."""
    try:
        return check.ready(settings) and check.holds(named_keys(settings.jsonl_path))
    except sqlite3.Error:
        return False
