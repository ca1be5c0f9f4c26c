"""``Mirrors``: one machine's audit copies of its records, behind one object.

The lock, the JSONL log, the markdown folder, the mirror writer, repair and verify are built
once and handed to the writer, the dispatcher and the replayer, so each uses the same files
under the same lock and none of them needs the façade. A new record's mirrors are written by
the mirror writer's thread (``defer``), off the committing caller's clock. Repair and verify
(which read the database through SQLAlchemy) load on first use, so a write does not.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from outbox.core.folders import ensure_private_dir
from outbox.core.record import Record
from outbox.core.slugs import carries_content_hash, markdown_filename
from outbox.mirror import markdown, matter
from outbox.mirror.jsonl import JsonlLog, accepted_event
from outbox.mirror.lock import MirrorLock
from outbox.mirror.markdown import INDEX_NAME, PROCESSING_SUFFIX
from outbox.mirror.writer import MirrorWriter

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.mirror.repair import MirrorSync, RepairReport
    from outbox.mirror.verify import VerifyReport
    from outbox.store.rows import StoredRecord
    from outbox.store.storage import Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NewMirror:
    """A committed record's mirrors to write: its ``accepted`` line and, unless it adopted
    an existing file, its markdown file (``new_file``), rendered by the mirror writer: off
    the committing caller's clock, on the core that is free while the commit's fsync waits."""

    record: Record
    seq: int
    markdown_name: str
    new_file: bool


class Mirrors:
    """The JSONL log and markdown files of the records this machine wrote (``mirror_id``).

    ``storage`` is called only by the paths that read or write the database (repair, verify,
    a file name taken after the commit, a torn log), so a write's mirrors never build it.
    """

    def __init__(
        self,
        storage: Callable[[], Storage],
        *,
        jsonl_path: Path,
        markdown_dir: Path,
        mirror_id: str,
        sinks: Sequence[str],
    ) -> None:
        self.storage = storage
        self.jsonl = JsonlLog(jsonl_path, on_torn=self._rescan_next_time)
        self.lock = MirrorLock(jsonl_path.with_name(jsonl_path.name + ".lock"))
        self.markdown_dir = markdown_dir
        self.mirror_id = mirror_id
        self.sinks = tuple(sinks)
        self._sync: MirrorSync | None = None
        self._folder = str(markdown_dir)
        self._folder_ready = False  # made once; a folder removed later is made again
        self.writer: MirrorWriter[NewMirror] = MirrorWriter(self.lock, self._write_new)

    @classmethod
    def from_settings(cls, storage: Callable[[], Storage], settings: Settings) -> Mirrors:
        return cls(
            storage,
            jsonl_path=settings.jsonl_path,
            markdown_dir=settings.markdown_dir,
            mirror_id=settings.mirror_id,
            sinks=settings.sinks,
        )

    def _rescan_next_time(self) -> None:
        """A torn tail was cut (by whichever append or repair met it first): forget the
        repair's watermark, so the next repair reads the whole log and puts back any line
        lost with the tail, outcome lines included."""
        try:
            self.storage().mirror_state.set_mirror_watermark(self.mirror_id, 0, 0, None)
        except Exception as exc:  # this process's own repair still sees the cut
            log.warning("could not reset the mirror watermark (%s)", exc.__class__.__name__)

    def hold(
        self, deadline: float | None = None, *, exclusive: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """The mirror lock: whoever holds it sees every committed record either mirrored or
        left behind by a writer that died, so repair never races a live writer. Only a
        committing writer passes ``exclusive=False``: it does not wait for the mirror
        writes this process still has queued."""
        return self.lock.hold(deadline, exclusive=exclusive)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record this process committed has its line and file (False if
        ``timeout`` passed first). Holding the lock (``hold``) implies it."""
        return self.writer.flush(timeout)

    # -- a new record's files --------------------------------------------------------------

    def path(self, name: str) -> Path:
        return self.markdown_dir / name

    def owner_of(self, name: str) -> str | None:
        """The key in an existing markdown file's front matter; None when there is no file,
        "" when it cannot be read."""
        try:
            found, _ = markdown.read(self.path(name))
        except FileNotFoundError:
            return None
        except (OSError, markdown.MalformedMarkdown):
            return ""
        return str(found.get("key") or "")

    def taken_on_disk(self, name: str, record: Record) -> bool:
        """A file of that name exists and is not this record's (a hand-written, legacy or
        waiting fallback file).

        A name that carries its content's hash (every derived slug) is no person's and no
        other content's by chance: only a waiting fallback file of the same content (same
        day, another instant) can hold it, so the folder is looked up for such a name only
        while fallback files wait. Looking a new name up waits whenever the mirror writer is
        creating files in the same folder (its lock, held through the file system journal's
        slow spells: 0.2-0.5 ms a write, measured). A clash found only when the mirror writer
        creates the file moves the record to its ``-<key8>`` name then (``_create``).
        """
        if carries_content_hash(record.slug, record.content) and not self._fallback_waits():
            return False
        path = os.path.join(self._folder, name)
        return os.path.exists(path) and self.owner_of(name) != record.key

    def _fallback_waits(self) -> bool:
        """Whether the fallback index (or the part an importer claimed) is there: two fixed
        names, so the lookups are answered from the kernel's cache of names."""
        index = os.path.join(self._folder, INDEX_NAME)
        return os.path.exists(index) or os.path.exists(index + PROCESSING_SUFFIX)

    def render_new(self, record: Record) -> bytes:
        return markdown.render(matter.initial(record, self.sinks), record.content)

    def defer(self, items: Sequence[NewMirror], deadline: float | None = None) -> None:
        """Queue committed records' mirrors for the mirror writer, in commit order (call
        under the lock, right after the commit: the lock stays with them until written)."""
        self.writer.submit(items, deadline)

    def _write_new(self, items: Sequence[NewMirror]) -> None:
        """The mirror writer's work: create the files, then append the ``accepted`` lines
        in one write. A failure here loses nothing: the database holds the records and
        repair rewrites their mirrors."""
        names: list[str] = []
        try:
            for item in items:
                names.append(self._create(item) if item.new_file else item.markdown_name)
        except OSError as exc:
            log.warning("markdown mirror write failed (%s); repair will restore it", exc.strerror)
        names += [item.markdown_name for item in items[len(names) :]]
        try:
            self.append_accepted(
                [(item.record, item.seq, name) for item, name in zip(items, names, strict=True)]
            )
        except OSError as exc:
            log.warning("JSONL mirror append failed (%s); repair will restore it", exc.strerror)

    def _create(self, item: NewMirror) -> str:
        """Create the record's file; returns its name. If another key's file took the name
        after the commit chose it (a fallback file written meanwhile, outside the mirror
        lock), move the record to its ``-<key8>`` name rather than leave it without a file."""
        data = self.render_new(item.record)
        if self.create_file(item.markdown_name, data):
            return item.markdown_name
        owner = self.owner_of(item.markdown_name)
        if owner in (item.record.key, ""):  # already ours, or unreadable: repair's to judge
            return item.markdown_name
        record = item.record
        name = markdown_filename(record.timestamp, record.slug, collision_key=record.key)
        try:
            storage = self.storage()
            with storage.engine.begin() as conn:
                storage.records.rename_markdown(conn, record.key, name)
        except Exception as exc:  # the record stands; verify will name the file
            log.warning("could not move a record off a taken file name (%s)", type(exc).__name__)
            return item.markdown_name
        self.create_file(name, data)
        return name

    def create_file(self, name: str, data: bytes) -> bool:
        """Create a record's file 0600 unless the name exists; returns whether it did."""
        if not self._folder_ready:
            ensure_private_dir(self.markdown_dir)
            self._folder_ready = True
        path = os.path.join(self._folder, name)
        try:
            return markdown.write_new(path, data)
        except FileNotFoundError:  # the folder was removed since: make it again
            ensure_private_dir(self.markdown_dir)
            return markdown.write_new(path, data)

    def append_accepted(self, items: Sequence[tuple[Record, int, str]]) -> None:
        """One chained ``accepted`` line per (record, seq, markdown name)."""
        if items:
            sinks = list(self.sinks)
            self.jsonl.append(
                [accepted_event(record, seq, name, sinks) for record, seq, name in items]
            )

    # -- repair and proof ------------------------------------------------------------------

    def _repairer(self) -> MirrorSync:
        if self._sync is None:
            from outbox.mirror.repair import MirrorSync

            self._sync = MirrorSync(self.storage(), self.jsonl, self.markdown_dir, self.mirror_id)
        return self._sync

    def repair(self, full: bool = False) -> RepairReport:
        """Write whatever the mirrors lack (crash leftovers, enqueued records, delivery
        outcomes). ``full`` checks every record, not only those since the last repair."""
        with self.lock.hold():
            return self._repairer().run(full=full)

    def sync_deliveries(self, known: Mapping[str, StoredRecord] | None = None) -> RepairReport:
        """Write delivery outcomes (events, front matter) that are not yet mirrored;
        ``known``: records the caller has read already (``MirrorSync.sync_deliveries``)."""
        with self.lock.hold():
            return self._repairer().sync_deliveries(known=known)

    def verify(self) -> VerifyReport:
        from outbox.mirror.verify import verify

        with self.lock.hold():
            return verify(self.storage(), self.jsonl, self.markdown_dir, self.mirror_id)

    def close(self) -> None:
        """Write what the mirror writer still holds, then let go of the files."""
        self.writer.close()
        self.lock.close()
        self.jsonl.close()
