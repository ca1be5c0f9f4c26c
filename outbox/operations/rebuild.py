"""``outbox rebuild``: recreate a lost or corrupt database from the store's audit copies.

What comes back is what ``rebuild_evidence`` finds in the JSONL log, the markdown files and
the fallback queue. Records go in through the write path's own insert, with the outcomes the
log recorded (the rest pending: sinks are idempotent by key); then the mirrors get what they
lack (a line for a record only a file held, a file that is missing, cut short or edited), so
``outbox verify`` passes.

Nothing is destroyed: a corrupt SQLite file moves aside, with its ``-wal``/``-shm``/``-journal``,
under a name that says so. A readable database that already holds this machine's records is
refused unless asked to ``merge``. A marker file lets a killed run's re-run go on where it
stopped (each batch commits whole; an insert skips a key already there). The run holds the
mirror lock throughout: writes meanwhile go to the fallback queue, imported afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import make_url

from outbox.core.errors import OutboxError
from outbox.core.file_lock import exclusive
from outbox.core.folders import ensure_private_dir
from outbox.core.keys import canonical_timestamp
from outbox.core.safe_files import check_store, open_file
from outbox.core.states import DeliveryState, FallbackReason
from outbox.mirror import markdown
from outbox.operations.rebuild_evidence import Evidence, Found, Progress, gather, quiet
from outbox.store.restore import KnownOutcome

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.mirror.mirrors import Mirrors
    from outbox.store.forgetting import Tombstone
    from outbox.store.storage import Storage

MARKER_NAME = "rebuild-in-progress.json"
LOCK_NAME = "rebuild.lock"
BATCH = 2000  # records per transaction: a killed run loses at most one batch's work
SIDECARS = ("-wal", "-shm", "-journal")  # moved before the file they belong to


class RebuildRefused(OutboxError):
    """The rebuild would not be safe, or there is nothing to rebuild; nothing was changed."""


@dataclass
class RebuildReport:
    """What a run did, for the command's output."""

    database: str
    resumed: bool = False
    merged: bool = False
    moved_aside: list[str] = field(default_factory=list)
    from_log: int = 0
    from_markdown: int = 0
    already_there: int = 0
    forgotten_left_out: int = 0
    tombstones: int = 0  # forgotten records put back without their content
    forgets_applied: int = 0  # live records of the database made tombstones (--merge)
    forgets_finished: int = 0  # cut-off forgets whose log line and files were finished
    delivered: int = 0
    dead: int = 0
    discarded: int = 0
    pending: int = 0
    unkeyed_files: int = 0
    log_lines: int = 0
    files_read: int = 0
    lines_appended: int = 0
    files_written: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def restored(self) -> int:
        return self.from_log + self.from_markdown

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "restored": self.restored}


def _where(settings: Settings, database: Path | None) -> str:
    """The database for people: its file, or its URL without the password."""
    if database is not None:
        return str(database)
    return make_url(settings.db_url).render_as_string(hide_password=True)


def _only_rebuild(home: Path) -> contextlib.AbstractContextManager[None]:
    """One rebuild of a store at a time (a lock file in its home); a second one is refused
    at once rather than queued behind a run that may take minutes."""
    return exclusive(
        home / LOCK_NAME,
        "rebuild lock",
        lambda: RebuildRefused("another outbox rebuild of this store is running"),
    )


