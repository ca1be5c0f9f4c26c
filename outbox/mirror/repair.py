"""Bring both mirrors in line with the database after a crash, without ever duplicating.

Runs under the mirror lock, so no live writer is between its commit and its mirror append:
every committed record past the watermark either has its line or was left by a dead writer.
The watermark (last record seq and JSONL offset seen in line) keeps the work proportional to
what was written since the last repair, not to the size of the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from outbox.folders import ensure_private_dir
from outbox.mirror import markdown
from outbox.mirror.jsonl import JsonlLog, accepted_event
from outbox.record import Record
from outbox.store.storage import DEAD, DELIVERED, DISCARDED, PENDING, DeliveryRow, Storage

log = logging.getLogger(__name__)


@dataclass
class RepairReport:
    torn_bytes_cut: int = 0
    lines_appended: int = 0
    files_written: int = 0
    front_matter_updated: int = 0
    problems: list[str] = field(default_factory=list)


def markdown_state(
    record: Record, rows: list[DeliveryRow], intended_brain_store: bool
) -> dict[str, object]:
    """Front matter that reflects the deliveries: chunk id, retries, last failure class."""
    chunk_id = next(
        (row.sink_id for row in rows if row.sink == "brainlayer" and row.state == DELIVERED), None
    )
    failures = [row for row in rows if row.error_class]
    failures.sort(key=lambda row: row.delivered_at or row.available_at)
    matter = markdown.front_matter(
        record,
        intended_brain_store=intended_brain_store,
        reason=failures[-1].error_class if failures else PENDING,
        retry_attempted=any(row.attempts > 1 or row.error_class for row in rows),
        chunk_id=chunk_id,
        sink_states={row.sink: row.state for row in rows},
    )
    ids = {row.sink: row.sink_id for row in rows if row.sink_id}
    if ids:
        matter["sink_ids"] = ids
    return matter


def delivery_updates(
    current: dict[str, object], state: dict[str, object], rows: list[DeliveryRow]
) -> dict[str, object]:
    """The keys a delivery changes in an existing file; the rest (a legacy file's own reason,
    timestamp notation, tags) stays as the file has it."""
    updates = {name: state[name] for name in ("chunk_id", "sinks", "key") if name in state}
    if "sink_ids" in state:
        updates["sink_ids"] = state["sink_ids"]
    # A seed-000 file (no per-sink state yet, not one of our own fallback files) was written
    # because its store failed: delivering it from the queue is the retry it records.
    legacy = "sinks" not in current and not current.get("outbox_fallback")
    updates["retry_attempted"] = (
        bool(current.get("retry_attempted"))
        or bool(state["retry_attempted"])
        or (legacy and any(row.attempts > 0 for row in rows))
    )
    if any(row.error_class for row in rows):
        updates["reason"] = state["reason"]
    return updates


def cut_short(path: Path, record: Record, rows: list[DeliveryRow]) -> bool:
    """Whether ``path`` is a file whose writer died creating it (killed between open and
    write, or power lost before its data reached the disk): a proper prefix of what the
    writer wrote. Nobody else wrote into it, so repair may replace it."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    body = record.content.encode("utf-8")
    if data.endswith(markdown.FENCE + body):  # complete (the usual case): no render needed
        return False
    initial = markdown.render(
        markdown.front_matter(
            record,
            intended_brain_store=any(row.sink == "brainlayer" for row in rows),
            sink_states={row.sink: PENDING for row in rows},
        ),
        body,
    )
    return len(data) < len(initial) and initial.startswith(data)


def delivery_event(row: DeliveryRow) -> dict[str, object] | None:
    if row.state == DELIVERED:
        return {
            "event": "delivered",
            "key": row.key,
            "sink": row.sink,
            "sink_id": row.sink_id,
            "attempts": row.attempts,
        }
    if row.state == DEAD:
        return {
            "event": "dead",
            "key": row.key,
            "sink": row.sink,
            "reason": row.error_class,
            "attempts": row.attempts,
        }
    if row.state == DISCARDED:
        return {"event": "discarded", "key": row.key, "sink": row.sink}
    return None


