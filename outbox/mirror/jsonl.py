"""The JSONL mirror: an append-only, hash-chained log of every record and delivery event.

Each line carries ``prev``, the SHA-256 of the previous line's bytes, so ``outbox verify`` can
prove no line was edited, dropped or reordered. Appends happen under the mirror lock (shared
between writer processes) and the log's own lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.core.folders import ensure_private_dir
from outbox.core.safe_files import open_file

GENESIS = "0" * 64
_TAIL_CHUNK = 65_536
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # built once, not per line
# How every line starts (one encoder writes "event", then "key"): enough to name its record.
_NAMED = re.compile(rb'\{"event":"([a-z]+)","key":"([0-9a-f]{64})"')
_HEAD = 128  # bytes of a line that hold its event and key
_COUNT_CHUNK = 1 << 20
_LOOK_BACK = 16  # lines from the end searched for one that names a record


def line_hash(line: bytes) -> str:
    return hashlib.sha256(line).hexdigest()


def encode(event: Mapping[str, Any], prev: str) -> bytes:
    body = dict(event)
    body["prev"] = prev
    return _ENCODER.encode(body).encode("utf-8")


def accepted_event(record: Any, seq: int, markdown_name: str, sinks: list[str]) -> dict[str, Any]:
    """The one ``accepted`` line every record gets, naming its key, content and files."""
    return {
        "event": "accepted",
        "key": record.key,
        "timestamp": record.timestamp,
        "content": record.content,
        "importance": record.importance,
        "tags": list(record.tags),
        "metadata": dict(record.metadata),
        "sinks": sinks,
        "markdown": markdown_name,
        "seq": seq,
    }


@dataclass
class LogLine:
    offset: int
    raw: bytes
    event: dict[str, Any]


_WHAT = "JSONL log"


class JsonlLog:
    """Appends and reads the log; keeps the last hash cached while the file is ours alone."""

    def __init__(self, path: Path, on_torn: Callable[[], object] | None = None) -> None:
        """``on_torn`` runs whenever a torn last line is cut: lines may have been lost with
        it whose outcomes the database already counts as written, so repair must look."""
        self.path = path
        self.on_torn = on_torn
        self._cached: tuple[int, str] | None = None  # (file size, hash of last line)
        self._fd: int | None = None
        self._inode = 0

    def _handle(self) -> tuple[int, int]:
        """The open append handle and the file's size, reopened when the file was replaced
        or removed (one ``stat`` per append while it was not)."""
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            current = None
        if self._fd is not None and (current is None or current.st_ino != self._inode):
            self.close()
        if self._fd is None or current is None:
            ensure_private_dir(self.path.parent)
            self._fd = open_file(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, what=_WHAT)
            self._cached = None
            current = os.fstat(self._fd)
            self._inode = current.st_ino
        return self._fd, current.st_size

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _tail(self, fd: int, size: int) -> tuple[int, str]:
        """Cut a torn last line left by a dead writer and return (size, last line's hash)."""
        if size == 0:
            return 0, GENESIS
        if os.pread(fd, 1, size - 1) != b"\n":
            size = self._find_line_start(fd, size)
            os.ftruncate(fd, size)
            if self.on_torn is not None:
                self.on_torn()
            return self._tail(fd, size)
        start = self._find_line_start(fd, size - 1)
        return size, line_hash(os.pread(fd, size - 1 - start, start))

    @staticmethod
    def _find_line_start(fd: int, end: int) -> int:
        pos = end
        while pos > 0:
            start = max(0, pos - _TAIL_CHUNK)
            chunk = os.pread(fd, pos - start, start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                return start + cut + 1
            pos = start
        return 0

    def append(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Append events as chained lines in one write; undo a partial write.

        Writer processes share the mirror lock, so each append takes the log's own ``flock``
        (held for the write alone): every line names the hash of the line before it.
        """
        if not events:
            return
        fd, _ = self._handle()
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            self._append(fd, os.fstat(fd).st_size, events)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _append(self, fd: int, size: int, events: Sequence[Mapping[str, Any]]) -> None:
        """The append, with the log's lock held: ``size`` is the file's now."""
        if self._cached and self._cached[0] == size:
            prev = self._cached[1]
        else:
            size, prev = self._tail(fd, size)
        lines = []
        for event in events:
            line = encode(event, prev)
            prev = line_hash(line)
            lines.append(line)
        data = b"\n".join(lines) + b"\n"
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(28, "short write to the JSONL mirror")
        except OSError:
            os.ftruncate(fd, size)
            self._cached = None
            raise
        self._cached = (size + len(data), prev)

    def continues_at(self, offset: int, expected_hash: str | None = None) -> bool:
        """Whether the chain runs unbroken through ``offset``: a line boundary whose next line
        (if any) names the hash of the line before it, and that line is the one remembered
        (``expected_hash``, when known). A remembered offset that fails this points into a log
        that lost its tail and was written to again since."""
        if offset == 0:
            return True
        try:
            fd = open_file(self.path, os.O_RDONLY, what=_WHAT)
        except FileNotFoundError:
            return False
        try:
            if offset > os.fstat(fd).st_size or os.pread(fd, 1, offset - 1) != b"\n":
                return False
            start = self._find_line_start(fd, offset - 1)
            before = line_hash(os.pread(fd, offset - 1 - start, start))
        finally:
            os.close(fd)
        if expected_hash is not None and before != expected_hash:
            return False
        following = next(self.lines(offset), None)
        return following is None or following.event.get("prev") == before

    def repair_tail(self) -> int:
        """Cut a torn last line; returns the resulting size (0 when the file is missing)."""
        if not os.path.lexists(self.path):
            return 0
        fd = open_file(self.path, os.O_RDWR, what=_WHAT)
        try:
            size, last = self._tail(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self._cached = (size, last)
        return size

    def end(self) -> tuple[int, str | None]:
        """(size, hash of the last line; None when the log is empty or missing)."""
        size = self.repair_tail()
        assert self._cached is not None or size == 0
        return size, (self._cached[1] if self._cached and size else None)

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def lines(self, offset: int = 0) -> Iterator[LogLine]:
        """Lines from ``offset`` on; a line that is not JSON yields an empty event."""
        try:
            handle = os.fdopen(open_file(self.path, os.O_RDONLY, what=_WHAT), "rb")
        except FileNotFoundError:
            return
        with handle:
            handle.seek(offset)
            pos = offset
            for raw in handle:
                if not raw.endswith(b"\n"):
                    break
                line = raw[:-1]
                try:
                    event = json.loads(line)
                    if not isinstance(event, dict):
                        event = {}
                except ValueError:
                    event = {}
                yield LogLine(pos, line, event)
                pos += len(raw)

    def breaks(
        self,
        redacted: Mapping[int, str] | None = None,
        anchored: Set[tuple[int, str]] = frozenset(),
    ) -> list[Break]:
        """Where the chain does not hold, first ones first.

        ``redacted`` maps the offset of each line a forget redacted in place to the hash the
        line had before, as its ``forgotten`` line recorded: the chain runs through that hash.
        ``anchored`` holds (offset, expected hash) pairs a ``reanchored`` line accounts for.
        """
        redacted = redacted or {}
        found: list[Break] = []
        prev = GENESIS
        for number, line in enumerate(self.lines(), start=1):
            if (line.offset, prev) in anchored:
                pass
            elif not line.event:
                found.append(Break(number, line.offset, prev, None))
            elif line.event.get("prev") != prev:
                found.append(Break(number, line.offset, prev, str(line.event.get("prev"))))
            prev = redacted.get(line.offset) or line_hash(line.raw)
        return found

    def verify_chain(
        self,
        redacted: Mapping[int, str] | None = None,
        anchored: Set[tuple[int, str]] = frozenset(),
    ) -> list[str]:
        """Problems with the chain, first ones first (empty: intact)."""
        return [
            f"{self.path}: line {b.number} "
            + (
                "is not a JSON object"
                if b.found is None
                else "does not chain to the line before it"
            )
            for b in self.breaks(redacted, anchored)[:20]
        ]


@dataclass(frozen=True)
class Break:
    """A line whose ``prev`` is not the hash of the line before it (``found`` None: the
    line is not JSON at all)."""

    number: int
    offset: int
    expected: str
    found: str | None


def reanchor_event(gap: Break) -> dict[str, Any]:
    """The line that accounts for a break: where it is and what the chain expected there
    (the hash of the line that was before it); the lines lost with it come back from the
    database as new lines, never in their old place."""
    return {
        "event": "reanchored",
        "key": "",
        "line": gap.offset,
        "expected": gap.expected,
        "found": gap.found,
    }


def named_keys(path: Path) -> tuple[str, ...]:
    """The keys of the first and the last complete line that name a record (empty: the log
    is missing, empty or names none). Reads the two lines' first bytes only, so it costs the
    same for a million lines as for one (``mirror/gap.py`` asks the database for them)."""
    try:
        fd = open_file(path, os.O_RDONLY, what=_WHAT)
    except FileNotFoundError:
        return ()
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return ()
        # A torn last line (a writer killed mid-append) is not a line yet.
        end = size if os.pread(fd, 1, size - 1) == b"\n" else JsonlLog._find_line_start(fd, size)
        first = _NAMED.match(os.pread(fd, _HEAD, 0)) if end else None
        keys = [first.group(2).decode("ascii")] if first else []
        for _ in range(_LOOK_BACK):
            if end == 0:
                break
            start = JsonlLog._find_line_start(fd, end - 1)
            last = _NAMED.match(os.pread(fd, min(_HEAD, end - start), start))
            if last:
                keys.append(last.group(2).decode("ascii"))
                break
            end = start
    finally:
        os.close(fd)
    return tuple(dict.fromkeys(keys))


def record_count(path: Path) -> int:
    """How many records the log holds: its ``accepted`` lines less its ``forgotten`` ones.
    One pass over the bytes, no line parsed: a line starts only after a newline, and JSON
    escapes every newline inside a value."""
    needles = [f'\n{{"event":"{event}",'.encode() for event in ("accepted", "forgotten")]
    counts = [0, 0]
    overlap = max(map(len, needles)) - 1
    try:
        handle = os.fdopen(open_file(path, os.O_RDONLY, what=_WHAT), "rb")
    except FileNotFoundError:
        return 0
    with handle:
        carry = b"\n"  # the first line starts after an imagined newline
        while chunk := handle.read(_COUNT_CHUNK):
            data = carry + chunk
            for number, needle in enumerate(needles):
                counts[number] += data.count(needle)
            carry = data[-overlap:]  # too short to hold a whole needle: none counted twice
    return max(0, counts[0] - counts[1])
