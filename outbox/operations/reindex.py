"""``outbox reindex``: re-embed every record into a new Chroma collection for
``OUTBOX_EMBEDDING``, switch recall and delivery over to it, then drop the old collection.

Until the switch the old collection keeps serving recall, and the dispatcher keeps delivering
into it; a reindex reads the records themselves, so what is written meanwhile is picked up too.

Resuming: after each batch is upserted, the last record ``seq`` done is written atomically to
``reindex-<collection>.json`` under ``OUTBOX_HOME``. A run that was killed continues after it:
at most its last batch is embedded again, and an upsert by key makes that harmless.

Switching: the pointer (``sinks/chroma_index.py``) moves under its lock held exclusively, so
no sink call is in flight. There the newest ``seq`` is read again, and the pointer moves only
when the new collection holds every record up to it; otherwise the lock is let go and the
rest is copied first. A record delivered into the old collection before the switch is thus
already in the new one, and every delivery after it goes to the new one.

chromadb and the models load only in ``Reindexer.run``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from outbox.core.config import Settings
from outbox.core.errors import ConfigError, OutboxError
from outbox.core.file_lock import exclusive
from outbox.core.naming import key_prefix
from outbox.sinks.chroma_index import ActiveIndex, IndexPointer, read_json, write_json_atomically

if TYPE_CHECKING:
    from outbox.core.record import Record
    from outbox.sinks.chroma import ChromaSink
    from outbox.store.storage import Storage

log = logging.getLogger(__name__)

BATCH = 256
VECTOR_SINK = "chroma"
# Attempts of one Chroma call that fails transiently (a restarting server, a busy store).
_ATTEMPTS = 6
_NOTHING_TO_DO, _DONE, _INTERRUPTED = "nothing to do", "done", "interrupted"
Result = TypeVar("Result")


@dataclass(frozen=True)
class ReindexProgress:
    """Records covered so far out of all, this run's records per second, seconds left."""

    done: int
    total: int
    rate: float
    eta: float | None


@dataclass(frozen=True)
class ReindexReport:
    """What a run did: ``status`` is done, nothing to do or interrupted (run it again).
    ``records`` are the live records the new collection holds; forgotten ones are never
    embedded, and ``forgotten`` counts them apart, as ``status`` does."""

    status: str
    collection: str
    previous: str | None
    embedding: str
    records: int
    embedded: int
    forgotten: int
    resumed_after: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status != _INTERRUPTED

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


@dataclass
class _State:
    """A reindex under way, saved after every batch so a killed run resumes after it."""

    base: str
    previous: str  # the collection serving when it began
    target: str
    embedding: str  # the OUTBOX_EMBEDDING value it embeds with
    built_with: str  # that embedder's name
    generation: int
    done_seq: int = 0
    seen: int = 0  # rows up to done_seq read, tombstones too (the lost-row check at the switch)
    stored: int = 0  # live records among them upserted into the target

    @classmethod
    def load(cls, path: Path) -> _State | None:
        raw = read_json(path)
        if raw is None:
            return None
        try:
            return cls(**{field.name: raw[field.name] for field in fields(cls)})
        except (KeyError, TypeError):
            log.warning("ignoring %s: not a reindex state", path)
            return None

    def save(self, path: Path) -> None:
        write_json_atomically(path, asdict(self))


def _spec_of(name: str) -> str | None:
    """The ``OUTBOX_EMBEDDING`` value of a built-in embedder's name (None: not built in)."""
    from outbox.sinks.embedding import HASHING, MINILM, HashingEmbedding, MiniLMEmbedding

    return {MiniLMEmbedding.name(): MINILM, HashingEmbedding.name(): HASHING}.get(name)


