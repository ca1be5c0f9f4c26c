"""The durable write: one transaction for record, graph node, edge and outbox rows, then mirrors.

This module imports no sink, no model and no chromadb: a write can never wait on them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from sqlalchemy import Connection

from outbox.group_commit import GroupCommit
from outbox.mirror.mirrors import Mirrors
from outbox.receipt import Receipt
from outbox.record import Record
from outbox.slugs import markdown_filename
from outbox.states import DeliveryState, ReceiptStatus
from outbox.store.bounded import call_within
from outbox.store.storage import Storage
from outbox.store.wakeup import notify

log = logging.getLogger(__name__)

# Beyond the busy timeout, what a write may take for its own statements and mirrors.
WRITE_MARGIN_SECONDS = 0.5
# How far past its bound a write may go before its database wait is shortened to fit.
BOUND_TOLERANCE_SECONDS = 0.05


@dataclass(frozen=True)
class Accepted:
    """A record the transaction took (seq set) or found already there (duplicate)."""

    record: Record
    seq: int | None
    markdown_name: str
    duplicate: bool


class Writer:
    """Commits records and writes their mirrors under the mirror lock.

    Concurrent callers in one process share a transaction (group commit): while one
    transaction commits, the callers that arrive queue up, and the next one to lead commits
    all of them at once, so they pay one fsync between them instead of one each.
    """

    def __init__(
        self,
        storage: Storage,
        mirrors: Mirrors,
        *,
        sinks: Sequence[str],
        origin: str,
        busy_timeout: float,
    ) -> None:
        self.storage = storage
        self.mirrors = mirrors
        self.sinks = tuple(sinks)
        self.origin = origin
        self.busy_timeout = busy_timeout
        self.queue: GroupCommit[Accepted] = GroupCommit(self._transact_group)
        self._connection: Connection | None = None

    # -- the transaction ------------------------------------------------------------------

    def insert(
        self, conn: Connection, record: Record, now: float, adopt: str | None = None
    ) -> Accepted:
        """Insert inside ``conn``'s transaction; a known key writes nothing.

        ``adopt`` names an existing markdown file (a fallback or legacy file) that becomes
        the record's mirror instead of a new one.
        """
        name = adopt or markdown_filename(record.timestamp, record.slug)
        exists, taken = self.storage.records.lookup(conn, record.key, name)
        if exists:
            existing = self.storage.records.get_record(record.key, conn)
            assert existing is not None
            return Accepted(existing.record, None, existing.markdown_name, True)
        if not adopt and (taken or self.mirrors.taken_on_disk(name, record.key)):
            # Never overwrite another key's file: the record's name gets -<key8>.
            name = markdown_filename(record.timestamp, record.slug, collision_key=record.key)
        seq = self.storage.records.insert_record(
            conn, record, sinks=self.sinks, markdown_name=name, origin=self.origin, now=now
        )
        if seq is None:  # lost a race with a writer that does not hold our mirror lock
            existing = self.storage.records.get_record(record.key, conn)
            assert existing is not None
            return Accepted(existing.record, None, existing.markdown_name, True)
        return Accepted(record, seq, name, False)

    def commit(
        self, records: Sequence[Record], adopted: dict[str, str] | None = None
    ) -> list[Accepted]:
        """Commit ``records`` in one transaction, then write their mirrors; returns one
        Accepted per record, in order.

        ``adopted`` maps keys to existing markdown files that become their mirrors (replay);
        such a call commits alone. Otherwise the records may share a transaction with other
        threads' records: all of them commit, or none (each caller then falls back).
        """
        deadline = time.monotonic() + self.busy_timeout + WRITE_MARGIN_SECONDS
        if adopted:
            return self._transact(records, adopted, deadline)
        return self.queue.submit(records, deadline)

    def _transact_group(self, records: Sequence[Record], deadline: float) -> list[Accepted]:
        return self._transact(records, {}, deadline)

    def _transact(
        self, records: Sequence[Record], adopted: dict[str, str], deadline: float
    ) -> list[Accepted]:
        """The transaction and the mirrors, all under the mirror lock; on PostgreSQL cut off
        at ``deadline`` if the server stops answering (``store/bounded.py``)."""
        if self.storage.dialect == "sqlite":
            return self._transact_here(records, adopted, deadline)
        return call_within(
            # A group that queued to the edge of its bound still gets a moment to commit.
            max(deadline - time.monotonic(), BOUND_TOLERANCE_SECONDS),
            lambda: self._transact_here(records, adopted, deadline),
            "write",
        )

    def _transact_here(
        self, records: Sequence[Record], adopted: dict[str, str], deadline: float
    ) -> list[Accepted]:
        with self.mirrors.hold(deadline):
            now = time.time()
            with self._transaction(deadline) as conn:
                accepted = [
                    self.insert(conn, record, now, adopted.get(record.key)) for record in records
                ]
                notify(conn)
            mirrored = iter(
                self.write_mirrors(
                    [item for item in accepted if not item.duplicate],
                    skip_markdown=set(adopted),
                )
            )
        return [item if item.duplicate else next(mirrored) for item in accepted]

    @contextlib.contextmanager
    def _transaction(self, deadline: float) -> Iterator[Connection]:
        """A transaction whose wait for the database lock ends by ``deadline`` (less the
        margin for statements and mirrors), whatever waiting for the mirror lock used.

        SQLite runs it on the writer's own connection, kept between writes, which saves a pool
        checkout and return per write. Only the thread holding the mirror lock uses
        it; one that saw an error is dropped and the next write opens another. PostgreSQL
        keeps the pool, whose pre-ping notices a restarted server.
        """
        budget = deadline - time.monotonic() - WRITE_MARGIN_SECONDS
        # Only when waiting used a noticeable part of the bound: two extra statements a write.
        shortened = budget < self.busy_timeout - BOUND_TOLERANCE_SECONDS
        if self.storage.dialect != "sqlite":
            with self.storage.engine.begin() as conn:
                if shortened:  # 0 would mean "wait forever" here
                    timeout_ms = max(1, int(budget * 1000))
                    conn.exec_driver_sql(f"SET LOCAL lock_timeout = {timeout_ms}")
                yield conn
            return
        if self._connection is None:
            self._connection = self.storage.engine.connect()
        conn = self._connection
        try:
            driver = conn.connection.driver_connection
            assert driver is not None
            if shortened:
                driver.execute(f"PRAGMA busy_timeout = {max(0, int(budget * 1000))}")
            with conn.begin():
                yield conn
            if shortened:
                driver.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Give the writer's connection back (before the engine is disposed)."""
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
            self._connection = None

    # -- mirrors --------------------------------------------------------------------------

    def write_mirrors(
        self, accepted: Sequence[Accepted], skip_markdown: set[str] | None = None
    ) -> list[Accepted]:
        """Create markdown files, then append accepted lines; returns ``accepted`` with the
        file names as finally written. A failure here loses nothing: the database holds
        the record and repair rewrites the mirror."""
        final: list[Accepted] = []
        try:
            for item in accepted:
                if not (skip_markdown and item.record.key in skip_markdown):
                    item = self._create_markdown(item)
                final.append(item)
        except OSError as exc:
            log.warning("markdown mirror write failed (%s); repair will restore it", exc.strerror)
        final.extend(accepted[len(final) :])
        try:
            self.mirrors.append_accepted(
                [(item.record, item.seq or 0, item.markdown_name) for item in final]
            )
        except OSError as exc:
            log.warning("JSONL mirror append failed (%s); repair will restore it", exc.strerror)
        return final

    def _create_markdown(self, item: Accepted) -> Accepted:
        """Create the record's file. If another key's file took the name after the
        transaction chose it (a fallback file written meanwhile, outside the mirror lock),
        move the record to its ``-<key8>`` name rather than leave it without a file."""
        data = self.mirrors.render_new(item.record)
        if self.mirrors.create_file(item.markdown_name, data):
            return item
        owner = self.mirrors.owner_of(item.markdown_name)
        if owner in (item.record.key, ""):  # already ours, or unreadable: repair's to judge
            return item
        record = item.record
        name = markdown_filename(record.timestamp, record.slug, collision_key=record.key)
        try:
            deadline = time.monotonic() + self.busy_timeout + WRITE_MARGIN_SECONDS
            with self._transaction(deadline) as conn:
                self.storage.records.rename_markdown(conn, record.key, name)
        except Exception as exc:  # the record stands; verify will name the file
            log.warning("could not move a record off a taken file name (%s)", type(exc).__name__)
            return item
        self.mirrors.create_file(name, data)
        return replace(item, markdown_name=name)

    # -- receipts -------------------------------------------------------------------------

    def receipt(self, item: Accepted) -> Receipt:
        sink_ids: dict[str, str] = {}
        if item.duplicate:
            try:
                rows = self.storage.deliveries.deliveries_for([item.record.key]).get(
                    item.record.key, []
                )
            except Exception:  # the write itself stands; only the extra detail is missing
                rows = []
            sink_ids = {
                row.sink: row.sink_id
                for row in rows
                if row.state == DeliveryState.DELIVERED and row.sink_id
            }
        all_stored = bool(self.sinks) and all(sink in sink_ids for sink in self.sinks)
        return Receipt(
            key=item.record.key,
            status=ReceiptStatus.STORED if all_stored else ReceiptStatus.QUEUED,
            duplicate=item.duplicate,
            markdown_path=self.mirrors.path(item.markdown_name),
            timestamp=item.record.timestamp,
            sinks=self.sinks,
            sink_ids=sink_ids,
        )
