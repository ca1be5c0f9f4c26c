"""Chroma's own leftover copies of deleted documents, removed from a stopped store's files.

A Chroma delete removes the document from the collection, but ``chroma.sqlite3`` keeps it
elsewhere (measured with chromadb 1.5.9, docs/operations.md "Forget"):

* its write-ahead log, the ``embeddings_queue`` table, holds each upsert's document and
  metadata. Chroma's own purge (``automatically_purge``, and ``chroma vacuum``) drops only the
  rows the persisted vector index already covers, and that index is written every
  ``sync_threshold`` (1,000) writes, so a recent document stays there. The vector of such a
  row is still needed to rebuild the index after a crash; its text is not;
* the collection's schema (``collections.schema_str``) names every metadata key ever written,
  ``tag:<name>`` keys included, and Chroma never removes one;
* the full-text index's old segments and the file's free pages hold bytes of deleted rows.

So, with Chroma stopped (the caller holds the store's owner lock), this switches Chroma's own
log purge on if it was off (what ``chroma vacuum`` does), blanks the text of log rows whose
document the collection no longer holds, drops schema keys no document uses (Chroma treats a
missing key exactly as its defaults, and adds it again when a document uses it), merges the
full-text index, then runs SQLite's ``VACUUM`` (``chroma vacuum``'s last step), which rewrites
the file without its free pages. ``chroma vacuum`` itself is not run: it loads every vector
index first (7.7 s of its own at 10,000 documents) and its log purge finds nothing left.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DATABASE = "chroma.sqlite3"


@dataclass(frozen=True)
class ChromaPurge:
    """What one purge removed, for the log line and the benchmark."""

    log_rows: int
    schema_keys: int
    seconds: float


def purge_store(folder: Path) -> ChromaPurge:
    """Remove deleted documents' text from the stopped Chroma store in ``folder``."""
    started = time.monotonic()
    database = Path(folder) / DATABASE
    if not database.exists():
        return ChromaPurge(0, 0, 0.0)
    connection = sqlite3.connect(database, isolation_level=None, timeout=30.0)
    try:
        connection.execute("PRAGMA secure_delete = ON")  # freed cells are zeroed, not kept
        connection.execute("BEGIN IMMEDIATE")
        try:
            _purge_log_automatically(connection)
            rows, keys = 0, 0
            for collection, segment in _metadata_segments(connection):
                rows += _blank_log(connection, collection, segment)
                keys += _prune_schema(connection, collection, segment)
            _merge_fulltext(connection)
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("VACUUM")
    finally:
        connection.close()
    return ChromaPurge(rows, keys, time.monotonic() - started)


def _purge_log_automatically(connection: sqlite3.Connection) -> None:
    """Chroma's own setting that drops the log rows its persisted index covers, on."""
    with contextlib.suppress(sqlite3.OperationalError):  # an older store without the table
        for row_id, text in connection.execute(
            "SELECT id, config_json_str FROM embeddings_queue_config"
        ).fetchall():
            try:
                config = json.loads(text)
            except (TypeError, ValueError):
                continue
            if isinstance(config, dict) and config.get("automatically_purge") is False:
                config["automatically_purge"] = True
                connection.execute(
                    "UPDATE embeddings_queue_config SET config_json_str = ? WHERE id = ?",
                    (json.dumps(config, separators=(",", ":")), row_id),
                )


def _metadata_segments(connection: sqlite3.Connection) -> list[tuple[str, str]]:
    """(collection id, its metadata segment id) for every collection."""
    return [
        (str(collection), str(segment))
        for collection, segment in connection.execute(
            "SELECT collection, id FROM segments WHERE scope = 'METADATA'"
        )
    ]


def _blank_log(connection: sqlite3.Connection, collection: str, segment: str) -> int:
    """Blank the text of log rows whose document the collection no longer holds.

    Only rows the metadata segment has applied (its ``max_seq_id``): a later row may be a
    write not yet applied, whose text is still needed. The vector stays for the index.
    """
    applied = connection.execute(
        "SELECT seq_id FROM max_seq_id WHERE segment_id = ?", (segment,)
    ).fetchone()
    if applied is None:
        return 0
    cursor = connection.execute(
        "UPDATE embeddings_queue SET metadata = NULL"
        " WHERE topic LIKE '%/' || ? AND seq_id <= ? AND metadata IS NOT NULL"
        " AND id NOT IN (SELECT embedding_id FROM embeddings WHERE segment_id = ?)",
        (collection, int(applied[0]), segment),
    )
    return int(cursor.rowcount)


def _prune_schema(connection: sqlite3.Connection, collection: str, segment: str) -> int:
    """Drop the schema's metadata keys that no document of the collection has any more."""
    found = connection.execute(
        "SELECT schema_str FROM collections WHERE id = ?", (collection,)
    ).fetchone()
    if found is None or not found[0]:
        return 0
    try:
        schema = json.loads(found[0])
        keys = schema["keys"]
    except (ValueError, KeyError, TypeError):
        log.warning("Chroma collection %s has a schema of unknown shape; left as it is", collection)
        return 0
    if not isinstance(keys, dict):
        return 0
    used = {
        str(key)
        for (key,) in connection.execute(
            "SELECT key FROM embedding_metadata WHERE id IN"
            " (SELECT id FROM embeddings WHERE segment_id = ?)"
            " UNION SELECT key FROM embedding_metadata_array WHERE id IN"
            " (SELECT id FROM embeddings WHERE segment_id = ?)",
            (segment, segment),
        )
    }
    unused = [key for key in keys if not key.startswith("#") and key not in used]
    if not unused:
        return 0
    for key in unused:
        del keys[key]
    connection.execute(
        "UPDATE collections SET schema_str = ? WHERE id = ?",
        (json.dumps(schema, separators=(",", ":")), collection),
    )
    return len(unused)


def _merge_fulltext(connection: sqlite3.Connection) -> None:
    """Merge the full-text index into one segment, leaving out deleted documents' terms."""
    with contextlib.suppress(sqlite3.OperationalError):  # no such table: an empty store
        connection.execute(
            "INSERT INTO embedding_fulltext_search(embedding_fulltext_search) VALUES('optimize')"
        )