class _Marker:
    """The file that says a rebuild started and has not finished, and where it moved a
    corrupt database: a re-run goes on instead of refusing the records already back."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> dict[str, Any] | None:
        try:
            fd = open_file(self.path, os.O_RDONLY, what="rebuild marker")
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as handle:
            try:
                loaded = json.loads(handle.read())
            except ValueError:
                return {}
        return loaded if isinstance(loaded, dict) else {}

    def write(self, aside: str | None, history_end: int | None = None) -> None:
        state = {"started": canonical_timestamp(), "aside": aside, "history_end": history_end}
        markdown.write_atomic(self.path, json.dumps(state).encode("utf-8"))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _move_aside(database: Path, aside: Path) -> list[str]:
    """Rename the database and its sidecars to ``aside`` (sidecars first: a WAL must never
    be left beside a new file of the old name, which SQLite would replay into it)."""
    moved = []
    for suffix in (*SIDECARS, ""):
        source = database.with_name(database.name + suffix)
        if os.path.lexists(source):
            target = aside.with_name(aside.name + suffix)
            os.rename(source, target)
            moved.append(str(target))
    return moved


def _aside_name(database: Path, why: str) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return database.with_name(f"{database.name}.{why}-{stamp}")


class Rebuilder:
    """One ``outbox rebuild`` run over a store's settings."""

    def __init__(self, settings: Settings, *, merge: bool = False, progress: Progress = quiet):
        self.settings = settings
        self.merge = merge
        self.progress = progress
        self.aside: str | None = None  # where a corrupt database went, kept in the marker
        # A merge's judgement of the log against the database as it was before the merge
        # (its newest seq), kept in the marker so a re-run judges by the same history.
        self.history_end: int | None = None

    def run(self) -> RebuildReport:
        started = time.monotonic()
        settings = self.settings
        database = _sqlite_file(settings)
        check_store(settings, database)
        if not (settings.jsonl_path.exists() or _holds_markdown(settings.markdown_dir)):
            raise RebuildRefused(
                f"nothing to rebuild from: no JSONL log at {settings.jsonl_path} and no "
                f"markdown files in {settings.markdown_dir} (check OUTBOX_HOME, "
                "OUTBOX_JSONL_PATH and OUTBOX_MARKDOWN_DIR)"
            )
        ensure_private_dir(settings.home)
        with _only_rebuild(settings.home):
            marker = _Marker(settings.home / MARKER_NAME)
            state = marker.read()
            report = RebuildReport(_where(settings, database), resumed=state is not None)
            report.merged = self.merge
            ended = (state or {}).get("history_end")
            self.history_end = ended if type(ended) is int else None
            if database is not None:
                report.moved_aside = self._clear_file(database, marker, state)
            storage = _open_storage(settings)
            try:
                self._check_and_fill(storage, marker, report, resuming=state is not None)
            finally:
                storage.close()
            marker.remove()
        report.seconds = round(time.monotonic() - started, 2)
        return report

    def _clear_file(
        self, database: Path, marker: _Marker, state: dict[str, Any] | None
    ) -> list[str]:
        """Move a corrupt database aside, or the leftovers of a deleted one; a readable
        one stays where it is."""
        if not os.path.lexists(database):
            leftovers = [s for s in SIDECARS if os.path.lexists(f"{database}{s}")]
            return _move_aside(database, _aside_name(database, "orphan")) if leftovers else []
        if not _is_corrupt(self.settings, database):
            return []
        pending = (state or {}).get("aside")
        aside = (
            Path(pending)
            if isinstance(pending, str) and not os.path.lexists(pending)
            else _aside_name(database, "corrupt")
        )
        self.aside = str(aside)
        marker.write(self.aside, self.history_end)  # first: a re-run goes on with that name
        return _move_aside(database, aside)

    def _check_and_fill(
        self, storage: Storage, marker: _Marker, report: RebuildReport, *, resuming: bool
    ) -> None:
        from outbox.mirror.mirrors import Mirrors
        from outbox.store import migrate

        settings = self.settings
        migrate.upgrade(storage.engine, storage.reader)
        if not (resuming or self.merge) and storage.records.records_after(
            settings.mirror_id, 0, limit=1
        ):
            raise RebuildRefused(
                f"the database {report.database} is readable and already holds records of "
                f"this machine (OUTBOX_MIRROR_ID={settings.mirror_id}); nothing was changed. "
                "`outbox rebuild --merge` adds what the log and files hold and it lacks"
            )
        storage.locations.check(settings)
        mirrors = Mirrors.from_settings(lambda: storage, settings)
        try:
            # Held throughout: a repair elsewhere reading the log while records go in would
            # take them for records whose lines are missing, and append those lines twice.
            with mirrors.hold():
                evidence = gather(settings, self.progress)
                if self.merge:
                    self._judge(storage, mirrors, evidence)
                marker.write(self.aside, self.history_end)  # before the first record goes in
                storage.mirror_state.set_mirror_watermark(settings.mirror_id, 0, 0, None)
                seqs = self._restore(storage, evidence, report)
                self.progress("writing what the mirrors lack", 0, None)
                self._mend_mirrors(storage, mirrors, evidence, seqs, report)
            if storage.forgetting.purge_due():  # a restored copy's pages held the words
                storage.forgetting.purge()
        finally:
            mirrors.close()

    def _judge(self, storage: Storage, mirrors: Mirrors, evidence: Evidence) -> None:
        """A merge adopts only what ``outbox verify`` accepts of the log, judged against the
        database as it was before the merge: a line verify refuses (a forged or edited
        line, one the database's history does not explain) is left out and listed."""
        from outbox.mirror.verify import verify

        settings = self.settings
        judged = verify(
            storage, mirrors.jsonl, settings.markdown_dir, settings.mirror_id, self.history_end
        )
        self.history_end = judged.history_end
        evidence.refuse(judged.refused)

    def _restore(
        self, storage: Storage, evidence: Evidence, report: RebuildReport
    ) -> dict[str, int]:
        """Insert the records through the write path's group insert, a batch per transaction,
        each with the outcomes the log has; returns every record's ``seq``."""
        found = evidence.records()
        report.forgotten_left_out = len(evidence.forgotten)
        report.unkeyed_files = evidence.unkeyed_files
        report.log_lines, report.files_read = evidence.lines, evidence.files_read
        report.problems = list(evidence.problems)
        seqs: dict[str, int] = {}
        now = time.time()
        for start in range(0, len(found), BATCH):
            batch = found[start : start + BATCH]
            with storage.engine.begin() as conn:
                for sinks, group in _by_sinks(batch).items():
                    inserted = storage.records.insert_records(
                        conn,
                        [(item.record, item.markdown_name) for item in group],
                        sinks=sinks,
                        origin=self.settings.mirror_id,
                        now=now,
                    )
                    for item, seq in zip(group, inserted, strict=True):
                        if seq is not None:
                            seqs[item.record.key] = seq
                fresh = [item for item in batch if item.record.key in seqs]
                outcomes = [outcome for item in fresh for outcome in evidence.outcomes_for(item)]
                storage.restore.restore(conn, outcomes, now)
            _count(report, batch, fresh, outcomes)
            self.progress("restoring records", start + len(batch), len(found))
        tombstones = evidence.tombstones()
        with storage.engine.begin() as conn:  # forgotten records stay forgotten
            report.tombstones = storage.forgetting.restore(
                conn, tombstones, self.settings.sinks, self.settings.mirror_id, now
            )
        report.forgets_applied = self._apply_forgets(storage, tombstones)
        there = [item.record.key for item in found if item.record.key not in seqs]
        seqs.update({key: item.seq for key, item in storage.records.get_records(there).items()})
        return seqs

    def _apply_forgets(self, storage: Storage, tombstones: list[Tombstone]) -> int:
        """A ``forgotten`` line wins over a live record of the database (one restored from a
        backup taken before the forget): it becomes a tombstone as a forget makes one, and
        every sink the log does not say deleted it gets its delete again."""
        held = storage.records.get_records(item.key for item in tombstones)
        applied = 0
        for item in tombstones:
            stored = held.get(item.key)
            if stored is None or stored.forgotten:
                continue
            storage.forgetting.forget(item.key, self.settings.sinks, deleted=item.deleted)
            applied += 1
        return applied

    def _mend_mirrors(
        self,
        storage: Storage,
        mirrors: Mirrors,
        evidence: Evidence,
        seqs: dict[str, int],
        report: RebuildReport,
    ) -> None:
        """What the mirrors lack for the records put back (caller holds the mirror lock): a
        line for each record only a file held, and each file that is missing, cut short or
        edited. Then the repair watermark, so the next open does not read it all again; a
        merge instead has the repair check every record, its own ones included."""
        from outbox.mirror.forget import Redactor
        from outbox.mirror.jsonl import accepted_event
        from outbox.mirror.repair import MirrorSync

        settings = self.settings
        found = evidence.records()
        unlogged = [item for item in found if not item.from_log]
        mirrors.jsonl.append(
            [
                accepted_event(
                    item.record, seqs[item.record.key], item.markdown_name, [*item.sinks]
                )
                for item in unlogged
            ]
        )
        report.lines_appended = len(unlogged)
        report.files_written = _mend_files(storage, settings.markdown_dir, found, report.problems)
        redactor = Redactor(storage, mirrors.jsonl, settings.markdown_dir, settings.mirror_id)
        report.forgets_finished = redactor.run()  # before the repair could write a file back
        if self.merge:
            repaired = MirrorSync(
                storage, mirrors.jsonl, settings.markdown_dir, settings.mirror_id
            ).run()
            report.lines_appended += repaired.lines_appended
            report.files_written += repaired.files_written
            report.problems += repaired.problems
            return
        size, last_line = mirrors.jsonl.end()
        storage.mirror_state.set_mirror_watermark(
            settings.mirror_id, max(seqs.values(), default=0), size, last_line
        )


