"""``Outbox``: the library's front door, which wires storage, mirrors, writer and fallback.

Opening migrates the database and repairs the mirrors; ``add`` is the durable write; delivery
(``drain``) loads the dispatcher and sinks only when called, so a process that only writes
never imports them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from outbox.core.config import Settings, load_settings
from outbox.core.errors import DatabaseLacksRecords, OutboxError
from outbox.core.folders import ensure_private_dir
from outbox.core.receipt import Receipt
from outbox.core.record import DEFAULT_IMPORTANCE, Record, build_record
from outbox.core.safe_files import check_store
from outbox.mirror.gap import check_held, missing_file
from outbox.mirror.mirrors import Mirrors
from outbox.mirror.verify import VerifyReport
from outbox.operations.catalog import Catalog
from outbox.operations.forget import ForgetReceipt, Forgetter
from outbox.operations.status import DeadLetters, status_report, wait_delivered
from outbox.recall.fusion import CONTEXT_REACH
from outbox.store.engine import UNAVAILABLE
from outbox.store.sqlite_writes import sqlite_path
from outbox.store.storage import Storage
from outbox.store.transactions import transactions_for
from outbox.write.durable import commit_or_fallback
from outbox.write.fallback import FallbackQueue, failure_reason
from outbox.write.writer import WRITE_MARGIN_SECONDS, Writer

if TYPE_CHECKING:
    from outbox.core.recall_filter import RecallFilter
    from outbox.dispatch.dispatcher import Dispatcher, DrainReport
    from outbox.mirror.repair import RepairReport
    from outbox.operations.reindex import ReindexReport
    from outbox.recall.service import RecallAnswer, Recaller
    from outbox.store.delivery_reads import DeliveryRow
    from outbox.store.lexical import LexicalHits
    from outbox.store.rows import RecentRow, StoredRecord
    from outbox.write.replay import Replayer, ReplayReport

log = logging.getLogger(__name__)


def _refuse_missing(settings: Settings) -> None:
    """A read never creates: no store folder, or a SQLite database whose folder is not
    there (``OUTBOX_DB_URL`` naming a place that does not exist), is one clear error."""
    if not settings.home.is_dir():
        raise OutboxError(f"no outbox store at {settings.home}")
    database = sqlite_path(settings.db_url)
    if database is not None and not database.parent.is_dir():
        raise OutboxError(
            f"no outbox database at {database}: its folder {database.parent} does not exist "
            "(check OUTBOX_DB_URL)"
        )


class Outbox:
    """An open outbox: database, mirrors, fallback queue and settings.

    Opening never fails because the database is unavailable: the outbox opens degraded,
    writes go to the fallback queue, and the next open (or dispatcher pass) imports them.
    A database lacking records its log names (``missing``) is never written: writes go to
    the fallback queue, which `outbox rebuild` imports with the rest.
    """

    def __init__(self, settings: Settings, *, repair: bool = True) -> None:
        check_store(settings, sqlite_path(settings.db_url))  # before anything is opened
        self.settings = settings
        self.storage = Storage.from_settings(settings)
        self.engine, self.reader = self.storage.engine, self.storage.reader
        self.mirrors = Mirrors.from_settings(lambda: self.storage, settings)
        self.writer = Writer(
            lambda: self.storage,
            self.mirrors,
            transactions=transactions_for(settings, lambda: self.storage),
            sinks=settings.sinks,
            origin=settings.mirror_id,
            busy_timeout=settings.busy_timeout,
        )
        self.fallback = FallbackQueue(settings.markdown_dir, settings.sinks)
        self.dead = DeadLetters(self.storage, self.mirrors)
        self.catalog = Catalog(self.storage, self.mirrors, settings)
        self.forgetter = Forgetter(self.storage, self.mirrors, self.catalog, settings, self._notify)
        self.browse = self.storage.browse  # the dashboard's reads: pages of memories, activity
        self.last_repair: RepairReport | None = None
        self.last_import: ReplayReport | None = None
        self.unavailable: str | None = None
        self.missing: DatabaseLacksRecords | None = None
        self._migrated = False
        self._listeners: list[Callable[[], object]] = []
        try:
            self._ensure_schema()
            if repair:
                self.sync_mirrors()
        except UNAVAILABLE as exc:
            self.unavailable = failure_reason(exc)
            log.warning(
                "outbox database unavailable at open (%s); writes will fall back", self.unavailable
            )
        except DatabaseLacksRecords as exc:
            self.unavailable = failure_reason(exc)
            log.warning("%s", exc)

    @classmethod
    def open(
        cls,
        settings: Settings | None = None,
        *,
        repair: bool = True,
        create: bool = True,
        **overrides: Any,
    ) -> Outbox:
        """Open with settings from the environment, YAML file and defaults (keywords win).

        ``repair=False`` leaves the fallback import and mirror repair to a later
        ``sync_mirrors()`` call, for a caller that wants its write to come first.
        ``create=False`` (a command that only reads) makes no folder: a store or a SQLite
        database folder that is not there is an error naming it, not a new empty store.
        """
        if settings is None:
            settings = load_settings(**overrides)
        if not create:
            _refuse_missing(settings)
            return cls(settings, repair=repair)
        try:
            ensure_private_dir(settings.home)
        except OSError as exc:
            log.warning("cannot create %s (%s)", settings.home, exc.strerror)
        return cls(settings, repair=repair)

    def _ensure_schema(self) -> None:
        """Migrate on first use; on PostgreSQL the check is cut off like a write when the
        server does not answer (an upgrade that has started is left to finish). Then the
        database must hold what its log names (``mirror/gap.py``); until it does, every call
        raises DatabaseLacksRecords again, so writes fall back until a rebuild closes the gap."""
        if self._migrated:
            return
        self.missing = missing_file(self.settings, sqlite_path(self.settings.db_url))
        if self.missing is None:
            self.storage.upgrade(self.settings.busy_timeout + WRITE_MARGIN_SECONDS)
            self.storage.locations.check(self.settings)  # mirrors elsewhere: refused
            where = sqlite_path(self.settings.db_url) or self.engine.url.render_as_string(
                hide_password=True
            )
            try:
                check_held(self.storage, self.settings, str(where))
            except DatabaseLacksRecords as exc:
                self.missing = exc
        if self.missing is not None:
            raise self.missing
        self._migrated = True

    # -- writing --------------------------------------------------------------------------

    def prepare(
        self,
        content: object,
        importance: object = DEFAULT_IMPORTANCE,
        tags: Iterable[object] | None = None,
        timestamp: str | datetime | None = None,
        slug: object = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Record:
        """Validate and build a record without writing it (raises ValidationError)."""
        return build_record(
            content,
            importance=importance,
            tags=tags,
            timestamp=timestamp,
            slug=slug,
            metadata=metadata,
            min_length=self.settings.min_content_length,
            max_bytes=self.settings.max_content_bytes,
        )

    def add(
        self,
        content: object,
        importance: object = DEFAULT_IMPORTANCE,
        tags: Iterable[object] | None = None,
        timestamp: str | datetime | None = None,
        slug: object = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Receipt:
        """Validate, commit record + graph node + outbox rows in one transaction, mirror."""
        record = self.prepare(content, importance, tags, timestamp, slug, metadata)
        (receipt,) = self._commit_or_fallback([record])
        return receipt

    def add_many(self, items: Iterable[Mapping[str, Any] | str]) -> list[Receipt]:
        """Many records in one transaction: all are validated first, then all or none commit."""
        prepared = [
            self.prepare(item) if isinstance(item, str) else self.prepare(**dict(item))
            for item in items
        ]
        return self._commit_or_fallback(prepared)

    def _commit_or_fallback(self, records: list[Record]) -> list[Receipt]:
        """Commit, or, when the database cannot take the write in time, the fallback queue."""
        receipts, self.unavailable = commit_or_fallback(
            self.writer,
            self.fallback,
            records,
            expected=(*UNAVAILABLE, DatabaseLacksRecords),
            before=self._ensure_schema,
        )
        if self.unavailable is None:
            self._notify()
        return receipts

    def enqueue(self, conn: Connection, content: object, **fields: Any) -> Receipt:
        """Write inside the caller's own transaction (the transactional outbox pattern).

        The row commits or rolls back with the caller's rows. Its mirrors are written by the
        next ``sync_mirrors()`` (call it after committing; open and the dispatcher also do).
        On SQLite, a ``BEGIN IMMEDIATE`` that cannot get the lock raises ``sqlite3.Error``
        itself (not SQLAlchemy's wrapper): catch both when retrying a locked database, on a
        fresh connection.
        """
        record = self.prepare(content, **fields)
        accepted = self.writer.enqueue(conn, record, time.time())
        return self.writer.receipt(accepted)

    def add_listener(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` after every write in this process (wakes a local dispatcher);
        returns what removes it again."""
        self._listeners.append(callback)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(callback)

        return remove

    def _notify(self) -> None:
        for callback in list(self._listeners):
            callback()

    # -- mirrors, status, verification ----------------------------------------------------

    def sync_mirrors(self, full: bool = False) -> RepairReport:
        """Import waiting fallback files, then write whatever the mirrors lack (crash
        leftovers, enqueued records, delivery outcomes). ``full`` checks every record, not
        only those since the last repair."""
        self.import_fallback()
        self.last_repair = self.mirrors.repair(full=full)
        self.forgetter.purge_if_due()  # a forget whose process died before its purge
        return self.last_repair

    def _replayer(self) -> Replayer:
        from outbox.write.replay import Replayer

        return Replayer(self.storage, self.writer, self.fallback, self.settings, self._notify)

    def import_fallback(self) -> ReplayReport:
        """Bring this outbox's own fallback files in, once each (never into a database that
        lacks records its log names: they wait for `outbox rebuild`)."""
        self._ensure_schema()
        self.last_import = self._replayer().import_own_fallback()
        return self.last_import

    def replay(
        self,
        folder: Path | None = None,
        budget: int | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> ReplayReport:
        """Import pending fallback or legacy files from ``folder`` (default: the markdown
        folder); refuses above 100 pending files without a ``budget``."""
        self._ensure_schema()
        return self._replayer().replay_dir(folder or self.settings.markdown_dir, budget, progress)

    def verify(self) -> VerifyReport:
        """Whether the mirrors and the database agree; a database lacking records its log
        names is the first problem, with the command that brings them back (and a deleted
        SQLite file is not created anew to be compared)."""
        self._check_missing()
        missing = self.missing
        report = VerifyReport() if missing is not None and missing.gone else self.mirrors.verify()
        if missing is not None:
            report.problems.insert(0, str(missing))
        return report

    def status(self) -> dict[str, Any]:
        """Counts per sink and state, oldest pending age, dead letters, where the files are,
        and what the database lacks that its log names (``missing``)."""
        self._check_missing()
        return status_report(self.storage, self.settings, self.missing)

    def _refuse_if_missing(self) -> None:
        """Raise DatabaseLacksRecords when the database lacks records its log names: a
        reader would otherwise show an empty (or newly created) database as the store."""
        self._check_missing()
        if self.missing is not None:
            raise self.missing

    def refuse_if_empty(self) -> None:
        """Raise DatabaseLacksRecords when the database holds none of the records its log
        names (deleted or emptied): a read would show an empty store as the store. An older
        copy put back still answers with what it holds (status and verify name the merge;
        writes wait in the fallback queue)."""
        self._check_missing()
        if self.missing is not None and not self.missing.older_copy:
            raise self.missing

    def _check_missing(self) -> None:
        """``missing`` as it is now: a rebuild elsewhere may have closed the gap since."""
        if self.missing is not None:
            with contextlib.suppress(DatabaseLacksRecords, *UNAVAILABLE):
                self._ensure_schema()

    # -- delivery -------------------------------------------------------------------------

    def dispatcher(self, **options: Any) -> Dispatcher:
        """A dispatcher for this outbox's sinks (loads them on first use). Writes of this
        process wake it, and its maintenance rounds also import waiting fallback files."""
        from outbox.dispatch.dispatcher import Dispatcher

        return Dispatcher(
            self.storage,
            self.mirrors,
            self.settings,
            chores=[self.import_fallback, self.forgetter.purge_if_due],
            local_writes=self.add_listener,
            **options,
        )

    def drain(self, timeout: float | None = None, **options: Any) -> DrainReport:
        """Deliver what is due to every sink, then return (loads sinks on first use); refused
        while the database lacks records its log names (DatabaseLacksRecords)."""
        self._refuse_if_missing()
        with self.dispatcher(**options) as dispatcher:
            return dispatcher.drain(timeout=timeout)

    def reindex(self, **options: Any) -> ReindexReport:
        """Re-embed every record into a new Chroma collection for ``OUTBOX_EMBEDDING``, then
        switch recall and delivery to it (resumable; ``Reindexer.run``'s options)."""
        from outbox.operations.reindex import Reindexer

        return Reindexer(self.storage, self.settings, options.pop("batch", 256)).run(**options)

    def forget(self, prefix: str) -> ForgetReceipt:
        """Remove a record everywhere (``operations/forget.py``); the database purge follows.
        Waiting fallback files are imported first: one of the same write is then removed
        as a second copy (``write/replay.py``), so no file of the key stays behind."""
        self.import_fallback()
        return self.forgetter.forget(prefix)

    def wait_delivered(self, key: str, sink: str | None = None, timeout: float = 30.0) -> Receipt:
        """Wait until ``key`` is delivered to ``sink`` (default: every sink), or time out.

        The receipt says ``stored`` only with the sink's concrete id, so a caller can report
        ``Stored in <Sink>: <id>`` honestly; otherwise it stays ``queued``.
        """
        return wait_delivered(self.storage, self.settings, key, sink, timeout)

    def wait_mirrored(self, timeout: float | None = None) -> bool:
        """Wait until this process's committed records have their JSONL line and markdown
        file (written just after each commit, off the caller's clock); False on timeout."""
        return self.writer.wait_mirrored(timeout)

    # -- lifetime -------------------------------------------------------------------------

    @property
    def markdown_dir(self) -> Path:
        return self.settings.markdown_dir

    def close(self) -> None:
        self._close_recaller()
        self.forgetter.close()
        self.writer.close()
        self.mirrors.close()
        self.storage.close()

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- operations: visibility and recall ------------------------------------------------
    # What the command line, memory-core and the MCP server need, so that none of them has
    # to reach into the store (dead letters: ``self.dead``, in operations.py).

    def deliveries_of(self, keys: Iterable[str]) -> dict[str, list[DeliveryRow]]:
        """Each named record's delivery rows, every sink and state: why it is late or dead."""
        return self.storage.deliveries.deliveries_for(keys)

    def markdown_path(self, key: str) -> Path | None:
        """Where a record's markdown mirror lives (None: no such record), to point a reader
        at the audit copy."""
        stored = self.storage.records.get_record(key)
        return None if stored is None else self.settings.markdown_dir / stored.markdown_name

    def get_records(self, keys: Iterable[str]) -> dict[str, StoredRecord]:
        """Records by key, so recall can turn ranked keys back into memories."""
        return self.storage.records.get_records(keys)

    def undelivered_count(self) -> int:
        """Rows every sink still has to take (pending or leased): the work a drain faces,
        without the rest of ``status``."""
        from outbox.core.states import UNDELIVERED

        self._refuse_if_missing()
        counts = self.storage.deliveries.counts()
        return sum(row.get(state, 0) for row in counts.values() for state in UNDELIVERED)

    def pending_summary(self, sink: str) -> tuple[int, bool, float | None]:
        """(rows ``sink`` still lacks, counted no further than a cap; whether the count hit
        that cap; seconds since the oldest of them was written). Bounded, so every write can
        report how far behind the sink is."""
        from outbox.store.delivery_reads import PENDING_DEPTH_CAP

        depth, oldest = self.storage.deliveries.pending_summary(sink)
        age = None if oldest is None else time.time() - oldest
        return depth, depth >= PENDING_DEPTH_CAP, age

    def recent_memories(
        self,
        limit: int = 20,
        *,
        session_id: str | None = None,
        agent: str | None = None,
        before: tuple[str, str] | None = None,
    ) -> list[RecentRow]:
        """Newest memories first, from the graph each write commits, so a memory is
        recallable as soon as ``add`` returns. ``before`` is the (timestamp, key) of the
        previous page's last row: keyset paging stays stable while writes go on. A database
        holding none of the records its log names is an error, never an empty page."""
        self.refuse_if_empty()
        return self.storage.recall.recent(
            limit=limit, session_id=session_id, agent=agent, before=before
        )

    def pending_matches(
        self,
        query: str,
        *,
        limit: int,
        vector_sink: str | None = None,
        session_id: str | None = None,
    ) -> list[tuple[str, float]]:
        """(key, score), best first, of records ``vector_sink`` does not hold yet (every
        record when None) that share words with ``query``."""
        return self.storage.recall.pending_matches(
            query, vector_sink=vector_sink, limit=limit, session_id=session_id
        )

    def lexical_matches(
        self, query: str, *, limit: int, filters: RecallFilter | None = None
    ) -> LexicalHits:
        """Recall's lexical leg: every record that shares words with ``query`` and passes
        ``filters`` (applied inside the query), best first, with what relevance needs."""
        return self.storage.recall.lexical(query, limit=limit, filters=filters)

    def session_neighbours(self, keys: Iterable[str]) -> dict[str, list[str]]:
        """Each memory's neighbours in its session (up to two turns each way): recall lends
        a hit's context to the turns around it."""
        return self.storage.recall.neighbours(keys, CONTEXT_REACH)

    # -- recall ---------------------------------------------------------------------------

    # Built on the first recall (``recaller``); the lock is class-wide, as it guards only
    # that first build, so concurrent first recalls share one recaller and its index.
    _recaller: Recaller | None = None
    _recaller_build = threading.Lock()

    @property
    def recaller(self) -> Recaller:
        """Hybrid recall over this outbox (``recall/service.py``), kept for the next call:
        it holds Chroma's index once a recall has opened it."""
        if self._recaller is None:
            from outbox.recall.service import Recaller

            with Outbox._recaller_build:
                if self._recaller is None:
                    self._recaller = Recaller(self.storage.recall, self.settings)
        return self._recaller

    def recall(
        self,
        query: str,
        *,
        limit: int = 10,
        session_id: str | None = None,
        agent: str | None = None,
        tags: Iterable[str] | None = None,
        min_importance: int | None = None,
        since: str | datetime | date | None = None,
        until: str | datetime | date | None = None,
        min_relevance: float | None = None,
    ) -> RecallAnswer:
        """Hybrid recall: the memories that answer ``query``, best first, as typed hits.

        The lexical leg finds every record by its words (delivered or not), the vector leg
        finds what Chroma has embedded by meaning; the filters (all must hold; ``since``
        inclusive, ``until`` exclusive) apply inside each leg's own query. When no hit
        reaches ``min_relevance`` (default 0.30) the answer is empty. An unreachable vector
        index leaves the lexical hits and says so in ``degraded``. Raises ValidationError
        for an empty query, and DatabaseLacksRecords when the database holds none of the
        records its log names (an empty answer would say the store holds nothing).
        """
        self.refuse_if_empty()
        return self.recaller.recall(
            query,
            limit=limit,
            session_id=session_id,
            agent=agent,
            tags=tags,
            min_importance=min_importance,
            since=since,
            until=until,
            min_relevance=min_relevance,
        )

    def _close_recaller(self) -> None:
        """Close the vector index a recall opened (``close`` calls this first)."""
        if self._recaller is not None:
            self._recaller.close()
