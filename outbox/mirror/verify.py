"""``outbox verify``: prove the mirrors and the database agree, and the log was not edited."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox.keys import idempotency_key
from outbox.mirror import markdown
from outbox.mirror.jsonl import JsonlLog
from outbox.mirror.repair import delivery_event
from outbox.states import SETTLED, DeliveryState, MirrorEvent
from outbox.store.delivery_reads import DeliveryRow
from outbox.store.records import StoredRecord
from outbox.store.storage import Storage

MAX_PROBLEMS = 50


@dataclass
class VerifyReport:
    records: int = 0
    jsonl_lines: int = 0
    markdown_files: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)
        elif len(self.problems) == MAX_PROBLEMS:
            self.problems.append("… more problems not listed")


def _why(exc: Exception) -> str:
    """What went wrong, without the file's name (a markdown file's name carries words of
    its content, and verify's output ends up in logs and issues)."""
    if isinstance(exc, OSError):
        return exc.strerror or exc.__class__.__name__
    return str(exc)


# The accepted line's fields that the database also holds, and how to read them from it.
_ACCEPTED_FIELDS: dict[str, Callable[[StoredRecord], object]] = {
    "timestamp": lambda item: item.record.timestamp,
    "content": lambda item: item.record.content,
    "importance": lambda item: item.record.importance,
    "tags": lambda item: list(item.record.tags),
    "metadata": lambda item: dict(item.record.metadata),
    "markdown": lambda item: item.markdown_name,
}


@dataclass
class _LogIndex:
    """What the log says, by key: its accepted lines and its delivery events."""

    accepted: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    events: set[tuple[str, str, str, object]] = field(default_factory=set)


def _read_log(jsonl: JsonlLog, report: VerifyReport) -> _LogIndex:
    """Every line once: its chain (by ``verify_chain``), accepted lines whose content and
    timestamp must give their key, and each delivery event with the id or reason it names."""
    index = _LogIndex()
    for number, line in enumerate(jsonl.lines(), start=1):
        report.jsonl_lines += 1
        event = line.event
        kind, key = event.get("event"), str(event.get("key"))
        if kind == MirrorEvent.ACCEPTED:
            index.accepted.setdefault(key, []).append(event)
            content, timestamp = event.get("content"), event.get("timestamp")
            if not (
                isinstance(content, str)
                and isinstance(timestamp, str)
                and timestamp.isascii()
                and idempotency_key(content, timestamp) == key
            ):
                report.add(
                    f"{jsonl.path}: line {number}: content or timestamp does not match its key"
                )
        elif kind in (MirrorEvent.DELIVERED, MirrorEvent.DEAD, MirrorEvent.DISCARDED):
            detail = event.get("sink_id") if kind == MirrorEvent.DELIVERED else event.get("reason")
            index.events.add((str(kind), key, str(event.get("sink")), detail))
    return index


def _check_accepted(
    item: StoredRecord, lines: list[dict[str, Any]], report: VerifyReport, where: Path
) -> None:
    """Exactly one accepted line, and every field it shares with the database equal."""
    key = item.record.key
    if len(lines) != 1:
        report.add(f"record {key[:12]}: {len(lines)} accepted lines in {where} (expected 1)")
        return
    differ = [
        name
        for name, read in _ACCEPTED_FIELDS.items()
        if name in lines[0] and lines[0][name] != read(item)
    ]
    if differ:
        report.add(f"record {key[:12]}: {', '.join(differ)} in {where} differ from the database")


def _check_events(
    rows: list[DeliveryRow], index: _LogIndex, report: VerifyReport, where: Path
) -> None:
    """Each outcome the database has mirrored is in the log, with the same id or reason."""
    for row in rows:
        if row.mirror_pending or row.state not in SETTLED:
            continue  # not written out yet: a dispatcher is on its way
        event = delivery_event(row)
        assert event is not None
        detail = (
            event.get("sink_id") if row.state == DeliveryState.DELIVERED else event.get("reason")
        )
        if (str(event["event"]), row.key, row.sink, detail) not in index.events:
            report.add(
                f"record {row.key[:12]}: {row.state} for {row.sink} in the database, "
                f"but no matching {event['event']} line in {where}"
            )


def _check_markdown(item: StoredRecord, markdown_dir: Path, report: VerifyReport) -> None:
    key = item.record.key
    try:
        matter, body = markdown.read(markdown_dir / item.markdown_name)
    except FileNotFoundError:
        report.add(f"record {key[:12]}: its markdown file is missing from {markdown_dir}")
        return
    except (OSError, markdown.MalformedMarkdown) as exc:
        report.add(f"record {key[:12]}: its markdown file is unreadable ({_why(exc)})")
        return
    report.markdown_files += 1
    if matter.get("key") not in (None, key):
        report.add(f"record {key[:12]}: its markdown file carries another key")
    if body != item.record.content.encode("utf-8"):
        report.add(
            f"record {key[:12]}: the body of its markdown file differs from the stored content"
        )


def verify(storage: Storage, jsonl: JsonlLog, markdown_dir: Path, mirror_id: str) -> VerifyReport:
    """Read-only proof: the database's own check, the log's chain, every field the log shares
    with the database (delivery outcomes included), and each record's markdown file."""
    report = VerifyReport()
    try:
        for problem in storage.integrity_problems():
            report.add(f"database: {problem}")
    except Exception as exc:  # a database too damaged to check is the answer itself
        report.add(
            f"database: {exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
        return report
    for problem in jsonl.verify_chain():
        report.add(problem)
    index = _read_log(jsonl, report)
    batch: list[StoredRecord] = []
    for item in storage.records.iter_records(origin=mirror_id):
        batch.append(item)
        if len(batch) == 500:
            _check_batch(storage, batch, index, markdown_dir, jsonl.path, report)
            batch = []
    _check_batch(storage, batch, index, markdown_dir, jsonl.path, report)
    for key, lines in index.accepted.items():
        report.add(
            f"{len(lines)} accepted line(s) for {key[:12]}, which the database does not hold"
        )
    return report


def _check_batch(
    storage: Storage,
    batch: list[StoredRecord],
    index: _LogIndex,
    markdown_dir: Path,
    where: Path,
    report: VerifyReport,
) -> None:
    rows = storage.deliveries.deliveries_for(item.record.key for item in batch)
    for item in batch:
        report.records += 1
        key = item.record.key
        _check_accepted(item, index.accepted.pop(key, []), report, where)
        _check_events(rows.get(key, []), index, report, where)
        _check_markdown(item, markdown_dir, report)
