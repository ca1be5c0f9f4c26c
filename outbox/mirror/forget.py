"""A forget's mirror work: redact the record's log line in place and delete its file (and
any temp copy of it a killed writer left).

The log stays append-only in every other way and its chain stays provable: before the
accepted line is overwritten, a ``forgotten`` line is appended naming that line's offset and
the hash it had. ``verify`` then takes the recorded hash for the redacted line, and checks
that the redaction removed only the content (content, tags, metadata, file name). The
redacted line keeps its length, padded with spaces, so no offset after it moves.

Runs under the mirror lock; every step may be repeated after a crash without harm.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.core.errors import about_record
from outbox.core.safe_files import open_file
from outbox.core.states import MirrorEvent
from outbox.mirror import markdown
from outbox.mirror.jsonl import JsonlLog, accepted_event, line_hash
from outbox.store.rows import StoredRecord
from outbox.store.storage import Storage

log = logging.getLogger(__name__)

# The fields of an accepted line that carry what the caller wrote, and their redacted values.
REDACTED: dict[str, Any] = {"content": "", "tags": [], "metadata": {}, "markdown": ""}
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def redact(raw: bytes) -> bytes:
    """The accepted line ``raw`` with its content fields emptied, padded to the same length
    (an object's closing brace may follow any whitespace)."""
    event = json.loads(raw)
    for name, empty in REDACTED.items():
        if name in event:
            event[name] = empty
    body = _ENCODER.encode(event).encode("utf-8")
    if len(body) > len(raw):  # cannot happen: every emptied value is its shortest form
        raise ValueError("the redacted line is longer than the line it replaces")
    return body[:-1] + b" " * (len(raw) - len(body)) + b"}"


def is_redacted(event: dict[str, Any]) -> bool:
    """Whether an accepted line holds nothing of the record's content any more."""
    return event.get("event") == MirrorEvent.ACCEPTED and all(
        event.get(name, empty) == empty for name, empty in REDACTED.items()
    )


def forgotten_event(key: str, offset: int, original_hash: str) -> dict[str, Any]:
    return {"event": MirrorEvent.FORGOTTEN.value, "key": key, "line": offset, "hash": original_hash}


def _needle(kind: MirrorEvent, key: str) -> bytes:
    # Lines are written by one encoder with "event" then "key" first, so this is a line start.
    return f'{{"event":"{kind.value}","key":"{key}"'.encode()


@dataclass
class _Found:
    accepted: tuple[int, bytes] | None  # (offset, raw line)
    forgotten: bool


def _find(path: Path, key: str, seq: int, *, resumed: bool) -> _Found:
    """The record's accepted line, and (``resumed``: a forget a crash interrupted) whether
    its forgotten line is already written. A fresh forget has none, so only a resumed one
    pays for a search through the whole log."""
    try:
        fd = open_file(path, os.O_RDONLY, what="JSONL log")
    except FileNotFoundError:
        return _Found(None, False)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return _Found(None, False)
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as data:
            needle = _needle(MirrorEvent.ACCEPTED, key)
            accepted = _by_seq(data, needle, seq) or _line_at(data, needle, 0, size)
            forgotten = resumed and _line_at(data, _needle(MirrorEvent.FORGOTTEN, key), 0, size)
            return _Found(accepted, bool(forgotten))
    finally:
        os.close(fd)


_ACCEPTED_START = b'\n{"event":"accepted",'
_WINDOW = 65_536  # below this, a plain search beats more halving


def _by_seq(data: mmap.mmap, needle: bytes, seq: int) -> tuple[int, bytes] | None:
    """Halve the log by the ``seq`` of its accepted lines, which a machine writes in commit
    order, then search the last window: a few reads however long the log. A line written out
    of order (restored by a repair) is not found here; the caller then searches everything."""
    low, high = 0, len(data)
    while high - low > _WINDOW:
        middle = (low + high) // 2
        start = data.find(_ACCEPTED_START, middle, high)
        if start < 0:
            high = middle
            continue
        stop = data.find(b"\n", start + 1)
        if stop < 0:
            high = middle
            continue
        try:
            found = json.loads(data[start + 1 : stop]).get("seq")
        except ValueError:
            return None
        if not isinstance(found, int):
            return None
        if found == seq:
            return _line_at(data, needle, start, stop + 1)
        if found < seq:
            low = stop
        else:
            high = start + 1
    return _line_at(data, needle, max(0, low - 1), high)


def _line_at(data: mmap.mmap, needle: bytes, begin: int, end: int) -> tuple[int, bytes] | None:
    """The last whole line in ``data[begin:end]`` that starts with ``needle``."""
    while (at := data.rfind(needle, begin, end)) >= 0:
        if at == 0 or data[at - 1 : at] == b"\n":
            stop = data.find(b"\n", at)
            if stop < 0:
                return None  # a torn last line: not a line yet
            return at, bytes(data[at:stop])
        end = at
    return None


class Redactor:
    """Finishes forgets in one machine's mirrors: the log line, the markdown file."""

    def __init__(self, storage: Storage, jsonl: JsonlLog, markdown_dir: Path, mirror_id: str):
        self.storage = storage
        self.jsonl = jsonl
        self.markdown_dir = markdown_dir
        self.mirror_id = mirror_id

    def run(self) -> int:
        """Finish every forget whose mirrors are still due (a crash cut them off); returns
        how many."""
        done = 0
        while due := self.storage.forgetting.mirrors_due(self.mirror_id):
            for item in due:
                self.finish(item, resumed=True)
            self.storage.forgetting.mirrors_done([item.record.key for item in due])
            done += len(due)
        return done

    def finish(self, item: StoredRecord, *, resumed: bool) -> None:
        """Redact ``item``'s log line and delete its markdown file (caller holds the lock).
        ``resumed``: an earlier attempt may have written the forgotten line already."""
        key = item.record.key
        self.jsonl.repair_tail()
        found = _find(self.jsonl.path, key, item.seq, resumed=resumed)
        if found.accepted is None:
            # Forgotten before its line was written (a crash in between): the line it gets
            # holds nothing to redact, and the forgotten line records its own hash.
            offset, _ = self.jsonl.end()
            self.jsonl.append([accepted_event(item.record, item.seq, "", [])])
            raw = next(self.jsonl.lines(offset)).raw
            self.jsonl.append([forgotten_event(key, offset, line_hash(raw))])
        else:
            offset, raw = found.accepted
            if not found.forgotten:  # first the evidence, then the overwrite
                self.jsonl.append([forgotten_event(key, offset, line_hash(raw))])
            if not is_redacted(json.loads(raw)):
                self._overwrite(offset, redact(raw))
        with about_record(key, "delete"):
            self._delete_file(item)

    def _overwrite(self, offset: int, data: bytes) -> None:
        fd = open_file(self.jsonl.path, os.O_WRONLY, what="JSONL log")
        try:
            os.pwrite(fd, data, offset)
            os.fsync(fd)  # the content must not come back with a crash
        finally:
            os.close(fd)

    def _delete_file(self, item: StoredRecord) -> None:
        """The record's file, and any temp copy of it a writer killed before its rename left
        (present or not, the file's name finds them)."""
        if item.markdown_name:
            remove_copy(self.markdown_dir, item.markdown_name, item.record.key)
            temps = markdown.remove_stale_temps(self.markdown_dir, item.markdown_name)
            if temps:
                log.info(
                    "record %s: %d temporary copies of its markdown file removed",
                    item.record.key[:12],
                    temps,
                )

    def sweep(self, key: str) -> int:
        """Remove every file in the markdown folder that still carries the forgotten
        ``key`` (a copy a forget could not know of); reads the whole folder, so it runs only
        when asked again to forget (caller holds the lock). Returns how many."""
        found = files_carrying(self.markdown_dir, {key})
        return sum(remove_copy(self.markdown_dir, name, key) for name in found.get(key, []))


def remove_copy(folder: Path, name: str, key: str) -> bool:
    """Delete ``name`` in ``folder`` when it is ``key``'s file (its front matter names that
    key, or none, or cannot be read); a file another key took is left in place."""
    path = folder / name  # an absolute name stays absolute
    try:
        found, _ = markdown.read(path)
    except FileNotFoundError:
        return False
    except (OSError, markdown.MalformedMarkdown):
        found = {}  # a torn or unreadable file of this record's name is still its own
    if found.get("key") not in (None, key):
        log.warning("record %s: its markdown file now carries another key; left in place", key[:12])
        return False
    path.unlink(missing_ok=True)
    return True


def files_carrying(
    folder: Path, keys: Collection[str], skip: Collection[str] = ()
) -> dict[str, list[str]]:
    """The markdown files in ``folder`` (other than ``skip``) whose front matter names one of
    ``keys``, by key: the one scan that finds a forgotten record's leftover copies, for
    ``verify`` and for a forget asked again."""
    found: dict[str, list[str]] = {}
    if not keys:
        return found
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return found
    for entry in entries:
        if not entry.name.endswith(".md") or entry.name in skip:
            continue
        if not entry.is_file(follow_symlinks=False):
            continue
        try:
            matter, _ = markdown.read(Path(entry.path))
        except (OSError, markdown.MalformedMarkdown):
            continue
        key = matter.get("key")
        if isinstance(key, str) and key in keys:
            found.setdefault(key, []).append(entry.name)
    return found
