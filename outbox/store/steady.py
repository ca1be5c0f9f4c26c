"""Whether a store is in its steady state: nothing for the open to do, nothing a repair owes.

One definition serves both sides. The full outbox's repair reads its work through the
conditions written here (``mirror_state.py``, ``forgetting.py`` take them as SQL text) and
decides to reread the log with ``log_owed``; ``outbox add``'s direct write asks
``SteadyCheck`` the same questions on the bare ``sqlite3`` driver before and after its write.
Free of SQLAlchemy on purpose: importing it alone takes longer than that command's budget.

What is owed is what the open's repair (``Outbox.sync_mirrors``) would do beyond moving its
watermark, each kind in ``Owed``. Outcomes and forgets count only for this machine's records
(``mirror_id``): its repair mirrors no other machine's, so another machine's would be owed
for ever. A purge counts for every record, as the open's purge takes them all.
"""

from __future__ import annotations

import enum
import logging
import os
import sqlite3
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from outbox.store.revision import SCHEMA_REVISION

log = logging.getLogger(__name__)

# records.redaction_pending: what a forget still owes.
MIRRORS_DUE = 1  # the log line is not redacted yet, or the markdown file not deleted
PURGE_DUE = 2  # the database may still hold old copies (search index segments, WAL frames)

# Each condition repeats its partial index's own term as written (a literal, not a bound
# parameter): SQLite uses a partial index only for a query that does. The origin of a forget
# is tested by the reader, not in SQL, where SQLite would pick the origin index instead,
# which holds every record of this machine.
OUTCOMES_OWED = (
    "deliveries.mirror_pending = 1 AND EXISTS (SELECT 1 FROM records"
    ' WHERE records."key" = deliveries.record_key AND records.origin = :origin)'
)
FORGETS_OWED = f"records.redaction_pending > 0 AND records.redaction_pending = {MIRRORS_DUE}"
PURGE_OWED = f"records.redaction_pending > 0 AND records.redaction_pending = {PURGE_DUE}"


class Owed(enum.Enum):
    """Each kind of work a repair may owe, as the check names it."""

    FALLBACK = "fallback files wait for their import"
    NEVER_REPAIRED = "no repair has run (or the log's tail was cut since)"
    TORN_LOG = "the log ends in a torn line"
    LOG_REPLACED = "the log does not continue where the last repair left it"
    OUTCOMES = "delivery outcomes are not mirrored yet"
    FORGETS = "a forget's log line or file is not dealt with yet"
    PURGE = "a forget's purge of the database's own copies is due"
    UNMIRRORED = "a record past the watermark lacks its line or its file"


class Watermark(NamedTuple):
    """How far the mirror repair got: the last record seq, the JSONL offset, and the hash of
    the line that ends at that offset (None before migration 0004 or for an empty log)."""

    record_seq: int
    offset: int
    line_hash: str | None


def log_owed(mark: Watermark, *, torn: bool, continues: bool) -> Owed | None:
    """Why the repair must reread the whole log (None: from the watermark on will do): a
    torn tail, a watermark never set or reset, or a log that lost its tail and was written
    to again since (``continues``: the chain runs through the watermark's offset)."""
    if torn:
        return Owed.TORN_LOG
    if mark.offset == 0:
        return Owed.NEVER_REPAIRED
    if not continues:
        return Owed.LOG_REPLACED
    return None


class Placed(Protocol):
    """What the place checks read from the settings (``outbox.core.config.Settings`` has it)."""

    @property
    def mirror_id(self) -> str: ...
    @property
    def jsonl_path(self) -> Path: ...
    @property
    def markdown_dir(self) -> Path: ...


@dataclass(frozen=True)
class MirrorPlaces:
    """One machine's JSONL log and markdown folder, as absolute paths (as the store keeps them)."""

    jsonl_path: Path
    markdown_dir: Path

    @classmethod
    def of(cls, settings: Placed) -> MirrorPlaces:
        return cls(
            Path(os.path.abspath(settings.jsonl_path)), Path(os.path.abspath(settings.markdown_dir))
        )


class MirrorView(Protocol):
    """What the check reads of one machine's mirrors (the caller holds the mirror lock)."""

    def torn(self) -> bool:
        """The log ends in an incomplete line."""

    def continues_at(self, offset: int, line_hash: str | None) -> bool:
        """The chain runs unbroken through ``offset`` (see ``JsonlLog.continues_at``)."""

    def accepted_since(self, offset: int) -> Collection[str]:
        """The keys of the ``accepted`` lines from ``offset`` on."""

    def has_file(self, name: str) -> bool:
        """A record's markdown file of that name exists."""

    def end(self) -> tuple[int, str | None]:
        """(size, hash of the last line): where a repair leaves its watermark."""


