"""What a store's own files say about its records: the evidence ``outbox rebuild`` restores.

The JSONL log's ``accepted`` lines come first (each proves itself: its content and timestamp
must give its key), with the outcome lines after them, the last per sink winning. Markdown
files (the mirror folder, the fallback queue in it) count only for keys the log lacks, and
only when their body gives their key; a file without a key is a legacy file for ``outbox
replay``. A key with a ``forgotten`` line comes back only as the tombstone a forget leaves
(key, instant, importance, sinks), never with content from anywhere; where a forget was cut
off before its mirrors were done (a line not yet redacted, a file left), the tombstone owes
them, and the rebuild finishes them.
Everything here but ``gather`` is pure, so the rules are tested without a store.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outbox.core.errors import ValidationError
from outbox.core.keys import canonical_timestamp, idempotency_key
from outbox.core.naming import file_digest
from outbox.core.record import (
    DEFAULT_IMPORTANCE,
    Record,
    check_importance,
    check_metadata,
    check_tags,
)
from outbox.core.states import DeliveryState, MirrorEvent
from outbox.mirror import markdown
from outbox.mirror.forget import is_redacted
from outbox.mirror.jsonl import JsonlLog
from outbox.store.forgetting import Tombstone
from outbox.store.restore import KnownOutcome

if TYPE_CHECKING:
    from outbox.core.config import Settings

MAX_PROBLEMS = 50

# (phase, done, total or None): a long run reports where it is.
Progress = Callable[[str, int, int | None], None]

_HEX_KEY = re.compile(r"[0-9a-f]{64}")
FORGOTTEN_EVENT = MirrorEvent.FORGOTTEN
_OUTCOMES: dict[object, DeliveryState] = {
    MirrorEvent.DELIVERED: DeliveryState.DELIVERED,
    MirrorEvent.DEAD: DeliveryState.DEAD,
    MirrorEvent.DISCARDED: DeliveryState.DISCARDED,
}


def quiet(_phase: str, _done: int, _total: int | None) -> None:
    """No progress to show."""


class Unusable(Exception):
    """A log line or markdown file that cannot stand as evidence for a record."""


@dataclass(frozen=True)
class Found:
    """A record recovered from the log or a markdown file, with its file and its sinks."""

    record: Record
    markdown_name: str
    sinks: tuple[str, ...]
    from_log: bool


def _slug_of(name: str) -> str:
    """The slug a markdown file name carries (``YYYY-MM-DD-<slug>.md``), as replay reads it."""
    stem = os.path.basename(name).removesuffix(".md")
    slug = stem[11:] if len(stem) > 11 and stem[4] == "-" and stem[10] == "-" else stem
    return slug[:128]


def _proves_key(key: object, content: object, timestamp: object) -> bool:
    """Whether content and canonical timestamp give ``key``: what makes a copy evidence."""
    if not (isinstance(key, str) and isinstance(content, str) and isinstance(timestamp, str)):
        return False
    try:
        return timestamp.isascii() and idempotency_key(content, timestamp) == key
    except UnicodeEncodeError:  # a lone surrogate: no record was ever written with one
        return False


def _fields(source: Mapping[str, Any]) -> tuple[int, tuple[str, ...], dict[str, Any]]:
    """Importance, tags and metadata, checked as ``add`` checks them."""
    tags = source.get("tags")
    if isinstance(tags, str):  # a legacy file's "a, b"
        tags = [tag for tag in tags.split(",") if tag.strip()]
    try:
        return (
            check_importance(source.get("importance", DEFAULT_IMPORTANCE)),
            check_tags(tags),
            check_metadata(source.get("metadata")),
        )
    except ValidationError as exc:
        raise Unusable(str(exc)) from None


def _sink_names(value: object, default: tuple[str, ...]) -> tuple[str, ...]:
    names = list(value) if isinstance(value, list | dict) else None
    if names and all(isinstance(name, str) and name for name in names):
        return tuple(names)
    return default


def record_from_line(event: Mapping[str, Any], default_sinks: tuple[str, ...]) -> Found:
    """The record an ``accepted`` line describes; Unusable when the line proves nothing."""
    key, content, timestamp = event.get("key"), event.get("content"), event.get("timestamp")
    if not _proves_key(key, content, timestamp):
        raise Unusable("its content and timestamp do not give its key")
    name = event.get("markdown")
    if not isinstance(name, str) or not name:
        raise Unusable("it names no markdown file")
    importance, tags, metadata = _fields(event)
    assert isinstance(key, str) and isinstance(content, str) and isinstance(timestamp, str)
    record = Record(key, timestamp, content, importance, tags, metadata, _slug_of(name))
    return Found(record, name, _sink_names(event.get("sinks"), default_sinks), from_log=True)


def outcome_from_line(event: Mapping[str, Any]) -> KnownOutcome | None:
    """The settled delivery an outcome line records (None: not an outcome line, or one
    that proves no delivery, such as a ``delivered`` without the sink's id)."""
    state = _OUTCOMES.get(event.get("event"))
    key, sink = event.get("key"), event.get("sink")
    if state is None or not isinstance(key, str) or not isinstance(sink, str):
        return None
    sink_id = event.get("sink_id") if state == DeliveryState.DELIVERED else None
    if state == DeliveryState.DELIVERED and not (isinstance(sink_id, str) and sink_id):
        return None
    reason = event.get("reason") if state == DeliveryState.DEAD else None
    attempts = event.get("attempts")
    return KnownOutcome(
        key=key,
        sink=sink,
        state=state,
        sink_id=sink_id,
        error_class=reason if isinstance(reason, str) else None,
        attempts=attempts if type(attempts) is int and attempts >= 0 else 1,
    )


def record_from_file(
    name: str, matter: Mapping[str, Any], body: bytes, default_sinks: tuple[str, ...]
) -> Found | None:
    """The record a markdown file holds; None for a file with no key (a legacy file still
    waiting for ``outbox replay``); Unusable when its body does not give its key."""
    key = matter.get("key")
    if not isinstance(key, str) or not _HEX_KEY.fullmatch(key):
        return None
    try:
        timestamp = canonical_timestamp(matter["timestamp"])
        content = body.decode("utf-8")
    except (KeyError, ValidationError, TypeError, ValueError, OverflowError):
        raise Unusable("its timestamp or body cannot be read") from None
    if not _proves_key(key, content, timestamp):
        raise Unusable("its body and timestamp do not give its key")
    importance, tags, metadata = _fields(matter)
    record = Record(key, timestamp, content, importance, tags, metadata, _slug_of(name))
    return Found(record, name, _sink_names(matter.get("sinks"), default_sinks), from_log=False)


@dataclass
class Evidence:
    """Everything the log and the markdown folder say, by key (log first, in log order)."""

    default_sinks: tuple[str, ...]
    found: dict[str, Found] = field(default_factory=dict)
    outcomes: dict[str, dict[str, KnownOutcome]] = field(default_factory=dict)
    forgotten: dict[str, None] = field(default_factory=dict)  # in log order
    redacted: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> its line
    deleted: dict[str, set[str]] = field(default_factory=dict)  # key -> sinks that deleted it
    log_names: set[str] = field(default_factory=set)
    noted: list[tuple[str | None, str]] = field(default_factory=list)  # (key, problem)
    lines: int = 0
    files_read: int = 0
    unkeyed_files: int = 0

    def problem(self, text: str, key: str | None = None) -> None:
        self.noted.append((key, text))

    @property
    def problems(self) -> list[str]:
        """What could not be used, except lines of forgotten records (a forget blanks its
        record's line, so it no longer gives its key, on purpose), the first ones first."""
        texts = [text for key, text in self.noted if key is None or key not in self.forgotten]
        more = ["… more problems not listed"] if len(texts) > MAX_PROBLEMS else []
        return texts[:MAX_PROBLEMS] + more

    def add_line(self, number: int, event: Mapping[str, Any]) -> None:
        """One log line, in order: a record, an outcome (the last one per sink wins), a forget."""
        self.lines += 1
        kind = event.get("event")
        if not event:
            self.problem(f"log line {number} is not a JSON object; left out")
        elif kind == MirrorEvent.ACCEPTED:
            try:
                found = record_from_line(event, self.default_sinks)
            except Unusable as exc:
                key = event.get("key")
                if isinstance(key, str) and is_redacted(dict(event)):
                    self.redacted.setdefault(key, dict(event))
                self.problem(
                    f"log line {number}: {exc}; looked for its record in the files",
                    key if isinstance(key, str) else None,
                )
                return
            if found.record.key not in self.found:
                self.found[found.record.key] = found
                self.log_names.add(found.markdown_name)
        elif kind == FORGOTTEN_EVENT and isinstance(event.get("key"), str):
            self.forgotten[event["key"]] = None
        elif kind == MirrorEvent.DELETED and isinstance(event.get("key"), str):
            self.deleted.setdefault(event["key"], set()).add(str(event.get("sink")))
        elif (outcome := outcome_from_line(event)) is not None:
            self.outcomes.setdefault(outcome.key, {})[outcome.sink] = outcome

    def add_file(self, name: str, matter: Mapping[str, Any], body: bytes) -> None:
        """A markdown file the log does not name: a record only if the log lacks its key."""
        self.files_read += 1
        try:
            found = record_from_file(name, matter, body, self.default_sinks)
        except Unusable as exc:
            self.problem(f"markdown file #{file_digest(name)}: {exc}; left out")
            return
        if found is None:
            self.unkeyed_files += 1
        elif found.record.key not in self.found:
            self.found[found.record.key] = found

    def refuse(self, keys: set[str]) -> None:
        """Leave out the records of ``keys`` (``outbox verify`` refuses their lines as
        evidence), each listed as a problem; a forget of one still stands."""
        for key in sorted(keys & self.found.keys()):
            if key not in self.forgotten:
                del self.found[key]
                self.problem(f"record {key[:12]}: its log line is one verify refuses; left out")

    def records(self) -> list[Found]:
        """What goes back into the database: every record found, except forgotten ones."""
        return [item for key, item in self.found.items() if key not in self.forgotten]

    def tombstones(self) -> list[Tombstone]:
        """Every forgotten record the log or a file tells of. A forget cut off before its
        mirrors were done left an unredacted line or a file: that tombstone owes them."""
        found = []
        for key in self.forgotten:
            line, item = self.redacted.get(key), self.found.get(key)
            importance: object
            if item is not None:
                timestamp, importance = item.record.timestamp, item.record.importance
                sinks, name = item.sinks, item.markdown_name
            elif line is not None:
                timestamp, importance = str(line.get("timestamp")), line.get("importance")
                sinks, name = _sink_names(line.get("sinks"), self.default_sinks), ""
            else:
                continue  # no line or file left to tell its instant: nothing to put back
            found.append(
                Tombstone(
                    key=key,
                    timestamp=timestamp,
                    importance=importance if isinstance(importance, int) else DEFAULT_IMPORTANCE,
                    sinks=sinks,
                    deleted=frozenset(self.deleted.get(key, ())),
                    markdown_name=name,
                    owed=item is not None,
                )
            )
        return found

    def outcomes_for(self, item: Found) -> list[KnownOutcome]:
        """The log's outcomes for ``item``'s own sinks."""
        known = self.outcomes.get(item.record.key, {})
        return [known[sink] for sink in item.sinks if sink in known]


def gather(settings: Settings, progress: Progress = quiet) -> Evidence:
    """Read the log, then the markdown files the log does not name."""
    evidence = Evidence(tuple(settings.sinks))
    for number, line in enumerate(JsonlLog(settings.jsonl_path).lines(), start=1):
        evidence.add_line(number, line.event)
        if number % 10_000 == 0:
            progress("reading the log", number, None)
    progress("reading the log", evidence.lines, evidence.lines)
    folder = settings.markdown_dir
    names = []
    if folder.is_dir():
        with os.scandir(folder) as entries:
            names = sorted(
                entry.name
                for entry in entries
                if entry.name.endswith(".md")
                and not entry.name.startswith(".")
                and entry.name not in evidence.log_names
                and entry.is_file(follow_symlinks=False)
            )
    for done, name in enumerate(names, start=1):
        try:
            matter, body = markdown.read(folder / name)
        except (OSError, markdown.MalformedMarkdown) as exc:
            why = exc.strerror if isinstance(exc, OSError) else str(exc)
            evidence.problem(f"markdown file #{file_digest(name)} cannot be read ({why})")
            continue
        evidence.add_file(name, matter, body)
        if done % 1000 == 0 or done == len(names):
            progress("reading markdown files", done, len(names))
    return evidence
