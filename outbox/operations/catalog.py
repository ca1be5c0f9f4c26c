"""The records as a reader sees them: one found by a key prefix, shown whole, or all of them
exported for another tool.

``Outbox.catalog`` hands this out, so the command line and memory-core never reach into the
store for it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from outbox.core.errors import OutboxError, ValidationError, about_record
from outbox.core.folders import ensure_private_dir
from outbox.mirror import markdown, matter
from outbox.mirror.jsonl import accepted_event
from outbox.mirror.log_lines import lines_naming

if TYPE_CHECKING:
    from outbox.core.config import Settings
    from outbox.mirror.mirrors import Mirrors
    from outbox.store.rows import StoredRecord
    from outbox.store.storage import Storage

_HEX = re.compile(r"[0-9a-f]{1,64}")
EXPORT_FORMATS = ("jsonl", "markdown")


class NoSuchRecord(OutboxError):
    """No record has a key starting with the prefix given."""


@dataclass(frozen=True)
class RecordView:
    """One record with its state in each sink and where its audit copies are."""

    record: StoredRecord
    sinks: list[dict[str, Any]]
    markdown_path: Path
    jsonl_lines: list[int]

    def to_dict(self) -> dict[str, Any]:
        shown = _portable(self.record)
        del shown["event"]
        return {
            **shown,
            "forgotten_at": self.record.forgotten_at,
            "sinks": self.sinks,
            "markdown_path": str(self.markdown_path) if not self.record.forgotten else None,
            "jsonl_lines": self.jsonl_lines,
        }


class Catalog:
    """Reads of whole records for people and other tools."""

    def __init__(self, storage: Storage, mirrors: Mirrors, settings: Settings) -> None:
        self.storage = storage
        self.mirrors = mirrors
        self.settings = settings

    def resolve(self, prefix: str) -> str:
        """The one key that starts with ``prefix``; an ambiguous prefix is an error naming
        the candidates, an unknown one ``NoSuchRecord``."""
        wanted = prefix.strip().lower()
        if not _HEX.fullmatch(wanted):
            raise ValidationError("key", "must be 1 to 64 hex digits (a key or its prefix)")
        found = self.storage.records.keys_with_prefix(wanted, limit=6)
        if not found:
            raise NoSuchRecord(f"no record with a key starting {wanted}")
        if len(found) > 1:
            shown = ", ".join(key[:16] for key in found[:5]) + (", …" if len(found) > 5 else "")
            raise ValidationError("key", f"prefix {wanted} matches several records: {shown}")
        return found[0]

    def show(self, prefix: str) -> RecordView:
        """The record, each sink's state, its markdown file and its lines in the log."""
        key = self.resolve(prefix)
        stored = self.storage.records.get_record(key)
        if stored is None:  # forgotten between the two reads
            raise NoSuchRecord(f"no record with a key starting {prefix}")
        rows = self.storage.deliveries.deliveries_for([key]).get(key, [])
        sinks = [
            {
                "sink": row.sink,
                "state": row.state,
                "attempts": row.attempts,
                "sink_id": row.sink_id,
                "reason": row.error_class,
            }
            for row in rows
        ]
        lines = [line.number for line in lines_naming(self.mirrors.jsonl.path, key)]
        path = self.mirrors.path(stored.markdown_name).absolute()
        return RecordView(stored, sinks, path, lines)

    def export_jsonl(self, out: IO[str], progress: Callable[[int], None] | None = None) -> int:
        """Every record as one JSON object a line (the log's accepted lines, without the
        chain); returns how many."""
        count = 0
        for count, item in enumerate(self._records(), start=1):
            out.write(json.dumps(_portable(item), ensure_ascii=False) + "\n")
            if progress and count % 1000 == 0:
                progress(count)
        return count

    def export_markdown(self, folder: Path, progress: Callable[[int], None] | None = None) -> int:
        """Every record as a markdown file in ``folder`` (a new or empty one), named and
        shaped like the mirror's; returns how many."""
        if folder.exists() and any(folder.iterdir()):
            raise ValidationError("DEST", f"{folder} is not empty; export into a new folder")
        ensure_private_dir(folder)
        count = 0
        for count, item in enumerate(self._records(), start=1):
            name = Path(item.markdown_name).name
            data = markdown.render(matter.initial(item.record, []), item.record.content)
            with about_record(item.record.key, "export"):
                if not markdown.write_new(folder / name, data):
                    markdown.write_new(folder / f"{item.record.key}.md", data)
            if progress and count % 1000 == 0:
                progress(count)
        return count

    def _records(self) -> Iterator[StoredRecord]:
        """Every record still remembered: a forgotten one has nothing left to export."""
        return (item for item in self.storage.records.iter_records() if not item.forgotten)


# The accepted line's fields another tool needs: not the log's own (seq, files, sinks).
_PORTABLE = ("event", "key", "timestamp", "content", "importance", "tags", "metadata")


def _portable(item: StoredRecord) -> dict[str, Any]:
    line = accepted_event(item.record, item.seq, item.markdown_name, [])
    return {name: line[name] for name in _PORTABLE}
