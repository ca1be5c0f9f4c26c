"""Bring both mirrors in line with the database after a crash, without ever duplicating.

Runs under the mirror lock, so no live writer is between its commit and its mirror append:
every committed record past the watermark either has its line or was left by a dead writer.
The watermark (last record seq and JSONL offset seen in line) keeps the work proportional to
what was written since the last repair, not to the size of the log.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from outbox.core.errors import RecordFileError, about_record
from outbox.core.folders import ensure_private_dir
from outbox.core.naming import key_prefix
from outbox.core.record import Record
from outbox.core.states import DeliveryOp, DeliveryState, MirrorEvent
from outbox.mirror import markdown, matter
from outbox.mirror.chain import reanchor
from outbox.mirror.forget import Redactor
from outbox.mirror.jsonl import JsonlLog, accepted_event
from outbox.store.deliveries import DeliveryRow
from outbox.store.rows import StoredRecord
from outbox.store.steady import log_owed
from outbox.store.storage import Storage

log = logging.getLogger(__name__)

MIRROR_BATCH = 1000  # outcomes read and mirrored at a time


class Restored(StrEnum):
    """What a repair put back for a record, so ``verify --repair`` can say what it did."""

    MISSING_FILE = "missing markdown files"
    CUT_SHORT_FILE = "markdown files cut short"
    EDITED_BODY = "edited markdown bodies"
    STALE_FRONT_MATTER = "markdown front matter behind the deliveries"
    MISSING_LINE = "missing JSONL lines"


@dataclass
class RepairReport:
    torn_bytes_cut: int = 0
    lines_appended: int = 0
    files_written: int = 0
    front_matter_updated: int = 0
    forgets_finished: int = 0
    reanchored: int = 0
    temps_removed: int = 0  # temp files of writers killed before their rename (``full``)
    problems: list[str] = field(default_factory=list)
    # Per kind, the keys of the records whose mirrors were put back (delivery outcomes
    # mirrored on their usual way are counted above, not listed).
    restored: dict[Restored, list[str]] = field(default_factory=dict)

    def put_back(self, what: Restored, key: str) -> None:
        self.restored.setdefault(what, []).append(key)


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
    initial = markdown.render(matter.initial(record, [row.sink for row in rows]), body)
    return len(data) < len(initial) and initial.startswith(data)


def restore_body(path: Path, record: Record) -> bool:
    """Give an existing file the record's content back under its own front matter; returns
    whether it had to (a file that cannot be parsed is left to the caller's report)."""
    try:
        current, body = markdown.read(path)
    except (OSError, markdown.MalformedMarkdown):
        return False
    content = record.content.encode("utf-8")
    if body == content or current.get("key") not in (None, record.key):
        return False
    markdown.write_atomic(path, markdown.render(current, content), durable=False)
    return True


_EVENTS = {
    DeliveryState.DELIVERED: MirrorEvent.DELIVERED,
    DeliveryState.DEAD: MirrorEvent.DEAD,
    DeliveryState.DISCARDED: MirrorEvent.DISCARDED,
    DeliveryState.FORGOTTEN: MirrorEvent.DELETED,
}


def delivery_event(row: DeliveryRow) -> dict[str, object] | None:
    """The JSONL line a settled delivery (or a forget's delete) gets; None for a row still
    on its way, and for a forgotten record's sink that was never sent it."""
    event = _EVENTS.get(DeliveryState(row.state))
    if event is None or (event == MirrorEvent.DELETED and row.attempts == 0):
        return None
    line: dict[str, object] = {"event": event.value, "key": row.key, "sink": row.sink}
    if event == MirrorEvent.DELIVERED:
        line.update(sink_id=row.sink_id, attempts=row.attempts)
    elif event == MirrorEvent.DEAD:
        line.update(reason=row.error_class, attempts=row.attempts)
        if row.op == DeliveryOp.DELETE:
            line.update(op=DeliveryOp.DELETE.value)
    return line


class MirrorSync:
    """Incremental repair of the JSONL log and the markdown folder for one machine."""

    def __init__(
        self, storage: Storage, jsonl: JsonlLog, markdown_dir: Path, mirror_id: str
    ) -> None:
        self.storage = storage
        self.jsonl = jsonl
        self.markdown_dir = markdown_dir
        self._folder = str(markdown_dir)
        self.mirror_id = mirror_id

    def run(self, full: bool = False) -> RepairReport:
        """Caller holds the mirror lock. ``full`` rescans every record and the whole log
        (``outbox verify --repair``), e.g. for a markdown file deleted long after its write,
        and removes the temp files of writers killed before their rename."""
        report = RepairReport()
        before = self.jsonl.size()
        size = self.jsonl.repair_tail()
        report.torn_bytes_cut = before - size
        mark = self.storage.mirror_state.mirror_watermark(self.mirror_id)
        seq, offset, remembered = mark
        # A torn tail was cut, or the log lost its tail (power loss) or was replaced, maybe
        # written to since: lines may be gone whose database flags were already cleared, so
        # rescan it all, and put back the outcome lines it lost too (``steady.log_owed``:
        # the direct write's check asks the same).
        owed = log_owed(
            mark,
            torn=report.torn_bytes_cut > 0,
            continues=self.jsonl.continues_at(offset, remembered),
        )
        rescan = full or owed is not None
        if rescan:
            seq, offset = 0, 0
        accepted: set[str] = set()
        events: set[tuple[str, str, str]] = set()
        for line in self.jsonl.lines(offset):
            event = line.event
            if event.get("event") == MirrorEvent.ACCEPTED:
                accepted.add(str(event.get("key")))
            elif event.get("event"):
                events.add((str(event["event"]), str(event.get("key")), str(event.get("sink"))))
        last_seq = seq
        while batch := self.storage.records.records_after(self.mirror_id, last_seq):
            self._catch_up(batch, accepted, report, full=full)
            if rescan:
                self._restore_events(batch, events, report)
            last_seq = batch[-1].seq
        self.sync_deliveries(events, report)
        report.forgets_finished = Redactor(
            self.storage, self.jsonl, self.markdown_dir, self.mirror_id
        ).run()
        if full:  # an operator's repair: breaks in the middle are recorded, never rewritten
            report.reanchored = reanchor(self.jsonl)
            # and the folder is read whole, for temp copies a killed writer left
            report.temps_removed = markdown.remove_stale_temps(self.markdown_dir)
        size, last_line = self.jsonl.end()
        if (last_seq, size, last_line) != (seq, offset, remembered):  # no write when idle
            self.storage.mirror_state.set_mirror_watermark(
                self.mirror_id, last_seq, size, last_line
            )
        return report

    def _restore_events(
        self, batch: list[StoredRecord], seen: set[tuple[str, str, str]], report: RepairReport
    ) -> None:
        """Append the outcome lines the log lost (a cut tail, an edit): the database says
        each delivery's state, and a repair adds the missing line rather than rewrite any."""
        rows = self.storage.deliveries.deliveries_for(item.record.key for item in batch)
        lines = []
        for row in (row for group in rows.values() for row in group):
            event = delivery_event(row)
            if event is None or row.mirror_pending:
                continue  # still on its way: the delivery sync writes it
            marker = (str(event["event"]), row.key, row.sink)
            if marker not in seen:
                lines.append(event)
                seen.add(marker)
                report.put_back(Restored.MISSING_LINE, row.key)
        self.jsonl.append(lines)
        report.lines_appended += len(lines)

    def _catch_up(
        self, batch: list[StoredRecord], accepted: set[str], report: RepairReport, full: bool
    ) -> None:
        """Append the accepted lines ``batch`` lacks, and write its missing or torn files
        (``full``: also restore a body edited since, from the database)."""
        batch = [item for item in batch if not item.forgotten]  # the Redactor's to finish
        deliveries = self.storage.deliveries.deliveries_for(item.record.key for item in batch)
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
            for item in missing:
                report.put_back(Restored.MISSING_LINE, item.record.key)
        ensure_private_dir(self.markdown_dir)
        for item in batch:
            with about_record(item.record.key, "write"):
                self._restore_file(item, deliveries.get(item.record.key, []), report, full)

    def _restore_file(
        self, item: StoredRecord, rows: list[DeliveryRow], report: RepairReport, full: bool
    ) -> None:
        """Write ``item``'s file if it is missing or cut short (``full``: restore an edited
        body too, and front matter behind its settled deliveries, which a power cut after
        an in-place rewrite can leave)."""
        path = self.markdown_dir / item.markdown_name
        torn = cut_short(path, item.record, rows)
        if not torn and path.exists():
            if full and restore_body(path, item.record):
                report.files_written += 1
                report.put_back(Restored.EDITED_BODY, item.record.key)
            if full:
                self._update_file(item, rows, report, judged=True)
            return
        data = markdown.render(matter.delivered(item.record, rows), item.record.content)
        if torn:
            markdown.write_atomic(path, data, durable=False)
        elif not markdown.write_new(path, data):
            return
        report.files_written += 1
        report.put_back(Restored.CUT_SHORT_FILE if torn else Restored.MISSING_FILE, item.record.key)

    def sync_deliveries(
        self,
        seen: set[tuple[str, str, str]] | None = None,
        report: RepairReport | None = None,
        *,
        known: Mapping[str, StoredRecord] | None = None,
    ) -> RepairReport:
        """Mirror outcomes the dispatcher committed but has not yet written out.

        ``seen`` holds events already in the log (repair after a crash); the dispatcher's
        own call right after settling passes None, and ``known``, the records of the batch
        it settled: unchanged since (content and name are fixed; a forget is looked up
        again), so they are not read twice. Pages follow a cursor, so a record whose file
        refuses is tried once a sync, and however many refuse, every other outcome is
        written; the first refusal is raised at the end.
        """
        report = report or RepairReport()
        after = 0  # the page cursor: outcomes a file refused stay owed behind it
        refused: dict[str, RecordFileError] = {}  # tried once this sync, by record key
        while True:
            rows, all_rows = self.storage.mirror_state.owed(self.mirror_id, MIRROR_BATCH, after)
            page = sorted(row.delivery_id for row in rows if row.delivery_id > after)
            fresh = [row for row in rows if row.key not in refused]
            if fresh:
                refused.update(self.apply(fresh, all_rows, seen, report, known))
            if len(page) < MIRROR_BATCH:  # a short page was the last: no empty query after it
                break
            after = page[MIRROR_BATCH - 1]
        if refused:
            if len(refused) > 1:
                log.warning("%d records' files could not take their outcomes", len(refused))
            raise next(iter(refused.values()))
        return report

    def apply(
        self,
        rows: list[DeliveryRow],
        all_rows: Mapping[str, list[DeliveryRow]],
        seen: set[tuple[str, str, str]] | None,
        report: RepairReport,
        known: Mapping[str, StoredRecord] | None = None,
    ) -> dict[str, RecordFileError]:
        """Write front matter, then events, for ``rows`` (``all_rows``: every delivery of
        their records, read with them), then clear their pending flag; returns the records
        whose file refused, each with its error.

        A record whose file cannot be written (a link in its place, a full disk) keeps its
        outcomes owed, without their lines, while the others are written and cleared: one
        bad file does not hold every later outcome back, and the next sync writes its lines
        once, when its file takes the update. A crash
        between the files and the lines leaves the rows owed; their files are then already
        up to date and only the lines are written.
        """
        keys = sorted({row.key for row in rows})
        stored = {key: known[key] for key in keys if key in known} if known else {}
        if len(stored) < len(keys):
            stored.update(self.storage.records.get_records(k for k in keys if k not in stored))
        failed: dict[str, RecordFileError] = {}
        for key in keys:
            item = stored.get(key)
            if item is None or item.forgotten:  # a forgotten record has no file to update
                continue
            try:
                with about_record(key, "update"):
                    self._update_file(item, all_rows.get(key, []), report)
            except RecordFileError as exc:
                failed[key] = exc
        done = [row for row in rows if row.key not in failed]
        lines = []
        for row in done:
            event = delivery_event(row)
            if event is None:
                continue
            marker = (str(event["event"]), row.key, row.sink)
            if seen is not None and marker in seen:
                continue
            lines.append(event)
        self.jsonl.append(lines)
        report.lines_appended += len(lines)
        self.storage.mirror_state.clear_mirror_pending(done)
        return failed

    def _update_file(
        self,
        item: StoredRecord,
        record_rows: list[DeliveryRow],
        report: RepairReport,
        *,
        judged: bool = False,
    ) -> None:
        """Bring ``item``'s front matter in line with its delivery rows (and its body with
        the database); a missing file is written whole. ``judged``: only where the rows
        say all the front matter follows (``matter.judged_by``), as a full repair asks."""
        key = item.record.key
        path = os.path.join(self._folder, item.markdown_name)  # pathlib's join cost more
        try:
            opened = markdown.Opened(path)
        except FileNotFoundError:
            # Read again: a record the caller knew may have been forgotten since, and a
            # forget's deleted file must not come back.
            fresh = self.storage.records.get_records([key]).get(key)
            if fresh is None or fresh.forgotten:
                return
            ensure_private_dir(self.markdown_dir)
            state = matter.delivered(item.record, record_rows)
            markdown.write_new(path, markdown.render(state, item.record.content))
            report.files_written += 1
            report.put_back(Restored.MISSING_FILE, key)
            return
        except markdown.MalformedMarkdown as exc:
            report.problems.append(
                f"record {key_prefix(key)}: its markdown file: {exc}; left as it is"
            )
            return
        with opened:
            self._update_opened(opened, item, record_rows, report, judged=judged)

    def _update_opened(
        self,
        opened: markdown.Opened,
        item: StoredRecord,
        record_rows: list[DeliveryRow],
        report: RepairReport,
        *,
        judged: bool,
    ) -> None:
        """``_update_file``'s work on the file it opened: rewritten through the same
        descriptor when its front matter or body is behind the database."""
        key, current, body = item.record.key, opened.matter, opened.body
        owner = current.get("key")
        if owner and owner != key:  # never write one record's state into another's file
            fresh = self.storage.records.get_records([key]).get(key)
            if fresh is not None and fresh.markdown_name != item.markdown_name:
                # Read before the mirror writer moved it off a name a fallback file took.
                self._update_file(fresh, record_rows, report, judged=judged)
                return
            report.problems.append(
                f"record {key_prefix(key)}: its markdown file carries another key; left as it is"
            )
            return
        if judged and not matter.judged_by(current, record_rows):
            return
        merged = matter.up_to_date(current, item.record, record_rows)
        content = item.record.content.encode("utf-8")
        if merged != current or body != content:
            # A body that differs (a writer cut off mid-file, an edit) is restored from the
            # database first: new front matter never seals a wrong body in.
            opened.overwrite(markdown.render(merged, b""), content)
            report.front_matter_updated += 1
            if judged and merged != current:
                report.put_back(Restored.STALE_FRONT_MATTER, key)
            if body != content:
                report.files_written += 1
                report.put_back(Restored.EDITED_BODY, key)
