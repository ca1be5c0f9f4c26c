"""``outbox add`` on a SQLite store in its steady state, without importing SQLAlchemy.

Opening the outbox checks the schema and the mirror locations and repairs the mirrors, all
through SQLAlchemy, whose import alone takes longer than the command's start budget. A
store in its steady state needs none of that work, and this module shows it cheaply on the
bare driver before writing: the schema is current and the mirrors are where the store
recorded them. The write itself goes through the outbox's own ``Writer``, ``Mirrors`` and
fallback decision, so there is one write path. Afterwards it stands in for the repair that
follows the command's write: when its own records are all the log gained since the repair's
watermark, it moves the watermark; when anything else is owed (a crashed writer's records,
fallback files, delivery outcomes or a forget not yet mirrored, a torn log) it says so and
the caller runs the full repair.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from outbox.core.errors import MirrorBusy
from outbox.core.folders import ensure_private_dir
from outbox.core.receipt import Receipt
from outbox.core.record import Record
from outbox.core.safe_files import check_store
from outbox.core.states import MirrorEvent
from outbox.mirror.mirrors import Mirrors
from outbox.store.revision import SCHEMA_REVISION
from outbox.store.sqlite_writes import connect_writer, sqlite_file
from outbox.write.durable import commit_or_fallback
from outbox.write.fallback import UNAVAILABLE_BARE, FallbackQueue
from outbox.write.writer import Writer

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.store.storage import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DirectWrite:
    """A write done without the full outbox, and whether a repair is still owed."""

    receipt: Receipt
    repair_owed: bool


def add(settings: Settings, record: Record) -> DirectWrite | None:
    """Write ``record`` the way ``Outbox.add`` would; None, having written nothing, when the
    store needs the full open first (no SQLite file yet, another backend or URL form, a
    schema to migrate, mirror places to record or to refuse)."""
    path = sqlite_file(settings.db_url)
    if path is None or not path.is_file():
        return None
    check_store(settings, path)
    try:  # one connection for the checks before and after the write
        checks = _connect(path, settings)
    except sqlite3.Error:  # the full open meets it too, and decides (fallback or error)
        return None
    try:
        return _add_if_ready(checks, path, settings, record)
    finally:
        checks.close()


def _add_if_ready(
    checks: sqlite3.Connection, path: Path, settings: Settings, record: Record
) -> DirectWrite | None:
    """``add`` once the store is open for its checks (on ``checks``)."""
    try:
        ready = _ready(checks, settings)
    except sqlite3.Error:
        return None
    if not ready:
        return None
    with contextlib.suppress(OSError):  # the full open only warns about it as well
        ensure_private_dir(settings.home)
    storage = _StorageOnDemand(settings)
    mirrors = Mirrors.from_settings(cast("Storage", storage), settings)
    writer = Writer(
        cast("Storage", storage),
        mirrors,
        sinks=settings.sinks,
        origin=settings.mirror_id,
        busy_timeout=settings.busy_timeout,
        connect=lambda: _connect(path, settings),
    )
    fallback = FallbackQueue(settings.markdown_dir, settings.sinks)
    try:
        (receipt,), unavailable = commit_or_fallback(
            writer, fallback, [record], expected=UNAVAILABLE_BARE
        )
        owed = False
        if unavailable is None:
            try:  # the exclusive hold waits for the mirror writer: the files are all there
                with mirrors.hold(time.monotonic() + settings.busy_timeout):
                    owed = not _caught_up(checks, settings, mirrors, fallback)
            except (MirrorBusy, sqlite3.Error):  # the mirrors or the database are busy:
                owed = True  # the full repair waits for them; the write stands
    finally:
        writer.close()
        mirrors.close()
        storage.close()
    return DirectWrite(receipt, owed)


def _ready(conn: sqlite3.Connection, settings: Settings) -> bool:
    """The schema is current and this machine's mirror places are recorded as configured
    (anything else is the full open's to migrate, record or refuse)."""
    try:
        (revision,) = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except (sqlite3.OperationalError, TypeError):  # no such table, or no row in it
        return False
    places = conn.execute(
        "SELECT jsonl_path, markdown_dir FROM store_locations WHERE mirror_id = ?",
        (settings.mirror_id,),
    ).fetchone()
    configured = (_absolute(settings.jsonl_path), _absolute(settings.markdown_dir))
    return bool(revision == SCHEMA_REVISION and places == configured)


def _connect(path: Path, settings: Settings) -> sqlite3.Connection:
    return connect_writer(
        path, busy_timeout=settings.busy_timeout, synchronous=settings.synchronous
    )


def _absolute(path: Path) -> str:
    """A place as the store records it (``store/locations.py``)."""
    return str(Path(os.path.abspath(path)))


def _caught_up(
    conn: sqlite3.Connection, settings: Settings, mirrors: Mirrors, fallback: FallbackQueue
) -> bool:
    """Under the mirror lock: whether the repair has nothing to do but move its watermark
    past this command's records, and if so, move it. False: a repair is owed."""
    if fallback.pending_count():
        return False
    mark = conn.execute(
        "SELECT record_seq, jsonl_offset, line_hash FROM mirror_state WHERE mirror_id = ?",
        (settings.mirror_id,),
    ).fetchone()
    if mark is None or not mark[1]:  # never repaired, or reset after a torn tail
        return False
    seq, offset, line_hash = mark
    owed = conn.execute(
        "SELECT 1 FROM deliveries WHERE mirror_pending = 1"
        " UNION ALL SELECT 1 FROM records WHERE redaction_pending > 0 LIMIT 1"
    ).fetchone()
    if owed or not _whole_lines(mirrors) or not mirrors.jsonl.continues_at(offset, line_hash):
        return False
    new = conn.execute(
        'SELECT "key", seq, markdown_name FROM records WHERE origin = ? AND seq > ? ORDER BY seq',
        (settings.mirror_id, seq),
    ).fetchall()
    logged = {
        line.event.get("key")
        for line in mirrors.jsonl.lines(offset)
        if line.event.get("event") == MirrorEvent.ACCEPTED
    }
    if any(key not in logged or not mirrors.path(name).exists() for key, _, name in new):
        return False
    if new:
        _move_watermark(conn, mirrors, settings.mirror_id, (seq, offset), new[-1][1])
    return True


def _whole_lines(mirrors: Mirrors) -> bool:
    """The log ends with a complete line (a torn tail is the repair's to cut)."""
    size = mirrors.jsonl.size()
    if size == 0:
        return False
    with open(mirrors.jsonl.path, "rb") as handle:
        handle.seek(size - 1)
        return handle.read(1) == b"\n"


def _move_watermark(
    conn: sqlite3.Connection, mirrors: Mirrors, mirror_id: str, was: tuple[int, int], seq: int
) -> None:
    """Where the repair would leave it: past the last record, at the end of the log. Only
    from where it was when read; a failure just leaves the next open's repair more to read."""
    size, last_line = mirrors.jsonl.end()
    try:
        conn.execute(
            "UPDATE mirror_state SET record_seq = ?, jsonl_offset = ?, line_hash = ?,"
            " updated_at = ? WHERE mirror_id = ? AND record_seq = ? AND jsonl_offset = ?",
            (seq, size, last_line, time.time(), mirror_id, *was),
        )
    except sqlite3.Error as exc:
        log.warning("mirror watermark not moved (%s); the next open repairs", type(exc).__name__)


class _StorageOnDemand:
    """The SQLAlchemy store, built only if a rare path asks for it (a duplicate's delivered
    ids, a file name taken after the commit, a torn log): the common write never loads it."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._storage: Storage | None = None

    def __getattr__(self, name: str) -> Any:
        if self._storage is None:
            from outbox.store.engine import make_engine
            from outbox.store.storage import Storage

            settings = self._settings
            self._storage = Storage(
                make_engine(settings, writer=True), make_engine(settings, writer=False)
            )
        return getattr(self._storage, name)

    def close(self) -> None:
        if self._storage is not None:
            self._storage.engine.dispose()
            self._storage.reader.dispose()