class MirrorSync:
    """Incremental repair of the JSONL log and the markdown folder for one machine."""

    def __init__(
        self, storage: Storage, jsonl: JsonlLog, markdown_dir: Path, mirror_id: str
    ) -> None:
        self.storage = storage
        self.jsonl = jsonl
        self.markdown_dir = markdown_dir
        self.mirror_id = mirror_id

    def run(self, full: bool = False) -> RepairReport:
        """Caller holds the mirror lock. ``full`` rescans every record and the whole log
        (``outbox verify --repair``), e.g. for a markdown file deleted long after its write."""
        report = RepairReport()
        before = self.jsonl.size()
        size = self.jsonl.repair_tail()
        report.torn_bytes_cut = before - size
        seq, offset, remembered = self.storage.mirror_watermark(self.mirror_id)
        if full or not self.jsonl.continues_at(offset, remembered):
            # The log lost its tail (power loss) or was replaced, maybe written to since:
            # reading on from the old offset would miss lines, so rescan it all.
            seq, offset = 0, 0
        accepted: set[str] = set()
        events: set[tuple[str, str, str]] = set()
        for line in self.jsonl.lines(offset):
            event = line.event
            if event.get("event") == "accepted":
                accepted.add(str(event.get("key")))
            elif event.get("event"):
                events.add((str(event["event"]), str(event.get("key")), str(event.get("sink"))))
        last_seq = seq
        while True:
            batch = self.storage.records_after(self.mirror_id, last_seq)
            if not batch:
                break
            deliveries = self.storage.deliveries_for(item.record.key for item in batch)
            missing = [item for item in batch if item.record.key not in accepted]
            if missing:
                self.jsonl.append(
                    [
                        accepted_event(
                            item.record,
                            item.seq,
                            item.markdown_name,
                            [row.sink for row in deliveries.get(item.record.key, [])],
                        )
                        for item in missing
                    ]
                )
                report.lines_appended += len(missing)
            ensure_private_dir(self.markdown_dir)
            for item in batch:
                path = self.markdown_dir / item.markdown_name
                rows = deliveries.get(item.record.key, [])
                torn = cut_short(path, item.record, rows)
                if not torn and path.exists():
                    continue
                matter = markdown_state(
                    item.record, rows, any(row.sink == "brainlayer" for row in rows)
                )
                data = markdown.render(matter, item.record.content)
                if torn:
                    markdown.write_atomic(path, data, durable=False)
                elif not markdown.write_new(path, data):
                    continue
                report.files_written += 1
            last_seq = batch[-1].seq
        self.sync_deliveries(events, report)
        size, last_line = self.jsonl.end()
        if (last_seq, size, last_line) != (seq, offset, remembered):  # no write when idle
            self.storage.set_mirror_watermark(self.mirror_id, last_seq, size, last_line)
        return report

    def sync_deliveries(
        self, seen: set[tuple[str, str, str]] | None = None, report: RepairReport | None = None
    ) -> RepairReport:
        """Mirror outcomes the dispatcher committed but has not yet written out.

        ``seen`` holds events already in the log (repair after a crash); the dispatcher's
        own call right after settling passes None.
        """
        report = report or RepairReport()
        while True:
            rows = self.storage.mirror_pending(self.mirror_id)
            if not rows:
                return report
            self.apply(rows, seen, report)

    def apply(
        self,
        rows: list[DeliveryRow],
        seen: set[tuple[str, str, str]] | None,
        report: RepairReport,
    ) -> None:
        """Write events and front matter for ``rows``, then clear their pending flag."""
        lines = []
        for row in rows:
            event = delivery_event(row)
            if event is None:
                continue
            marker = (str(event["event"]), row.key, row.sink)
            if seen is not None and marker in seen:
                continue
            lines.append(event)
        self.jsonl.append(lines)
        report.lines_appended += len(lines)
        keys = sorted({row.key for row in rows})
        stored = self.storage.get_records(keys)
        all_rows = self.storage.deliveries_for(keys)
        for key in keys:
            item = stored.get(key)
            if item is None:
                continue
            path = self.markdown_dir / item.markdown_name
            record_rows = all_rows.get(key, [])
            matter = markdown_state(
                item.record, record_rows, any(row.sink == "brainlayer" for row in record_rows)
            )
            try:
                current, body = markdown.read(path)
            except FileNotFoundError:
                ensure_private_dir(self.markdown_dir)
                markdown.write_new(path, markdown.render(matter, item.record.content))
                report.files_written += 1
                continue
            except markdown.MalformedMarkdown as exc:
                report.problems.append(f"{path}: {exc}; left as it is")
                continue
            owner = current.get("key")
            if owner and owner != key:  # never write one record's state into another's file
                report.problems.append(f"{path}: carries another key; left as it is")
                continue
            merged = {**current, **delivery_updates(current, matter, record_rows)}
            if merged != current:
                markdown.write_atomic(path, markdown.render(merged, body), durable=False)
                report.front_matter_updated += 1
        self.storage.clear_mirror_pending([row.delivery_id for row in rows])
