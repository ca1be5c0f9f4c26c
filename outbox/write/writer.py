"""The durable write: one transaction for record, graph node, edge and outbox rows.

A receipt promises the commit. The record's JSONL line and markdown file follow right after
it, written by the mirror writer's thread in commit order (``Mirrors.defer``), so a caller
never waits for its files; ``wait_mirrored`` is there for one that needs them.

This module imports no sink, no model and no chromadb: a write can never wait on them. Nor
does it know the dialect: the store's transaction object begins, bounds and commits
(``store/transactions.py``); on SQLite it runs on the bare driver, so ``outbox add`` can write
without importing SQLAlchemy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from outbox.core.receipt import Receipt
from outbox.core.record import Record
from outbox.core.slugs import markdown_filename
from outbox.core.states import DeliveryState, ReceiptStatus
from outbox.mirror.mirrors import Mirrors, NewMirror
from outbox.store.transactions import RowWrites, Transactions
from outbox.write.group_commit import GroupCommit

if TYPE_CHECKING:
    from outbox.store.storage import Storage

# Beyond the busy timeout, what a write may take for its own statements.
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


@dataclass(frozen=True)
class Prepared:
    """A record ready to commit, and the existing file it adopts, if any (``adopt``: a
    fallback or legacy file) instead of a new one."""

    record: Record
    adopt: str | None = None


class Writer:
    """Commits records and hands their mirrors to the mirror writer, under the mirror lock.

    Concurrent callers in one process share a transaction (group commit): while one
    transaction commits, the callers that arrive queue up, and the next one to lead commits
    all of them at once, so they pay one fsync between them instead of one each.

    ``transactions`` begin, bound and commit each transaction in the store's dialect;
    ``storage`` (built on first call) is only read for a duplicate's delivered ids.
    """

    def __init__(
        self,
        storage: Callable[[], Storage],
        mirrors: Mirrors,
        *,
        transactions: Transactions,
        sinks: Sequence[str],
        origin: str,
        busy_timeout: float,
    ) -> None:
        self.storage = storage
        self.mirrors = mirrors
        self.transactions = transactions
        self.sinks = tuple(sinks)
        self.origin = origin
        self.busy_timeout = busy_timeout
        self.queue: GroupCommit[Prepared, Accepted] = GroupCommit(self._transact)

    @property
    def rows(self) -> RowWrites:
        return self.transactions.rows

    # -- the transaction ------------------------------------------------------------------

    def insert(self, conn: Any, record: Record, now: float, adopt: str | None = None) -> Accepted:
        """Insert inside ``conn``'s transaction (see ``RowWrites``); a known key writes nothing.

        ``adopt`` names an existing markdown file (a fallback or legacy file) that becomes
        the record's mirror instead of a new one.
        """
        (accepted,) = self.insert_group(conn, [Prepared(record, adopt)], now)
        return accepted

    def enqueue(self, conn: Any, record: Record, now: float) -> Accepted:
        """Insert inside a caller's own SQLAlchemy transaction on ``conn`` (``Outbox.enqueue``):
        the rows run on the connection the dialect's statements take."""
        return self.insert(self.transactions.joined(conn), record, now)

    def insert_group(self, conn: Any, items: Sequence[Prepared], now: float) -> list[Accepted]:
        """Insert a group inside ``conn``'s transaction with one lookup and one statement
        per table; one Accepted per item, in order. A key already stored, or earlier in the
        group, writes nothing and comes back as a duplicate."""
        names = [
            item.adopt or markdown_filename(item.record.timestamp, item.record.slug)
            for item in items
        ]
        stored, owners = self.rows.lookup_many(conn, [item.record.key for item in items], names)
        slots: list[Accepted | None] = []
        first: dict[str, int] = {}  # key -> the position of its first, written occurrence
        fresh: list[tuple[int, Record, str]] = []
        for position, (item, name) in enumerate(zip(items, names, strict=True)):
            record = item.record
            if record.key in stored or record.key in first:
                slots.append(None)
                continue
            if not item.adopt and (
                owners.get(name, record.key) != record.key
                or self.mirrors.taken_on_disk(name, record)
            ):
                # Never overwrite another key's file: the record's name gets -<key8>.
                name = markdown_filename(record.timestamp, record.slug, collision_key=record.key)
            owners[name] = record.key
            first[record.key] = position
            fresh.append((position, record, name))
            slots.append(None)
        seqs = self.rows.insert_records(
            conn,
            [(record, name) for _, record, name in fresh],
            sinks=self.sinks,
            origin=self.origin,
            now=now,
        )
        for (position, record, name), seq in zip(fresh, seqs, strict=True):
            if seq is not None:
                slots[position] = Accepted(record, seq, name, False)
        return [
            slot or self._duplicate(conn, item.record.key, slots, first)
            for item, slot in zip(items, slots, strict=True)
        ]

    def _duplicate(
        self, conn: Any, key: str, slots: list[Accepted | None], first: dict[str, int]
    ) -> Accepted:
        """A key written before (or by a writer that does not hold our mirror lock, racing
        this one) or earlier in this group: what is stored, marked duplicate."""
        earlier = slots[first[key]] if key in first else None
        if earlier is not None:
            return replace(earlier, seq=None, duplicate=True)
        existing = self.rows.get_record(key, conn)
        assert existing is not None
        return Accepted(existing.record, None, existing.markdown_name, True)

    def commit(
        self, records: Sequence[Record], adopted: dict[str, str] | None = None
    ) -> list[Accepted]:
        """Commit ``records`` in one transaction; returns one Accepted per record, in order.
        Their mirrors follow on the mirror writer's thread.

        ``adopted`` maps keys to existing markdown files that become their mirrors (replay);
        such a call commits alone and returns once the mirrors are written. Otherwise the
        records may share a transaction with other threads' records: all of them commit, or
        none (each caller then falls back).
        """
        deadline = time.monotonic() + self.busy_timeout + WRITE_MARGIN_SECONDS
        if adopted:
            items = [Prepared(record, adopted.get(record.key)) for record in records]
            accepted = self._transact(items, deadline)
            self.mirrors.flush()  # replay stamps its files and reports them as imported
            return accepted
        return self.queue.submit([Prepared(record) for record in records], deadline)

    def _transact(self, items: Sequence[Prepared], deadline: float) -> list[Accepted]:
        """The transaction under the mirror lock, cut off at ``deadline`` where the database
        may stop answering (PostgreSQL: ``store/bounded.py``)."""
        return self.transactions.within(
            # A group that queued to the edge of its bound still gets a moment to commit.
            max(deadline - time.monotonic(), BOUND_TOLERANCE_SECONDS),
            lambda: self._transact_here(items, deadline),
        )

    def _transact_here(self, items: Sequence[Prepared], deadline: float) -> list[Accepted]:
        """Commit, then queue the new records' mirrors while the lock is still held: the
        lock keeps them from any other process until the mirror writer has written them."""
        with self.mirrors.hold(deadline, exclusive=False):
            now = time.time()
            with self.transactions.transaction(self._lock_wait(deadline)) as conn:
                accepted = self.insert_group(conn, items, now)
            self.mirrors.defer(
                [
                    NewMirror(done.record, done.seq or 0, done.markdown_name, item.adopt is None)
                    for done, item in zip(accepted, items, strict=True)
                    if not done.duplicate
                ],
                deadline,
            )
        return accepted

    def _lock_wait(self, deadline: float) -> float | None:
        """How long the transaction may wait for the database lock so that it ends by
        ``deadline`` (less the margin for statements), whatever waiting for the mirror lock
        used; None (the busy timeout) unless that waiting used a noticeable part of the
        bound, since shortening costs two extra statements a write."""
        budget = deadline - time.monotonic() - WRITE_MARGIN_SECONDS
        return budget if budget < self.busy_timeout - BOUND_TOLERANCE_SECONDS else None

    def wait_mirrored(self, timeout: float | None = None) -> bool:
        """Wait until every record committed so far has its JSONL line and markdown file."""
        return self.mirrors.flush(timeout)

    def close(self) -> None:
        """Give the writer's connection back (before the engine is disposed)."""
        self.transactions.close()

    # -- receipts -------------------------------------------------------------------------

    def receipt(self, item: Accepted) -> Receipt:
        sink_ids: dict[str, str] = {}
        if item.duplicate:
            try:
                rows = (
                    self.storage()
                    .deliveries.deliveries_for([item.record.key])
                    .get(item.record.key, [])
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
