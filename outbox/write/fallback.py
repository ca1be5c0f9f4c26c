"""The fallback queue: where a write goes when the database cannot take it.

The file is the published markdown mirror format, written atomically (temp file, fsync,
rename, fsync of the folder) because it is then the only copy. Its name goes into a small
append-only index in the same folder, so opening the outbox finds its own fallback files
without scanning a folder that may hold a million mirror files, even while the database is
unavailable.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from outbox.core.errors import DatabaseLacksRecords, DatabaseTimeout, MirrorBusy
from outbox.core.folders import ensure_private_dir
from outbox.core.record import Record
from outbox.core.slugs import markdown_filename
from outbox.core.states import FallbackReason
from outbox.mirror import markdown
from outbox.mirror.markdown import INDEX_NAME, PROCESSING_SUFFIX
from outbox.mirror.matter import initial
from outbox.store.driver_errors import reason_of

log = logging.getLogger(__name__)


def failure_reason(exc: BaseException) -> FallbackReason:
    """The front-matter ``reason`` for a database that could not take a write (pure): the
    write path's own time bounds by their class, the database's errors by their code."""
    if isinstance(exc, MirrorBusy):
        return FallbackReason.DB_BUSY
    if isinstance(exc, DatabaseTimeout):
        return FallbackReason.DB_UNREACHABLE
    if isinstance(exc, DatabaseLacksRecords):
        return FallbackReason.DB_MISSING
    return reason_of(exc)


def _plain_name(name: str) -> bool:
    """A file name of the folder itself: no folder part, no way up, nothing hidden. The index
    is a plain file anyone with the folder can edit; it must not lead an import elsewhere."""
    return bool(name) and "/" not in name and "\0" not in name and not name.startswith(".")


class FallbackQueue:
    """Writes fallback files and keeps the index of those not yet imported."""

    def __init__(self, folder: Path, sinks: tuple[str, ...]) -> None:
        self.folder = folder
        self.sinks = sinks

    @property
    def index_path(self) -> Path:
        return self.folder / INDEX_NAME

    def _front_matter(self, record: Record, reason: str) -> dict[str, object]:
        matter = initial(record, self.sinks, reason)
        matter["outbox_fallback"] = True
        if record.metadata:
            matter["metadata"] = dict(record.metadata)
        return matter

    def write(self, record: Record, reason: str) -> tuple[Path, bool]:
        """Durably write the record's fallback file; returns (path, already there)."""
        ensure_private_dir(self.folder)
        data = markdown.render(self._front_matter(record, reason), record.content)
        for collision in (None, record.key):
            path = self.folder / markdown_filename(record.timestamp, record.slug, collision)
            if markdown.write_atomic(path, data, exclusive=True):
                self._remember(path.name)
                return path, False
            with contextlib.suppress(OSError, markdown.MalformedMarkdown):
                if markdown.read(path)[0].get("key") == record.key:
                    return path, True
        raise FileExistsError(errno.EEXIST, "no free fallback file name")

    def _remember(self, name: str) -> None:
        fd = os.open(self.index_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, name.encode("utf-8") + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def claim_index(self) -> Iterator[list[Path]]:
        """Take the index over for import; names appended meanwhile go to a fresh index.

        One importer at a time across processes (an ``flock``): with two, the one that
        finished first deleted the ``.processing`` file the other had just added names to,
        and the other dying mid-import then lost them. An importer that finds the lock taken
        imports nothing this time, since the holder is at it; one that died left its
        ``.processing`` file behind and the next one picks it up.
        """
        processing = self.folder / f"{INDEX_NAME}{PROCESSING_SUFFIX}"
        if not (self.index_path.exists() or processing.exists()):
            yield []
            return
        fd = os.open(self.folder / f"{INDEX_NAME}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield []
                return
            with self._claimed(processing) as paths:
                yield paths
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _claimed(self, processing: Path) -> Iterator[list[Path]]:
        if self.index_path.exists():
            if processing.exists():
                with processing.open("ab") as target:
                    target.write(self.index_path.read_bytes())
                self.index_path.unlink()
            else:
                os.replace(self.index_path, processing)
        if not processing.exists():
            yield []
            return
        names = dict.fromkeys(
            line.strip() for line in processing.read_text(encoding="utf-8").splitlines()
        )
        inside = [name for name in names if _plain_name(name)]
        if len(inside) < len([name for name in names if name]):
            log.warning("fallback index names a file outside %s; ignored", self.folder)
        yield [self.folder / name for name in inside]
        processing.unlink(missing_ok=True)

    def pending_count(self) -> int:
        """How many fallback files wait for import (cheap: reads the index only)."""
        return len(self.pending_names())

    def pending_names(self) -> list[str]:
        """The names of the fallback files waiting for import, from the index (and the one an
        importer has claimed), each once."""
        names: dict[str, None] = {}
        for path in (self.index_path, self.folder / f"{INDEX_NAME}{PROCESSING_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                lines = path.read_text(encoding="utf-8").splitlines()
                names.update(dict.fromkeys(line.strip() for line in lines if line.strip()))
        return list(names)

    def reason_of(self, name: str) -> str:
        """The reason a waiting fallback file's front matter gives (``unknown`` when the file
        is gone or cannot be read)."""
        if not _plain_name(name):
            return FallbackReason.UNKNOWN.value
        try:
            matter, _ = markdown.read(self.folder / name)
        except (OSError, markdown.MalformedMarkdown):
            return FallbackReason.UNKNOWN.value
        reason = matter.get("reason")
        return str(reason) if reason else FallbackReason.UNKNOWN.value
