"""The durable write: one transaction for record, graph node, edge and outbox rows, then mirrors.

This module imports no sink, no model and no chromadb: a write can never wait on them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from sqlalchemy import Connection

from outbox.errors import MirrorBusy
from outbox.folders import ensure_private_dir
from outbox.mirror import markdown
from outbox.mirror.jsonl import JsonlLog, accepted_event
from outbox.mirror.lock import MirrorLock
from outbox.receipt import QUEUED, STORED, Receipt
from outbox.record import Record
from outbox.slugs import markdown_filename
from outbox.store.bounded import call_within
from outbox.store.storage import DELIVERED, Storage
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


@dataclass(eq=False)
class _Ticket:
    """One caller's records waiting to be committed, alone or in a group with others'."""

    records: Sequence[Record]
    deadline: float
    done: threading.Event | None = None  # only a ticket that waits needs one
    lead: bool = False
    passed: bool = False  # this ticket led and handed the lead on
    accepted: list[Accepted] | None = None
    error: BaseException | None = None


class Writer:
    """Commits records and writes their mirrors under the mirror lock.

    Concurrent callers in one process share a transaction (group commit): while one
    transaction commits, the callers that arrive queue up, and the next one to lead commits
    all of them at once, so they pay one fsync between them instead of one each.
    """

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
        self._markdown_folder = str(markdown_dir)
        self._folder_ready = False  # made once; a folder removed later is made again
        self._connection: Connection | None = None
        self._queue_lock = threading.Lock()
        self._waiting: list[_Ticket] = []
        self._leading = False

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
        path = os.path.join(self._markdown_folder, name)
        return os.path.exists(path) and self._file_owner(Path(path)) != key

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
        """Commit ``records`` in one transaction, then write their mirrors; returns one
        Accepted per record, in order.

        ``adopted`` maps keys to existing markdown files that become their mirrors (replay);
        such a call commits alone. Otherwise the records may share a transaction with other
        threads' records: all of them commit, or none (each caller then falls back).
        """
        deadline = time.monotonic() + self.busy_timeout + WRITE_MARGIN_SECONDS
        if adopted:
            return self._transact(records, adopted, deadline)
        ticket = _Ticket(records, deadline)
        with self._queue_lock:
            self._waiting.append(ticket)
            if self._leading:
                ticket.done = threading.Event()
            else:
                self._leading = ticket.lead = True
        try:
            if not ticket.lead:
                self._wait_turn(ticket)
            if ticket.lead:
                self._lead(ticket)
        except BaseException:
            self._abandon(ticket)
            raise
        if ticket.error is not None:
            raise ticket.error
        assert ticket.accepted is not None
        return ticket.accepted

    def _wait_turn(self, ticket: _Ticket) -> None:
        """Wait until a leader has committed this ticket or handed over the lead to it.

        A ticket nobody has taken by its deadline leaves the queue and fails in time (the
        caller falls back); one already taken waits for its group, whose leader is bounded.
        """
        assert ticket.done is not None
        if ticket.done.wait(max(0.0, ticket.deadline - time.monotonic())):
            return
        with self._queue_lock:
            if not ticket.lead and ticket in self._waiting:
                self._waiting.remove(ticket)
                raise MirrorBusy("other writers held the write queue past the write's time bound")
        ticket.done.wait()

    def _lead(self, own: _Ticket) -> None:
        """Commit every queued ticket as one group, then pass the lead to the next in line.

        The group's bound is its earliest deadline, so no caller in it waits past its own.
        """
        group: list[_Ticket] = []
        try:
            with self._queue_lock:
                group, self._waiting = self._waiting, []
            records = [record for ticket in group for record in ticket.records]
            accepted = self._transact(records, {}, min(ticket.deadline for ticket in group))
        except BaseException as exc:
            for ticket in group or [own]:  # empty: interrupted before taking the queue
                # Only the leader's own thread sees an interrupt (KeyboardInterrupt,
                # SystemExit); the others' writes just did not commit, and fall back.
                interrupted = ticket is not own and not isinstance(exc, Exception)
                ticket.error = MirrorBusy("its group was interrupted") if interrupted else exc
        else:
            start = 0
            for ticket in group:
                ticket.accepted = accepted[start : start + len(ticket.records)]
                start += len(ticket.records)
        finally:
            own.passed = True
            with self._queue_lock:
                if own in self._waiting:  # interrupted before taking the queue
                    self._waiting.remove(own)
                self._pass_lead()
            for ticket in group:
                if ticket.done is not None:
                    ticket.done.set()

    def _pass_lead(self) -> None:
        """Wake the first waiting ticket as the next leader, or mark nobody leading.
        Call with the queue lock held."""
        if self._waiting:
            successor = self._waiting[0]
            successor.lead = True
            assert successor.done is not None
            successor.done.set()
        else:
            self._leading = False

    def _abandon(self, ticket: _Ticket) -> None:
        """An interrupted caller leaves the queue, and hands on a lead it never used."""
        with self._queue_lock:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
            if ticket.lead and not ticket.passed:
                ticket.passed = True
                self._pass_lead()

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
        with self.lock.hold(deadline):
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

        SQLite runs it on the writer's own connection, kept between writes: a pool checkout
        and return per write cost about 30 µs. Only the thread holding the mirror lock uses
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

    def render_markdown(self, record: Record, states: dict[str, str] | None = None) -> bytes:
        matter = markdown.front_matter(
            record,
            intended_brain_store="brainlayer" in self.sinks,
            sink_states=states or dict.fromkeys(self.sinks, "pending"),
        )
        return markdown.render(matter, record.content)

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
        if not final:
            return final
        try:
            self.jsonl.append(
                [
                    accepted_event(item.record, item.seq or 0, item.markdown_name, list(self.sinks))
                    for item in final
                ]
            )
        except OSError as exc:
            log.warning("JSONL mirror append failed (%s); repair will restore it", exc.strerror)
        return final

    def _write_new(self, name: str, data: bytes) -> bool:
        if not self._folder_ready:
            ensure_private_dir(self.markdown_dir)
            self._folder_ready = True
        path = os.path.join(self._markdown_folder, name)
        try:
            return markdown.write_new(path, data)
        except FileNotFoundError:  # the folder was removed since: make it again
            ensure_private_dir(self.markdown_dir)
            return markdown.write_new(path, data)

    def _create_markdown(self, item: Accepted) -> Accepted:
        """Create the record's file. If another key's file took the name after the
        transaction chose it (a fallback file written meanwhile, outside the mirror lock),
        move the record to its ``-<key8>`` name rather than leave it without a file."""
        data = self.render_markdown(item.record)
        if self._write_new(item.markdown_name, data):
            return item
        owner = self._file_owner(Path(self._markdown_folder) / item.markdown_name)
        if owner in (item.record.key, ""):  # already ours, or unreadable: repair's to judge
            return item
        record = item.record
        name = markdown_filename(record.timestamp, record.slug, collision_key=record.key)
        try:
            deadline = time.monotonic() + self.busy_timeout + WRITE_MARGIN_SECONDS
            with self._transaction(deadline) as conn:
                self.storage.rename_markdown(conn, record.key, name)
        except Exception as exc:  # the record stands; verify will name the file
            log.warning("could not move a record off a taken file name (%s)", type(exc).__name__)
            return item
        self._write_new(name, data)
        return replace(item, markdown_name=name)

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
