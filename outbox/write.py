"""The durable write: one transaction for record, graph node, edge and outbox rows, then mirrors.

This module imports no sink, no model and no chromadb: a write can never wait on them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection

from outbox.mirror import markdown
from outbox.mirror.jsonl import JsonlLog, accepted_event
from outbox.mirror.lock import MirrorLock
from outbox.receipt import QUEUED, STORED, Receipt
from outbox.record import Record
from outbox.slugs import markdown_filename
from outbox.store.storage import DELIVERED, Storage
from outbox.store.wakeup import notify

log = logging.getLogger(__name__)

# Beyond the busy timeout, what a write may take for its own statements and mirrors.
WRITE_MARGIN_SECONDS = 0.5


@dataclass(frozen=True)
class Accepted:
    """A record the transaction took (seq set) or found already there (duplicate)."""

    record: Record
    seq: int | None
    markdown_name: str
    duplicate: bool


class Writer:
    """Commits records and writes their mirrors under the mirror lock."""

    def __init__(
        self,
        storage: Storage,
        *,
        sinks: Sequence[str],
        jsonl: JsonlLog,
        lock: MirrorLock,
        markdown_dir: Path,
        origin: str,
        busy_timeout: float,
    ) -> None:
        self.storage = storage
        self.sinks = tuple(sinks)
        self.jsonl = jsonl
        self.lock = lock
        self.markdown_dir = markdown_dir
        self.origin = origin
        self.busy_timeout = busy_timeout

    # -- naming ---------------------------------------------------------------------------

    def _file_owner(self, path: Path) -> str | None:
        """The key in an existing markdown file's front matter ("" when unreadable)."""
        try:
            matter, _ = markdown.read(path)
        except FileNotFoundError:
            return None
        except (OSError, markdown.MalformedMarkdown):
            return ""
        return str(matter.get("key") or "")

    def _taken_on_disk(self, name: str, key: str) -> bool:
        """A file of that name exists and is not this record's (a legacy or foreign file)."""
        path = self.markdown_dir / name
        return path.exists() and self._file_owner(path) != key

    # -- the transaction ------------------------------------------------------------------

    def insert(
        self, conn: Connection, record: Record, now: float, adopt: str | None = None
    ) -> Accepted:
        """Insert inside ``conn``'s transaction; a known key writes nothing.

        ``adopt`` names an existing markdown file (a fallback or legacy file) that becomes
        the record's mirror instead of a new one.
        """
        name = adopt or markdown_filename(record.timestamp, record.slug)
        exists, taken = self.storage.lookup(conn, record.key, name)
        if exists:
            existing = self.storage.get_record(record.key, conn)
            assert existing is not None
            return Accepted(existing.record, None, existing.markdown_name, True)
        if not adopt and (taken or self._taken_on_disk(name, record.key)):
            # The contract's rule: never overwrite another key's file; add -<key8>.
            name = markdown_filename(record.timestamp, record.slug, collision_key=record.key)
        seq = self.storage.insert_record(
            conn, record, sinks=self.sinks, markdown_name=name, origin=self.origin, now=now
        )
        if seq is None:  # lost a race with a writer that does not hold our mirror lock
            existing = self.storage.get_record(record.key, conn)
            assert existing is not None
            return Accepted(existing.record, None, existing.markdown_name, True)
        return Accepted(record, seq, name, False)

    def commit(
        self, records: Sequence[Record], adopted: dict[str, str] | None = None
    ) -> list[Accepted]:
        """One transaction for all ``records``, then their mirrors, all under the mirror lock.

        ``adopted`` maps keys to existing markdown files that become their mirrors.
        """
        adopted = adopted or {}
        deadline = time.monotonic() + self.busy_timeout + WRITE_MARGIN_SECONDS
        with self.lock.hold(deadline):
            now = time.time()
            with self.storage.engine.begin() as conn:
                accepted = [
                    self.insert(conn, record, now, adopted.get(record.key)) for record in records
                ]
                notify(conn)
            self.write_mirrors(
                [item for item in accepted if not item.duplicate],
                skip_markdown={key for key in adopted},
            )
        return accepted

    # -- mirrors --------------------------------------------------------------------------

    def render_markdown(self, record: Record, states: dict[str, str] | None = None) -> bytes:
        matter = markdown.front_matter(
            record,
            intended_brain_store="brainlayer" in self.sinks,
            sink_states=states or dict.fromkeys(self.sinks, "pending"),
        )
        return markdown.render(matter, record.content)

    def write_mirrors(
        self, accepted: Sequence[Accepted], skip_markdown: set[str] | None = None
    ) -> None:
        """Append accepted lines and create markdown files; a failure here loses nothing,
        since the database holds the record and repair rewrites the mirror."""
        if not accepted:
            return
        try:
            self.jsonl.append(
                [
                    accepted_event(item.record, item.seq or 0, item.markdown_name, list(self.sinks))
                    for item in accepted
                ]
            )
        except OSError as exc:
            log.warning("JSONL mirror append failed (%s); repair will restore it", exc.strerror)
        try:
            markdown.ensure_dir(self.markdown_dir)
            for item in accepted:
                if skip_markdown and item.record.key in skip_markdown:
                    continue
                markdown.write_new(
                    self.markdown_dir / item.markdown_name, self.render_markdown(item.record)
                )
        except OSError as exc:
            log.warning("markdown mirror write failed (%s); repair will restore it", exc.strerror)

    # -- receipts -------------------------------------------------------------------------

    def receipt(self, item: Accepted) -> Receipt:
        sink_ids: dict[str, str] = {}
        if item.duplicate:
            try:
                rows = self.storage.deliveries_for([item.record.key]).get(item.record.key, [])
            except Exception:  # the write itself stands; only the extra detail is missing
                rows = []
            sink_ids = {
                row.sink: row.sink_id for row in rows if row.state == DELIVERED and row.sink_id
            }
        all_stored = bool(self.sinks) and all(sink in sink_ids for sink in self.sinks)
        return Receipt(
            key=item.record.key,
            status=STORED if all_stored else QUEUED,
            duplicate=item.duplicate,
            markdown_path=self.markdown_dir / item.markdown_name,
            timestamp=item.record.timestamp,
            sinks=self.sinks,
            sink_ids=sink_ids,
        )