class Reindexer:
    """One reindex of the Chroma collection configured by ``settings``."""

    def __init__(self, storage: Storage, settings: Settings, batch: int = BATCH) -> None:
        if VECTOR_SINK not in settings.sinks:
            raise ConfigError(
                "OUTBOX_SINKS", "reindex rebuilds the chroma sink's index; add chroma"
            )
        self.storage = storage
        self.settings = settings
        self.batch = max(1, batch)
        self.base = settings.chroma_collection
        self.pointer = IndexPointer(settings.home, self.base)
        self.state_path = settings.home / f"reindex-{self.base}.json"
        self.embedded = 0
        self._started = time.monotonic()

    def run(
        self,
        progress: Callable[[ReindexProgress], None] | None = None,
        stop: threading.Event | None = None,
    ) -> ReindexReport:
        """Fill the new collection (resuming a killed run), switch, drop the old one.
        ``stop`` ends it after the batch under way: run it again to go on."""
        from outbox.sinks.chroma import ChromaSink

        self._started, self.embedded = time.monotonic(), 0
        with self._only_run():
            sink = ChromaSink.from_settings(self.settings)
            try:
                return self._run(sink, progress, stop)
            finally:
                sink.close()

    def _run(
        self,
        sink: ChromaSink,
        progress: Callable[[ReindexProgress], None] | None,
        stop: threading.Event | None,
    ) -> ReindexReport:
        from outbox.sinks.chroma import ChromaSink
        from outbox.sinks.embedding import embedding_name, load_embedding

        current = self.pointer.current()
        wanted = embedding_name(load_embedding(self.settings.embedding))
        built = self._retrying(lambda: sink.built_with(current.collection))
        old_state = _State.load(self.state_path)
        if built in (None, wanted):
            self._tidy(sink, old_state, current)
            return self._report(_NOTHING_TO_DO, current.collection, None, 0, 0)
        self._record_current(current, built)
        state = self._fresh_or_resumed(sink, old_state, current, wanted)
        target = ChromaSink.from_settings(self.settings, collection=state.target)
        try:
            if self._retrying(target.count) < state.stored:  # it lost what was saved as done
                log.warning("collection %r lacks records done before: again", state.target)
                state.done_seq = state.seen = state.stored = 0
            resumed_after = state.done_seq
            switched = self._fill_and_switch(state, target, progress, stop)
        finally:
            target.close()
        if not switched:
            return self._report(_INTERRUPTED, current.collection, None, state.stored, resumed_after)
        self._retrying(lambda: sink.retire(state.previous))
        self.state_path.unlink(missing_ok=True)
        log.info("reindex done: %r replaces %r", state.target, state.previous)
        return self._report(_DONE, state.target, state.previous, state.stored, resumed_after)

    def _report(
        self, status: str, collection: str, previous: str | None, stored: int, resumed: int
    ) -> ReindexReport:
        return ReindexReport(
            status=status,
            collection=collection,
            previous=previous,
            embedding=self.settings.embedding,
            records=stored,
            embedded=self.embedded,
            forgotten=self.storage.records.counts().forgotten,
            resumed_after=resumed,
            seconds=round(time.monotonic() - self._started, 3),
        )

    # -- the state before filling ------------------------------------------------------------

    def _tidy(self, sink: ChromaSink, state: _State | None, current: ActiveIndex) -> None:
        """With nothing to do, finish what an earlier run left: the drop after its switch, or
        the collection it was filling for a setting since given up."""
        if state is None or state.base != self.base:
            return
        leftover = state.previous if state.target == current.collection else state.target
        if leftover != current.collection:
            self._retrying(lambda: sink.retire(leftover))
            log.info("dropped collection %r left by an earlier reindex", leftover)
        self.state_path.unlink(missing_ok=True)

    def _record_current(self, current: ActiveIndex, built: str) -> None:
        """Name the serving collection's embedder in the pointer, so processes already set
        to the new embedding keep querying the old collection with the old one."""
        spec = _spec_of(built)
        if spec is None or self.pointer.read() is not None:
            return
        with self.pointer.held(exclusive=True):
            if self.pointer.read() is None:
                self.pointer.write(ActiveIndex(current.collection, spec, current.generation))

    def _fresh_or_resumed(
        self, sink: ChromaSink, state: _State | None, current: ActiveIndex, wanted: str
    ) -> _State:
        """The saved state when it is for this embedding and this serving collection; else a
        new one with a new target (an abandoned target is dropped)."""
        if state is not None and (
            state.base == self.base
            and state.previous == current.collection
            and state.target != current.collection
            and (state.embedding, state.built_with) == (self.settings.embedding, wanted)
        ):
            log.info("resuming the reindex into %r after seq %d", state.target, state.done_seq)
            return state
        if state is not None and state.target != current.collection:
            stale = state.target
            self._retrying(lambda: sink.retire(stale))
        generation = max(current.generation, state.generation if state else 0) + 1
        target = f"{self.base[:500]}.v{generation}"
        self._retrying(lambda: sink.retire(target))  # a leftover of that name starts empty
        fresh = _State(
            self.base, current.collection, target, self.settings.embedding, wanted, generation
        )
        fresh.save(self.state_path)
        return fresh

    # -- filling and switching ---------------------------------------------------------------

    def _fill_and_switch(
        self,
        state: _State,
        target: ChromaSink,
        progress: Callable[[ReindexProgress], None] | None,
        stop: threading.Event | None,
    ) -> bool:
        """Copy until nothing is left, then move the pointer under the exclusive lock if
        still nothing is left; False when stopped first."""
        while True:
            if not self._fill(state, target, progress, stop):
                return False
            with self.pointer.held(exclusive=True):
                records = self.storage.records
                newest, seen = records.newest_seq(), records.rows_upto(state.done_seq)
                if newest <= state.done_seq and seen == state.seen:
                    self.pointer.write(ActiveIndex(state.target, state.embedding, state.generation))
                    return True
            log.info("records arrived while switching: copying them first")
            if seen != state.seen:  # committed late under a lower seq (PostgreSQL): read all
                log.warning("records appeared behind the reindex; reading every record again")
                state.done_seq = state.seen = state.stored = 0

    def _fill(
        self,
        state: _State,
        target: ChromaSink,
        progress: Callable[[ReindexProgress], None] | None,
        stop: threading.Event | None,
    ) -> bool:
        """Embed and upsert batch after batch, saving the position after each; False when
        ``stop`` was set. A forgotten record's tombstone moves the position on and is never
        embedded: its words are gone, and recall must not find an empty memory."""
        while True:
            if stop is not None and stop.is_set():
                return False
            rows = self.storage.records.rows_after(state.done_seq, self.batch)
            if not rows:
                return True
            live = [row.record for row in rows if not row.forgotten]
            stored = self._deliver(target, live) if live else 0
            state.done_seq = rows[-1].seq
            state.seen += len(rows)
            state.stored += stored
            state.save(self.state_path)
            self.embedded += stored
            if progress is not None:
                progress(self._progress(state.stored))

    def _progress(self, done: int) -> ReindexProgress:
        total = max(done, self.storage.records.count_records())
        rate = self.embedded / max(time.monotonic() - self._started, 1e-6)
        eta = (total - done) / rate if rate > 0 else None
        return ReindexProgress(done, total, rate, eta)

    def _deliver(self, target: ChromaSink, batch: list[Record]) -> int:
        """Upsert ``batch`` into ``target``; how many were stored. A batch refused for good is
        tried one record at a time, and a record refused alone is left out."""
        from outbox.sinks.base import Delivered, Permanent

        try:
            outcomes = self._retrying(lambda: target.deliver(batch))
        except Permanent as exc:
            if len(batch) > 1:
                return sum(self._deliver(target, [record]) for record in batch)
            # The reason class only: a sink's error text may quote the memory it refused.
            key = key_prefix(batch[0].key)
            log.warning("record %s left out of the new index (%s)", key, exc.reason)
            log.debug("failure detail for %s: %s", key, exc)
            return 0
        return sum(isinstance(outcome, Delivered) for outcome in outcomes)

    def _retrying(self, action: Callable[[], Result]) -> Result:
        """``action``, tried again with backoff while it fails transiently."""
        from outbox.dispatch.classify import classify

        for attempt in itertools.count(1):
            try:
                return action()
            except Exception as exc:
                failure = classify(exc)
                if not failure.transient or attempt >= _ATTEMPTS:
                    raise
                log.warning("Chroma call failed (%s); trying again", failure.reason)
                log.debug("failure detail: %s", failure.message)
                time.sleep(min(2.0 ** (attempt - 1), 15.0))
        raise AssertionError("unreachable")

    def _only_run(self) -> contextlib.AbstractContextManager[None]:
        """One reindex of a collection at a time, across processes; a second is refused at
        once (it would only re-embed what the first is embedding)."""
        path = self.settings.home / f"reindex-{self.base}.lock"
        return exclusive(
            path,
            "reindex lock",
            lambda: OutboxError(
                f"another `outbox reindex` of {self.base!r} is running (it holds {path})"
            ),
        )
