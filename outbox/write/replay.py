"""Import pending markdown files into the outbox.

Two sources: the outbox's own fallback files (found through the fallback index on every open)
and folders of files an earlier fallback skill left behind (``outbox replay DIR``). Each file stays
where it is, under its own name, and becomes its record's markdown mirror; nothing is moved or
deleted, and a file whose record is already in the outbox adds nothing.

The log names a record by its key prefix, never by its file: a file's name carries the first
words of its memory, and logs travel. A file with no key to go by (it cannot be parsed) is
named there by a short digest of its name. The report of ``outbox replay`` is read by the
files' owner in their terminal: it names a skipped file by its path, so they can open it.

A file another tool's fallback wrote (seed 000's ``brain_store`` skill) is imported with its
provenance in the record's metadata (``fallback_source_path``, ``replayed_by``), which the
BrainLayer sink hands on to BrainLayer; the key stays the content's and the timestamp's.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from outbox import __version__
from outbox.core.errors import ValidationError
from outbox.core.keys import canonical_timestamp, idempotency_key
from outbox.core.naming import file_digest, key_prefix
from outbox.core.record import (
    DEFAULT_IMPORTANCE,
    FALLBACK_SOURCE_PATH,
    REPLAYED_BY,
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
# What a replay names itself as in the records it imports (BrainLayer's ``replayed_by``).
REPLAYER = f"outbox {__version__}"


@dataclass
class ReplayReport:
    """What a replay did. ``imported``, ``already`` and ``skipped`` hold file paths for the
    caller in this process. ``name_of`` names a file for a log (never by its name);
    ``path_of`` and ``to_dict`` are the owner's report, which gives a skipped file's path."""

    pending: int = 0
    imported: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    refused: str | None = None
    not_reached: int = 0
    keys: dict[str, str] = field(default_factory=dict)  # file path -> its record's key
    folder: Path | None = None  # the markdown folder the report's paths are relative to

    @property
    def ok(self) -> bool:
        return self.refused is None

    def name_of(self, path: str) -> str:
        """How a log line names a file: its record's key prefix, else its name's digest."""
        key = self.keys.get(path)
        return f"record {key_prefix(key)}" if key else f"file #{file_digest(path)}"

    def path_of(self, path: str) -> str:
        """How the report names a file to its owner: relative to the markdown folder when
        it is in it, else absolute."""
        where = Path(path).absolute()
        if self.folder is not None:
            folder = self.folder.absolute()
            if where.is_relative_to(folder):
                return str(where.relative_to(folder))
        return str(where)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "pending": self.pending,
            "imported": [key_prefix(self.keys[path]) for path in self.imported],
            "already_in_outbox": [key_prefix(self.keys[path]) for path in self.already],
            "skipped": [
                {
                    "key": key_prefix(self.keys[path]) if path in self.keys else None,
                    "path": str(Path(path).absolute()),  # --json paths are absolute
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


def load_pending(
    path: Path, min_length: int, max_bytes: int, replayed_by: str | None = None
) -> PendingFile | None:
    """The record a pending file describes; None when the file is not pending; Skip if bad.
    With ``replayed_by``, a file not of our own fallback queue carries its provenance."""
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
        if replayed_by is not None and matter.get("outbox_fallback") is not True:
            metadata = check_metadata(
                {
                    **metadata,
                    FALLBACK_SOURCE_PATH: str(path.resolve()),
                    REPLAYED_BY: replayed_by,
                }
            )
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


def _load(
    paths: Iterable[Path], settings: Settings, report: ReplayReport, replayed_by: str | None
) -> list[PendingFile]:
    """The pending files among ``paths``; a bad one goes to the report's skipped."""
    found: list[PendingFile] = []
    for path in paths:
        try:
            pending = load_pending(
                path, settings.min_content_length, settings.max_content_bytes, replayed_by
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


def _scan(folder: Path, settings: Settings, report: ReplayReport) -> list[PendingFile] | None:
    """Every pending file of ``folder`` (no store needed); None, refused, when it is not a
    folder."""
    if not folder.is_dir():
        report.refused = f"{folder} is not a folder"
        return None
    paths = sorted(
        Path(entry.path)
        for entry in os.scandir(folder)
        if entry.name.endswith(".md") and not entry.name.startswith(".") and entry.is_file()
    )
    return _load(paths, settings, report, REPLAYER)


def _within_budget(
    files: list[PendingFile], budget: int | None, report: ReplayReport
) -> list[PendingFile] | None:
    """The files this run imports; None, refused, above 100 without a budget."""
    report.pending = len(files)
    if budget is None and len(files) > REPLAY_LIMIT:
        report.refused = (
            f"{len(files)} pending files is more than {REPLAY_LIMIT}; "
            "pass --budget N to import N of them"
        )
        return None
    if budget is not None and len(files) > budget:
        report.not_reached = len(files) - budget
        return files[:budget]
    return files


def survey(folder: Path, settings: Settings, budget: int | None = None) -> ReplayReport:
    """What ``outbox replay`` would import from ``folder`` where there is no store yet, found
    without making one: a refusal or nothing to import then leaves no trace."""
    report = ReplayReport(folder=settings.markdown_dir)
    files = _scan(folder, settings, report)
    if files is not None:
        _within_budget(files, budget, report)
    return report


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
        report = ReplayReport(folder=self.settings.markdown_dir)
        found = _scan(folder, self.settings, report)
        if found is None:
            return report
        files = _within_budget(self._not_yet_imported(found, report), budget, report)
        if files is None:
            return report
        self.import_files(files, report, progress)
        if report.imported:
            self.on_import()
        return report

    def import_own_fallback(self) -> ReplayReport:
        """Bring this outbox's fallback files in, through the index (no folder scan)."""
        report = ReplayReport()
        with self.fallback.claim_index() as paths:
            existing = [path for path in paths if path.exists()]
            files = _load(existing, self.settings, report, None)
            report.pending = len(files)
            self.import_files(files, report)
        for path, why in report.skipped:
            log.warning("fallback import skipped %s: %s", report.name_of(path), why)
        if report.imported:
            log.info("imported %d fallback records", len(report.imported))
            self.on_import()
        return report