class SteadyCheck:
    """The steady-state questions, on one bare ``sqlite3`` connection to the store."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def ready(self, settings: Placed) -> bool:
        """The schema is current and this machine's mirror places are recorded as configured
        (anything else is the full open's to migrate, record or refuse)."""
        try:
            (revision,) = self.conn.execute("SELECT version_num FROM alembic_version").fetchone()
        except (sqlite3.OperationalError, TypeError):  # no such table, or no row in it
            return False
        places = self.conn.execute(
            "SELECT jsonl_path, markdown_dir FROM store_locations WHERE mirror_id = ?",
            (settings.mirror_id,),
        ).fetchone()
        configured = MirrorPlaces.of(settings)
        recorded = None if places is None else MirrorPlaces(Path(places[0]), Path(places[1]))
        return bool(revision == SCHEMA_REVISION and recorded == configured)

    def holds(self, keys: Collection[str]) -> bool:
        """Every key the log names (``jsonl.named_keys``) is a record here, live or a
        tombstone; anything else is the full open's to refuse (``mirror/gap.py``)."""
        wanted = set(keys)
        if not wanted:
            return True
        marks = ", ".join("?" * len(wanted))
        (found,) = self.conn.execute(
            f'SELECT COUNT(*) FROM records WHERE "key" IN ({marks})', tuple(wanted)
        ).fetchone()
        return bool(found == len(wanted))

    def catch_up(self, mirror_id: str, mirror: MirrorView, *, fallback_waits: bool) -> Owed | None:
        """Under the mirror lock: the first kind of work the repair of ``mirror_id``'s mirrors
        (with the open's fallback import and purge) would have. None when it would only have
        moved its watermark past this machine's new records, which this then does, as the
        repair would (a failure to move it only leaves the next repair more to read)."""
        if fallback_waits:
            return Owed.FALLBACK
        mark = self._watermark(mirror_id)
        owed = log_owed(mark, torn=mirror.torn(), continues=mirror.continues_at(*mark[1:]))
        if owed is not None:
            return owed
        owed = self._owed_rows(mirror_id)
        if owed is not None:
            return owed
        new = self.conn.execute(
            'SELECT "key", seq, markdown_name FROM records WHERE origin = ? AND seq > ?'
            " ORDER BY seq",
            (mirror_id, mark.record_seq),
        ).fetchall()
        if not new:
            return None
        logged = mirror.accepted_since(mark.offset)
        if any(key not in logged or not mirror.has_file(name) for key, _, name in new):
            return Owed.UNMIRRORED
        self._move(mirror_id, mark, int(new[-1][1]), mirror)
        return None

    def _move(self, mirror_id: str, mark: Watermark, seq: int, mirror: MirrorView) -> None:
        """Where the repair would leave the watermark: past ``seq``, at the end of the log;
        only from where it was when read."""
        size, line_hash = mirror.end()
        try:
            self.conn.execute(
                "UPDATE mirror_state SET record_seq = ?, jsonl_offset = ?, line_hash = ?,"
                " updated_at = ? WHERE mirror_id = ? AND record_seq = ? AND jsonl_offset = ?",
                (seq, size, line_hash, time.time(), mirror_id, mark.record_seq, mark.offset),
            )
        except sqlite3.Error as exc:
            log.warning(
                "mirror watermark not moved (%s); the next open repairs", type(exc).__name__
            )

    def _watermark(self, mirror_id: str) -> Watermark:
        row = self.conn.execute(
            "SELECT record_seq, jsonl_offset, line_hash FROM mirror_state WHERE mirror_id = ?",
            (mirror_id,),
        ).fetchone()
        return Watermark(0, 0, None) if row is None else Watermark(int(row[0]), int(row[1]), row[2])

    def _owed_rows(self, mirror_id: str) -> Owed | None:
        """Outcomes, forgets and purges the database holds for the repair and the open."""
        if self.conn.execute(
            f"SELECT 1 FROM deliveries WHERE {OUTCOMES_OWED} LIMIT 1", {"origin": mirror_id}
        ).fetchone():
            return Owed.OUTCOMES
        origins = self.conn.execute(f"SELECT origin FROM records WHERE {FORGETS_OWED}")
        if any(origin == mirror_id for (origin,) in origins):
            return Owed.FORGETS
        if self.conn.execute(f"SELECT 1 FROM records WHERE {PURGE_OWED} LIMIT 1").fetchone():
            return Owed.PURGE
        return None