def _by_sinks(batch: list[Found]) -> dict[tuple[str, ...], list[Found]]:
    """The batch grouped by sink list (one insert statement per table for each group)."""
    groups: dict[tuple[str, ...], list[Found]] = {}
    for item in batch:
        groups.setdefault(item.sinks, []).append(item)
    return groups


def _count(
    report: RebuildReport, batch: list[Found], fresh: list[Found], outcomes: list[KnownOutcome]
) -> None:
    report.already_there += len(batch) - len(fresh)
    report.from_log += sum(1 for item in fresh if item.from_log)
    report.from_markdown += sum(1 for item in fresh if not item.from_log)
    report.pending += sum(len(item.sinks) for item in fresh) - len(outcomes)
    for outcome in outcomes:
        if outcome.state == DeliveryState.DELIVERED:
            report.delivered += 1
        elif outcome.state == DeliveryState.DEAD:
            report.dead += 1
        else:
            report.discarded += 1


def _mend_files(storage: Storage, folder: Path, found: list[Found], problems: list[str]) -> int:
    """Write each log record's file that is missing, cut short while created, or whose body
    differs from the log's content (an edit: the log is the evidence); returns how many.
    One read per file; front matter is parsed only for a file that needs mending."""
    from outbox.mirror import matter
    from outbox.mirror.repair import cut_short, restore_body

    lacking: list[tuple[Found, Path, bool]] = []
    for item in found:
        if not item.from_log:
            continue  # found in its file, whose body gave its key
        path = folder / item.markdown_name
        try:
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            lacking.append((item, path, True))
            continue
        except OSError as exc:
            problems.append(f"record {item.record.key[:12]}: its file ({exc.strerror}); left")
            continue
        if not data.endswith(markdown.FENCE + item.record.content.encode("utf-8")):
            lacking.append((item, path, False))
    rows = storage.deliveries.deliveries_for(item.record.key for item, _, _ in lacking)
    ensure_private_dir(folder)
    written = 0
    for item, path, missing in lacking:
        record, record_rows = item.record, rows.get(item.record.key, [])
        whole = markdown.render(matter.delivered(record, record_rows), record.content)
        try:
            if missing:
                written += markdown.write_new(path, whole)
            elif cut_short(path, record, record_rows):
                written += markdown.write_atomic(path, whole, durable=False)
            else:
                written += restore_body(path, record)
        except OSError as exc:
            problems.append(f"record {record.key[:12]}: its file not written ({exc.strerror})")
    return written


