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
from typing import TYPE_CHECKING

from outbox.core.errors import DatabaseLacksRecords
from outbox.mirror.jsonl import named_keys

if TYPE_CHECKING:
    from pathlib import Path

    from outbox.core.config import Settings
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
