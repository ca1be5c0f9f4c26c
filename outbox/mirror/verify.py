"""``outbox verify``: prove the mirrors and the database agree, and the log was not edited."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outbox.core.keys import idempotency_key
from outbox.core.states import SETTLED, DeliveryState, MirrorEvent
from outbox.mirror import markdown, matter
from outbox.mirror.forget import files_carrying, is_redacted
from outbox.mirror.jsonl import JsonlLog
from outbox.mirror.repair import delivery_event
from outbox.store.delivery_reads import DeliveryRow
from outbox.store.rows import StoredRecord
from outbox.store.storage import Storage

MAX_PROBLEMS = 50


@dataclass
class VerifyReport:
    """What a verify found. ``records`` are the live ones, as in ``status``; forgotten
    records (tombstones the check also reads) are counted apart."""

    records: int = 0
    forgotten: int = 0
    jsonl_lines: int = 0
    markdown_files: int = 0
    problems: list[str] = field(default_factory=list)
    # Keys whose accepted lines verify refuses as evidence: ``rebuild --merge`` adopts
    # none of them (one judgement of the log, this one).
    refused: set[str] = field(default_factory=set)
    history_end: int = 0  # the newest seq the database's history was judged by

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
    """What the log says, by key: its accepted lines, its delivery events, its forgets."""

    accepted: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    events: set[tuple[str, str, str, object]] = field(default_factory=set)
    # key -> (offset of the redacted accepted line, the hash it had before)
    forgotten: dict[str, tuple[int, str]] = field(default_factory=dict)
    # Accepted lines whose content does not give their key: (line number, key, offset, line)
    unmatched: list[tuple[int, str, int, dict[str, Any]]] = field(default_factory=list)
    # (offset, expected hash) of each chain break a ``reanchored`` line accounts for
    anchored: set[tuple[int, str]] = field(default_factory=set)
    lines: int = 0


_OUTCOMES = (MirrorEvent.DELIVERED, MirrorEvent.DEAD, MirrorEvent.DISCARDED, MirrorEvent.DELETED)


def _read_log(jsonl: JsonlLog) -> _LogIndex:
    """Every line once: accepted lines, each delivery event with the id or reason it names,
    and the forgets, whose redacted lines are judged once the whole log is read."""
    index = _LogIndex()
    for number, line in enumerate(jsonl.lines(), start=1):
        index.lines = number
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
                index.unmatched.append((number, key, line.offset, event))
        elif kind in _OUTCOMES:
            detail = event.get("sink_id") if kind == MirrorEvent.DELIVERED else event.get("reason")
            index.events.add((str(kind), key, str(event.get("sink")), detail))
        elif kind == MirrorEvent.REANCHORED and isinstance(event.get("line"), int):
            index.anchored.add((event["line"], str(event.get("expected"))))
        elif kind == MirrorEvent.FORGOTTEN:
            where = event.get("line")
            index.forgotten[key] = (where if isinstance(where, int) else -1, str(event.get("hash")))
    return index


def _check_log(jsonl: JsonlLog, index: _LogIndex, report: VerifyReport) -> None:
    """The chain (through each redacted line's recorded hash), and every accepted line whose
    content does not give its key: only a forget's redaction, at the offset it names, may."""
    redacted = {offset: digest for offset, digest in index.forgotten.values()}
    for problem in jsonl.verify_chain(redacted, index.anchored):
        report.add(problem)
    for number, key, offset, event in index.unmatched:
        if not (
            key in index.forgotten and index.forgotten[key][0] == offset and is_redacted(event)
        ):
            report.refused.add(key)
            report.add(f"{jsonl.path}: line {number}: content or timestamp does not match its key")


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
        if event is None:
            continue  # forgotten before it ever reached this sink: nothing to write

        detail = (
            event.get("sink_id") if row.state == DeliveryState.DELIVERED else event.get("reason")
        )
        if (str(event["event"]), row.key, row.sink, detail) not in index.events:
            report.add(
                f"record {row.key[:12]}: {row.state} for {row.sink} in the database, "
                f"but no matching {event['event']} line in {where}"
            )


def _check_forgotten(item: StoredRecord, index: _LogIndex, report: VerifyReport) -> None:
    """A forgotten record: its log says so, and its file is gone."""
    key = item.record.key
    if key not in index.forgotten:
        report.add(
            f"record {key[:12]}: forgotten in the database, but no forgotten line in the log"
        )
    if item.markdown_name:
        report.add(f"record {key[:12]}: forgotten, but its markdown file is not yet removed")


def _check_markdown(
    item: StoredRecord, rows: list[DeliveryRow], markdown_dir: Path, report: VerifyReport
) -> None:
    key = item.record.key
    try:
        found, body = markdown.read(markdown_dir / item.markdown_name)
    except FileNotFoundError:
        report.add(f"record {key[:12]}: its markdown file is missing from {markdown_dir}")
        return
    except (OSError, markdown.MalformedMarkdown) as exc:
        report.add(f"record {key[:12]}: its markdown file is unreadable ({_why(exc)})")
        return
    report.markdown_files += 1
    if found.get("key") not in (None, key):
        report.add(f"record {key[:12]}: its markdown file carries another key")
        return
    if body != item.record.content.encode("utf-8"):
        report.add(
            f"record {key[:12]}: the body of its markdown file differs from the stored content"
        )
    if matter.judged_by(found, rows):
        expected = matter.up_to_date(found, item.record, rows)
        behind = [name for name, value in expected.items() if found.get(name) != value]
        if behind:
            report.add(
                f"record {key[:12]}: its front matter's {', '.join(behind)} "
                "differ from its deliveries in the database "
                "(`outbox verify --repair` rewrites them)"
            )


def verify(
    storage: Storage,
    jsonl: JsonlLog,
    markdown_dir: Path,
    mirror_id: str,
    history_end: int | None = None,
) -> VerifyReport:
    """Read-only proof: the database's own check, the log's chain, every field the log shares
    with the database (delivery outcomes included), each record's markdown file, no file
    left carrying a forgotten record, and no temp file a killed writer left. ``history_end``:
    the newest ``seq`` the database had given out when its history is judged (default: what
    it holds now)."""
    report = VerifyReport()
    try:
        for problem in storage.integrity_problems():
            report.add(f"database: {problem}")
    except Exception as exc:  # a database too damaged to check is the answer itself
        report.add(
            f"database: {exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )
        return report
    index = _read_log(jsonl)
    report.jsonl_lines = index.lines
    _check_log(jsonl, index, report)
    batch: list[StoredRecord] = []
    newest = 0
    live_names: set[str] = set()
    forgotten: set[str] = set()
    owners: dict[str, str] = {}  # markdown name -> key, to name a stale temp's record
    for item in storage.records.iter_records(origin=mirror_id):
        batch.append(item)
        newest = item.seq
        if item.forgotten:
            forgotten.add(item.record.key)
        else:
            live_names.add(item.markdown_name)
        if item.markdown_name:
            owners[item.markdown_name] = item.record.key
        if len(batch) == 500:
            _check_batch(storage, batch, index, markdown_dir, jsonl.path, report)
            batch = []
    _check_batch(storage, batch, index, markdown_dir, jsonl.path, report)
    report.history_end = newest if history_end is None else history_end
    _check_unheld(index, report.history_end, report)
    for key in files_carrying(markdown_dir, forgotten, skip=live_names):
        report.add(
            f"record {key[:12]}: forgotten, but a markdown file still carries it "
            f"(`outbox forget {key[:12]}` removes it)"
        )
    _check_temps(markdown_dir, owners, report)
    return report


def _check_temps(markdown_dir: Path, owners: dict[str, str], report: VerifyReport) -> None:
    """Temp files of writers killed before their rename: each a whole copy of a file, named
    by its record's key prefix, or only counted (never by its name, which carries words)."""
    counts: dict[str | None, int] = {}
    for temp in markdown.stale_temps(markdown_dir):
        key = owners.get(temp.target)
        counts[key] = counts.get(key, 0) + 1
    for key, count in counts.items():
        what = (
            f"{count} stale temporary file(s) of no record in {markdown_dir}"
            if key is None
            else f"record {key[:12]}: {count} stale temporary file(s) of its markdown file"
        )
        report.add(
            f"{what}, left by a writer killed before its rename "
            "(`outbox verify --repair` removes them)"
        )


def _check_unheld(index: _LogIndex, newest: int, report: VerifyReport) -> None:
    """Accepted lines for records the database does not hold. One written after the
    database's newest record (its ``seq`` is above it: the database is an older copy, or
    was lost) is a record to bring back; one whose ``seq`` the database had already given
    out, or that has none, is not of its history, and nothing adopts it."""
    for key, lines in index.accepted.items():
        seqs = [line.get("seq") for line in lines]
        if all(type(seq) is int and seq > newest for seq in seqs):
            report.add(
                f"{len(lines)} accepted line(s) for {key[:12]}, which the database does not hold"
            )
            continue
        report.refused.add(key)
        report.add(
            f"{len(lines)} accepted line(s) for {key[:12]}, which the database does not hold "
            f"and its history does not explain (a seq at or below its newest, {newest}); "
            "not evidence for `outbox rebuild --merge`"
        )


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
        if item.forgotten:
            report.forgotten += 1
        else:
            report.records += 1
        key = item.record.key
        _check_accepted(item, index.accepted.pop(key, []), report, where)
        _check_events(rows.get(key, []), index, report, where)
        if item.forgotten:
            _check_forgotten(item, index, report)
        else:
            if key in index.forgotten:
                report.add(
                    f"record {key[:12]}: the log has a forgotten line for it, but the database "
                    "holds it live (restored from before the forget? `outbox rebuild --merge` "
                    "finishes the forget)"
                )
            _check_markdown(item, rows.get(key, []), markdown_dir, report)