def _holds_markdown(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(entry.name.endswith(".md") for entry in entries)
    except OSError:
        return False


def _sqlite_file(settings: Settings) -> Path | None:
    from outbox.store.sqlite_writes import sqlite_path

    return sqlite_path(settings.db_url)


def _open_storage(settings: Settings) -> Storage:
    from outbox.store.storage import Storage

    return Storage.from_settings(settings)


def _is_corrupt(settings: Settings, database: Path) -> bool:
    """Whether SQLite calls the file damaged (not a database, malformed, failing its own
    check). Any other trouble (a lock held too long, say) is raised: it is no corruption."""
    import sqlite3

    from sqlalchemy.exc import DBAPIError

    from outbox.store.storage import Storage
    from outbox.write.fallback import failure_reason

    storage = Storage.from_settings(settings)
    try:
        return bool(storage.integrity_problems())
    except (DBAPIError, sqlite3.Error) as exc:
        if failure_reason(exc) == FallbackReason.CORRUPT:
            return True
        raise
    finally:
        storage.close()


def rebuild(
    settings: Settings, *, merge: bool = False, progress: Progress | None = None
) -> RebuildReport:
    """Recreate the database from the log, the markdown files and the fallback queue."""
    return Rebuilder(settings, merge=merge, progress=progress or quiet).run()
