"""Import pending markdown files into the outbox.

Two sources: the outbox's own fallback files (found through the fallback index on every open)
and folders of files an earlier fallback skill left behind (``outbox replay DIR``). Each file stays
where it is, under its own name, and becomes its record's markdown mirror; nothing is moved or
deleted, and a file whose record is already in the outbox adds nothing.

The report and the log name a record by its key prefix, never by its file: a file's name
carries the first words of its memory. A file with no key to go by (it cannot be parsed) is
named by a short digest of its name.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from outbox.core.errors import ValidationError
from outbox.core.keys import canonical_timestamp, idempotency_key
from outbox.core.naming import file_digest, key_prefix
from outbox.core.record import (
    DEFAULT_IMPORTANCE,
    Record,
    check_content,
    check_importance,
    check_metadata,
    check_tags,
)
from outbox.mirror import markdown
from outbox.store.engine import UNAVAILABLE

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.store.storage import Storage
    from outbox.write.fallback import FallbackQueue
    from outbox.write.writer import Accepted, Writer

log = logging.getLogger(__name__)

REPLAY_LIMIT = 100
BATCH = 100


@dataclass
class ReplayReport:
    """What a replay did. ``imported``, ``already`` and ``skipped`` hold file paths for the
    caller in this process; ``to_dict`` and ``name_of``, what is printed, never do."""

    pending: int = 0
    imported: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    refused: str | None = None
    not_reached: int = 0
    keys: dict[str, str] = field(default_factory=dict)  # file path -> its record's key

    @property
    def ok(self) -> bool:
        return self.refused is None

    def name_of(self, path: str) -> str:
        """How a file is named in print: its record's key prefix, else its name's digest."""
        key = self.keys.get(path)
        return f"record {key_prefix(key)}" if key else f"file #{file_digest(path)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "pending": self.pending,
            "imported": [key_prefix(self.keys[path]) for path in self.imported],
            "already_in_outbox": [key_prefix(self.keys[path]) for path in self.already],
            "skipped": [
                {
                    "key": key_prefix(self.keys[path]) if path in self.keys else None,
                    "file_digest": file_digest(path),
                    "why": why,
                }
                for path, why in self.skipped
            ],
            "warnings": self.warnings,
            "refused": self.refused,
            "not_reached": self.not_reached,
        }


@dataclass(frozen=True)
class PendingFile:
    path: Path
    record: Record
    matter: dict[str, Any]


class Skip(Exception):
    """A file that cannot be imported; its reason is reported and the replay goes on."""


def is_pending(matter: dict[str, Any]) -> bool:
    """The legacy rule (intended for BrainLayer, no chunk id yet), plus our own fallback files."""
    chunk = matter.get("chunk_id")
    empty_chunk = chunk is None or (isinstance(chunk, str) and not chunk.strip())
    if matter.get("outbox_fallback") is True:
        return True
    return matter.get("intended_brain_store") is True and empty_chunk


def load_pending(path: Path, min_length: int, max_bytes: int) -> PendingFile | None:
    """The record a pending file describes; None when the file is not pending; Skip if bad."""
    try:
        matter, body = markdown.read(path)
    except markdown.MalformedMarkdown as exc:
        raise Skip(str(exc)) from None
    except OSError as exc:
        raise Skip(f"cannot read it ({exc.strerror})") from None
    if not is_pending(matter):
        return None
    if "timestamp" not in matter or matter["timestamp"] in (None, ""):
        raise Skip("front matter has no timestamp")
    try:
        content = body.decode("utf-8")
    except UnicodeDecodeError:
        raise Skip("body is not valid UTF-8") from None
    try:
        ts = canonical_timestamp(matter["timestamp"])
        content = check_content(content, min_length=min_length, max_bytes=max_bytes)
        importance = check_importance(matter.get("importance", DEFAULT_IMPORTANCE))
        raw_tags = matter.get("tags")
        if isinstance(raw_tags, str):
            raw_tags = [tag for tag in raw_tags.split(",") if tag.strip()]
        tags = check_tags(raw_tags)
        metadata = check_metadata(matter.get("metadata"))
    except ValidationError as exc:
        raise Skip(str(exc)) from None
    except (TypeError, ValueError, OverflowError) as exc:  # a timestamp of no known shape
        raise Skip(f"timestamp cannot be read ({exc.__class__.__name__})") from None
    stem = path.stem
    slug = stem[11:] if len(stem) > 11 and stem[4] == "-" and stem[10] == "-" else stem
    record = Record(
        key=idempotency_key(content, ts),
        timestamp=ts,
        content=content,
        importance=importance,
        tags=tags,
        metadata=metadata,
        slug=slug[:128],
    )
    return PendingFile(path, record, matter)


class Replayer:
    """Imports pending files through the writer, as records of this machine's mirrors.

    ``on_import`` runs after files were imported (the façade wakes a local dispatcher).
    """

    def __init__(
        self,
        storage: Storage,
        writer: Writer,
        fallback: FallbackQueue,
        settings: Settings,
        on_import: Callable[[], object] = lambda: None,
    ) -> None:
        self.storage = storage
        self.writer = writer
        self.fallback = fallback
        self.settings = settings
        self.on_import = on_import

    def _name_for(self, path: Path) -> str:
        """Relative inside the markdown folder, absolute elsewhere (the file stays put)."""
        folder = self.settings.markdown_dir.resolve()
        resolved = path.resolve()
        return resolved.name if resolved.parent == folder else str(resolved)

    def _load(self, paths: Iterable[Path], report: ReplayReport) -> list[PendingFile]:
        settings = self.settings
        found: list[PendingFile] = []
        for path in paths:
            try:
                pending = load_pending(
                    path, settings.min_content_length, settings.max_content_bytes
                )
            except Skip as exc:
                report.skipped.append((str(path), str(exc)))
                continue
            if pending is None:
                continue
            key = pending.record.key
            report.keys[str(path)] = key
            for name in ("importance", "tags"):
                if name not in pending.matter:
                    report.warnings.append(
                        f"record {key_prefix(key)}: no {name} in front matter; imported default"
                    )
            found.append(pending)
        return found

    def _not_yet_imported(
        self, files: list[PendingFile], report: ReplayReport
    ) -> list[PendingFile]:
        """Report files whose record the outbox already holds, and leave them out.

        They stay pending by the legacy rule (only BrainLayer fills ``chunk_id``), so counting
        them would spend a ``--budget`` on nothing and, past 100, refuse every later replay.
        """
        known = self.storage.records.get_records(item.record.key for item in files)
        fresh: list[PendingFile] = []
        for item in files:
            if item.record.key in known:
                report.already.append(str(item.path))
            else:
                fresh.append(item)
        return fresh

    def import_files(
        self,
        files: list[PendingFile],
        report: ReplayReport,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Commit in batches; adopt each file as its record's mirror and stamp its key."""
        for start in range(0, len(files), BATCH):
            unique: dict[str, PendingFile] = {}
            for item in files[start : start + BATCH]:
                report.keys[str(item.path)] = item.record.key
                if item.record.key in unique:
                    report.already.append(str(item.path))
                    self._drop_copy(item, report)
                else:
                    unique[item.record.key] = item
            for entry in self._commit(list(unique.values()), report):
                self._stamp(entry, unique[entry.record.key], report)
            if progress:
                progress(min(start + BATCH, len(files)), len(files))

    def _commit(self, items: list[PendingFile], report: ReplayReport) -> list[Accepted]:
        """One transaction for the batch; if something other than the database refuses it,
        each file alone, so one bad file is skipped and never costs the others."""
        adopted = {item.record.key: self._name_for(item.path) for item in items}
        try:
            return self.writer.commit([item.record for item in items], adopted)
        except UNAVAILABLE:
            raise  # the database itself: the caller falls back and imports later
        except Exception:
            if len(items) == 1:
                raise
        accepted: list[Accepted] = []
        for item in items:
            try:
                accepted += self._commit([item], report)
            except UNAVAILABLE:
                raise
            except Exception as exc:
                report.skipped.append((str(item.path), f"not imported ({exc.__class__.__name__})"))
        return accepted

    def _drop_copy(self, item: PendingFile, report: ReplayReport) -> None:
        """Remove one of our own fallback files whose record the outbox holds under another
        file (or has forgotten): a second copy of the same write (same content and instant),
        which would otherwise keep its words in the folder after a forget."""
        if item.matter.get("outbox_fallback") is not True:
            return  # a legacy file stays where it is
        try:
            item.path.unlink(missing_ok=True)
        except OSError as exc:
            report.warnings.append(
                f"record {key_prefix(item.record.key)}: a second copy of its fallback file "
                f"not removed ({exc.strerror})"
            )

    def _stamp(self, entry: Accepted, item: PendingFile, report: ReplayReport) -> None:
        """Mark an imported file with its key, and take it off the fallback queue."""
        (report.already if entry.duplicate else report.imported).append(str(item.path))
        if entry.duplicate and entry.markdown_name != self._name_for(item.path):
            self._drop_copy(item, report)
            if item.matter.get("outbox_fallback") is True:
                return
        updates: dict[str, Any] = {} if entry.duplicate else {"key": entry.record.key}
        if item.matter.get("outbox_fallback") is True:
            # Its record is in the outbox now, whoever put it there: no longer queued.
            updates["outbox_fallback"] = False
        if not updates:
            return
        try:
            markdown.update_front_matter(item.path, updates)
        except OSError as exc:
            report.warnings.append(
                f"record {key_prefix(entry.record.key)}: front matter of its file not updated "
                f"({exc.strerror})"
            )

    def replay_dir(
        self,
        folder: Path,
        budget: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReplayReport:
        """``outbox replay DIR``: refuse above 100 pending files without a budget."""
        report = ReplayReport()
        if not folder.is_dir():
            report.refused = f"{folder} is not a folder"
            return report
        paths = sorted(
            Path(entry.path)
            for entry in os.scandir(folder)
            if entry.name.endswith(".md") and not entry.name.startswith(".") and entry.is_file()
        )
        files = self._not_yet_imported(self._load(paths, report), report)
        report.pending = len(files)
        if budget is None and len(files) > REPLAY_LIMIT:
            report.refused = (
                f"{len(files)} pending files is more than {REPLAY_LIMIT}; "
                "pass --budget N to import N of them"
            )
            return report
        if budget is not None and len(files) > budget:
            report.not_reached = len(files) - budget
            files = files[:budget]
        self.import_files(files, report, progress)
        if report.imported:
            self.on_import()
        return report

    def import_own_fallback(self) -> ReplayReport:
        """Bring this outbox's fallback files in, through the index (no folder scan)."""
        report = ReplayReport()
        with self.fallback.claim_index() as paths:
            existing = [path for path in paths if path.exists()]
            files = self._load(existing, report)
            report.pending = len(files)
            self.import_files(files, report)
        for path, why in report.skipped:
            log.warning("fallback import skipped %s: %s", report.name_of(path), why)
        if report.imported:
            log.info("imported %d fallback records", len(report.imported))
            self.on_import()
        return report
