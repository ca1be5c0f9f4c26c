"""The Chroma sink: records become documents whose id is the record key, written by upsert.

By default the shared server on ``OUTBOX_CHROMA_PATH`` that every process of its owner uses,
started by the first that needs it (``chroma_service``): one embedded folder must not be
opened by two processes, whose writes would corrupt it. ``OUTBOX_CHROMA_URL`` names a server
run by someone else; ``OUTBOX_CHROMA_MODE=embedded`` opens the folder in a child process of this
one (``chroma_local``), for a single process. Collections get no embedding function:
the sink always sends precomputed vectors, so Chroma never reaches for its default model (a
download) and a ConnectError always means the server. Nothing connects before the first call,
which runs under the dispatcher's timeout.

A failed delivery is raised as ``Transient`` or ``Permanent`` (``chroma_client`` reads
chromadb's and httpx's exceptions); the sink's own troubles keep their own classes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from outbox.core.config import Settings
from outbox.core.errors import ConfigError, OutboxError
from outbox.core.record import Record
from outbox.sinks.base import Deleted, DeleteOutcome, Delivered, Held, Outcome, Rejected
from outbox.sinks.chroma_client import Backend, ServerBackend, chroma_failure, parse_chroma_url
from outbox.sinks.chroma_documents import chroma_metadata, has_visible_text, vector_problem
from outbox.sinks.chroma_index import ActiveIndex, IndexPointer
from outbox.sinks.chroma_local import UNKNOWN_OPERATION
from outbox.sinks.embedding import Embedder, builtin_name, embedding_name, load_embedding

__all__ = [
    "ChromaSink",
    "EmbeddingMismatch",
    "SearchHits",
    # Where they were before the split, for callers that import them from here.
    "chroma_metadata",
    "has_visible_text",
    "parse_chroma_url",
]

log = logging.getLogger(__name__)

# In the Chroma folder while a purge of deleted documents' copies is owed.
PURGE_OWED = "outbox-purge-owed"
# Records per upsert while the next model run embeds: small enough that Chroma's write of one
# piece overlaps the model's next run, large enough that its fixed cost per call stays small.
_UPSERT_PIECE = 16


@runtime_checkable
class Stoppable(Protocol):
    """A backend that can stop the Chroma it runs for work on its files."""

    def stopped(self) -> contextlib.AbstractContextManager[None]: ...


def _embeds_queries(backend: Backend) -> bool:
    """Whether the backend's Chroma runs in a long-lived process that embeds a query text
    itself (the shared server), instead of this process loading the model for it."""
    return bool(getattr(backend, "embeds_queries", False))


class EmbeddingMismatch(OutboxError):
    """The collection's vectors come from another embedder than ``OUTBOX_EMBEDDING``.

    Not a ValueError, so the dispatcher retries instead of dead-lettering: the records are
    fine; ``outbox reindex`` (or the old setting) makes them deliverable.
    """


@dataclass(frozen=True)
class SearchHits:
    """Nearest documents first; ``distances`` are cosine distances (0 = same direction)."""

    ids: list[str]
    distances: list[float]
    documents: list[str]
    metadatas: list[dict[str, Any]]


class ChromaSink:
    """Delivers records to one Chroma collection; ``Delivered.sink_id`` is the record key."""

    # It serves meaning-based recall: records it holds leave the lexical pending overlay.
    semantic: bool = True

    def __init__(
        self,
        collection: str,
        *,
        path: Path | None = None,
        url: str | None = None,
        embedding: str = "minilm",
        timeout: float = 25.0,
        name: str = "chroma",
        mode: str = "server",
        idle: float = 600.0,
        index_home: Path | None = None,
    ) -> None:
        if url is None and path is None:
            raise ConfigError("OUTBOX_CHROMA_PATH", "the Chroma sink needs a path or a URL")
        self.name = name
        self.collection_name = collection
        self.path = path
        self.server = parse_chroma_url(url) if url else None
        self.embedding = embedding
        self.timeout = timeout
        self.mode, self.idle = mode, idle
        self._lock = threading.Lock()
        self._backend: Backend | None = None
        self._max_batch: int | None = None
        # With a home, the collection (and its embedder) is the one the index pointer names.
        self._pointer = IndexPointer(index_home, collection) if index_home else None
        self._checked: dict[tuple[str, str], int] = {}  # (collection, embedder): batch limit
        self._held = threading.local()
        self._purge_lock = threading.Lock()
        self._purge_wanted = False
        self._purger: threading.Thread | None = None

    @classmethod
    def from_settings(cls, settings: Settings, *, collection: str | None = None) -> ChromaSink:
        """The sink of ``settings``, following the active index; ``collection`` pins one
        collection instead (a reindex filling its new one)."""
        return cls(
            collection or settings.chroma_collection,
            path=settings.chroma_path,
            url=settings.chroma_url,
            embedding=settings.embedding,
            timeout=settings.sink_timeout,
            mode=settings.chroma_mode,
            idle=settings.chroma_idle,
            index_home=None if collection else settings.home,
        )

    def embedder(self) -> Embedder:
        """The active index's embedder: queries and records must meet its vectors."""
        return load_embedding(self.active_index().embedding or self.embedding)

    def active_index(self) -> ActiveIndex:
        """The collection serving now and the setting that built it (a reindex moves it);
        inside a call, the one that call holds."""
        held: ActiveIndex | None = getattr(self._held, "active", None)
        if held is not None:
            return held
        found = self._pointer.read() if self._pointer else None
        if found is None:
            return ActiveIndex(self.collection_name, self.embedding)
        return ActiveIndex(found.collection, found.embedding or self.embedding, found.generation)

    @contextlib.contextmanager
    def _selected(self) -> Iterator[ActiveIndex]:
        """The active index, held (a shared lock) so a reindex cannot switch it while this
        call uses it; a nested call of the same thread keeps the outer one."""
        held: ActiveIndex | None = getattr(self._held, "active", None)
        if held is not None:
            yield held
            return
        with self._pointer.held() if self._pointer else contextlib.nullcontext():
            self._held.active = self.active_index()
            try:
                yield self._held.active
            finally:
                self._held.active = None

    def _backend_now(self) -> tuple[Backend, int | None]:
        with self._lock:
            opened = self._backend is None
            if self._backend is None:
                self._backend = self._new_backend()
            backend = self._backend
        if opened and self.path is not None and (self.path / PURGE_OWED).exists():
            self._owe_purge()  # a purge that a crash or a failure left owed
        return backend, self._max_batch

    def _new_backend(self) -> Backend:
        """The given server, else the shared one on the folder, else the embedded child."""
        if self.server is not None:
            return ServerBackend(*self.server, timeout=self.timeout)
        assert self.path is not None
        if self.mode == "embedded":
            from outbox.sinks.chroma_local import LocalBackend

            return LocalBackend(self.path, timeout=self.timeout)
        from outbox.sinks.chroma_service import SharedBackend

        return SharedBackend(self.path, timeout=self.timeout, idle=self.idle)

    def _open(self) -> tuple[Backend, str, int]:
        """The backend, the embedder's name and the batch limit; the first call opens the
        collection and checks it was built by the same embedder (other vector sizes would
        fail every record)."""
        backend, _ = self._backend_now()
        active = self.active_index()
        name = self._embedder_name(backend, active)
        max_batch = self._checked.get((active.collection, name))
        if max_batch is None:
            built_with, max_batch = backend.call("open", active.collection, name)
            if built_with not in (None, name):
                raise EmbeddingMismatch(
                    f"Chroma collection {active.collection!r} holds vectors from "
                    f"{built_with!r}, but OUTBOX_EMBEDDING gives {name!r}; run `outbox "
                    "reindex` to re-embed every record for it, or set the embedding back"
                )
            if active.embedding != self.embedding:
                log.warning(
                    "OUTBOX_EMBEDDING is %r but collection %r was built by %r, which serves "
                    "until `outbox reindex` switches",
                    self.embedding,
                    active.collection,
                    active.embedding,
                )
            self._checked[(active.collection, name)] = max_batch
        return backend, name, max_batch

    def _embedder_name(self, backend: Backend, active: ActiveIndex) -> str:
        """The active embedder's name; the model is loaded now (while an embedded child
        starts) unless the backend embeds queries itself and a built-in names it."""
        spec = active.embedding or self.embedding
        name = builtin_name(spec) if _embeds_queries(backend) else None
        return name or embedding_name(self.embedder())

    def _call(self, op: str, *args: Any) -> Any:
        with self._selected() as active:
            backend, name, _ = self._open()
            return backend.call(op, active.collection, name, *args)

    def built_with(self, collection: str) -> str | None:
        """The embedder name recorded on ``collection`` (None: unrecorded); a missing one is
        created empty for this sink's own embedder, so that embedder then matches."""
        backend, _ = self._backend_now()
        name = embedding_name(load_embedding(self.embedding))
        built: str | None = backend.call("open", collection, name)[0]
        return built

    def retire(self, collection: str) -> bool:
        """Delete ``collection``, an index a reindex replaced; False when it was not there."""
        backend, _ = self._backend_now()
        self._checked = {key: step for key, step in self._checked.items() if key[0] != collection}
        return bool(backend.call("drop", collection, self.embedding))

    # -- the Sink interface ---------------------------------------------------------------

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        """Embed and upsert ``batch``; per-record refusals come back as ``Rejected``, and
        Chroma's own failures are raised as ``Transient`` or ``Permanent``."""
        if not batch:
            return []
        try:
            with self._selected():  # one collection and embedder for the whole batch
                outcomes = self._deliver(batch)
        except Exception as exc:
            failure = chroma_failure(exc)
            if failure is None:
                raise
            raise failure from exc
        delivered = sum(isinstance(outcome, Delivered) for outcome in outcomes.values())
        log.debug("%s: %d of %d records delivered", self.name, delivered, len(outcomes))
        return [outcomes[record.key] for record in batch]

    def _deliver(self, batch: Sequence[Record]) -> dict[str, Outcome]:
        *_, step = self._open()  # before embedding: a store that is down fails fast
        outcomes: dict[str, Outcome] = {}
        todo: list[Record] = []
        seen: set[str] = set()
        for record in batch:  # one upsert per key: Chroma refuses a repeated id in one call
            if record.key in seen:
                continue
            seen.add(record.key)
            if has_visible_text(record.content):
                todo.append(record)
            else:
                outcomes[record.key] = Rejected("the content has no visible character to embed")
        with _Upserts(self, min(step, _UPSERT_PIECE)) as upserts:
            for piece in self._embedded(todo, outcomes):
                upserts.add(piece)
        for record in upserts.stored:
            outcomes[record.key] = Delivered(record.key)
        return outcomes

    def _embedded(
        self, todo: list[Record], outcomes: dict[str, Outcome]
    ) -> Iterator[list[tuple[Record, Sequence[float]]]]:
        """Records with their vectors, a model run at a time when the embedder gives them so
        (all at once otherwise); a record whose vector is unusable is rejected."""
        if not todo:
            return
        embedder = self.embedder()
        texts = [record.content for record in todo]
        runs = getattr(embedder, "runs", None)
        pieces = runs(texts) if callable(runs) else [(range(len(texts)), _all(embedder, texts))]
        for indices, vectors in pieces:
            ready: list[tuple[Record, Sequence[float]]] = []
            for i, vector in zip(indices, vectors, strict=True):
                problem = vector_problem(vector)
                if problem:
                    outcomes[todo[i].key] = Rejected(problem)
                else:
                    ready.append((todo[i], vector))
            yield ready

    def _upsert(self, chunk: list[tuple[Record, Sequence[float]]]) -> None:
        import numpy as np

        self._call(
            "upsert",
            [record.key for record, _ in chunk],
            np.asarray([vector for _, vector in chunk], dtype=np.float32),
            [record.content for record, _ in chunk],
            [chroma_metadata(record) for record, _ in chunk],
        )

    def delete(self, items: Sequence[Held]) -> list[DeleteOutcome]:
        """Remove forgotten records from the collection recall reads (document id = key),
        then purge Chroma's own leftover copies of them."""
        if not items:
            return []
        try:
            self._call("delete", [item.key for item in items])
        except Exception as exc:
            failure = chroma_failure(exc)
            if failure is None:
                raise
            raise failure from exc
        self._owe_purge()
        return [Deleted(item.key) for item in items]

    def _purgeable(self, backend: Backend) -> bool:
        """Only a folder this library runs Chroma on: a server named by ``OUTBOX_CHROMA_URL``
        keeps its files out of reach."""
        return self.path is not None and isinstance(backend, Stoppable)

    def _owe_purge(self) -> None:
        """Purge Chroma's own copies of deleted documents (``chroma_purge``) in a thread of
        its own: it stops Chroma for seconds, longer than a sink call may take. A marker
        file keeps the debt across a crash; ``close`` waits for the purge."""
        backend, _ = self._backend_now()
        if not self._purgeable(backend):
            return
        assert self.path is not None
        fd = os.open(self.path / PURGE_OWED, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        with self._purge_lock:
            self._purge_wanted = True
            if self._purger is None:
                self._purger = threading.Thread(
                    target=self._purge_loop, name="outbox-chroma-purge", daemon=True
                )
                self._purger.start()

    def _purge_loop(self) -> None:
        """Purge until no delete asked for another; a failure leaves the marker for the next
        delete or the next process to open the sink."""
        from outbox.sinks.chroma_purge import purge_store

        while True:
            with self._purge_lock:
                if not self._purge_wanted:
                    self._purger = None
                    return
                self._purge_wanted = False
            backend, _ = self._backend_now()
            assert self.path is not None and isinstance(backend, Stoppable)
            try:
                with backend.stopped():
                    done = purge_store(self.path)
            except Exception as exc:
                log.warning(
                    "%s: purge of Chroma's copies of deleted documents deferred (%s)",
                    self.name,
                    exc.__class__.__name__,
                )
                with self._purge_lock:
                    self._purger = None
                return
            with self._purge_lock:
                if not self._purge_wanted:
                    (self.path / PURGE_OWED).unlink(missing_ok=True)
            log.info(
                "%s: purged Chroma's copies of deleted documents (%d log rows, %d schema "
                "keys) in %.1f s",
                self.name,
                done.log_rows,
                done.schema_keys,
                done.seconds,
            )

    def search(
        self, query: str, n_results: int = 5, where: Mapping[str, Any] | None = None
    ) -> SearchHits:
        """Semantic recall: the ``n_results`` documents nearest to ``query``. The shared
        server embeds the query itself with a built-in embedder (the same model, the same
        vector), so a process that only searches loads no model and no numpy."""
        reply = self._ask(("query_text",), ("query",), query, n_results, where)
        return SearchHits(
            ids=[str(i) for i in reply["ids"]],
            distances=[float(d) for d in reply["distances"]],
            documents=[str(d) for d in reply["documents"]],
            metadatas=[dict(m or {}) for m in reply["metadatas"]],
        )

    def nearest(
        self, query: str, n_results: int = 5, where: Mapping[str, Any] | None = None
    ) -> list[tuple[str, float]]:
        """``search``'s (id, distance) pairs alone, nearest first: all recall's vector leg
        reads, so Chroma fetches no documents or metadata for it."""
        reply = self._ask(
            ("nearest_text", "query_text"), ("nearest", "query"), query, n_results, where
        )
        return [(str(i), float(d)) for i, d in zip(reply["ids"], reply["distances"], strict=True)]

    def _ask(
        self,
        text_ops: tuple[str, ...],
        vector_ops: tuple[str, ...],
        query: str,
        n_results: int,
        where: Mapping[str, Any] | None,
    ) -> dict[str, list[Any]]:
        """The reply of the first call of ``text_ops`` the server knows (it embeds the query
        itself), else of ``vector_ops`` on the query's vector embedded here; a server that
        an older version of the library started lacks the newer calls, named first."""
        with self._selected() as active:
            backend, name, _ = self._open()
            spec = active.embedding or self.embedding
            filters = dict(where) if where else None
            if _embeds_queries(backend) and builtin_name(spec) == name:
                texts = (active.collection, name, spec, query, n_results, filters)
                reply = self._known(backend, text_ops, texts)
                if reply is not None:
                    return reply
            vector = (active.collection, name, self._query_vector(query), n_results, filters)
            reply = self._known(backend, vector_ops[:-1], vector)
            return reply if reply is not None else backend.call(vector_ops[-1], *vector)

    def _known(
        self, backend: Backend, ops: tuple[str, ...], args: tuple[Any, ...]
    ) -> dict[str, list[Any]] | None:
        """The reply of the first of ``ops`` the backend knows; None when it knows none (an
        older server's refusal costs a round trip, and is asked again next time: the server
        may have been replaced by a newer one since)."""
        for op in ops:
            try:
                reply: dict[str, list[Any]] = backend.call(op, *args)
            except RuntimeError as exc:
                if not str(exc).startswith(UNKNOWN_OPERATION):
                    raise
                continue
            return reply
        return None

    def _query_vector(self, query: str) -> Any:
        import numpy as np

        embedder = self.embedder()
        (vector,) = getattr(embedder, "embed_query", embedder)([query])
        return np.asarray(vector, dtype=np.float32)

    def count(self) -> int:
        return int(self._call("count"))

    def close(self) -> None:
        with self._purge_lock:
            purger = self._purger
        if purger is not None:  # the promise of a forget: Chroma's files lose the words
            purger.join()
        with self._lock:
            backend, self._backend, self._max_batch = self._backend, None, None
            self._checked = {}
        if backend is not None:
            backend.close()


def _all(embedder: Embedder, texts: list[str]) -> Sequence[Any]:
    """Every vector from an embedder that gives them all at once, checked for count."""
    vectors = embedder(texts)
    if len(vectors) != len(texts):
        raise RuntimeError(
            f"the embedding function gave {len(vectors)} vectors for {len(texts)} texts"
        )
    return vectors


class _Upserts:
    """Upserts in a thread of their own, in pieces, while the caller embeds the next run:
    Chroma's write (in the server, on another core) and the model's work overlap. Leaving
    the block waits for every piece and raises the first failure; ``stored`` then lists the
    records written."""

    def __init__(self, sink: ChromaSink, piece: int) -> None:
        self.sink, self.piece = sink, piece
        self.active = sink.active_index()  # the one the delivering call holds
        self.waiting: list[tuple[Record, Sequence[float]]] = []
        self.stored: list[Record] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._sent: list[concurrent.futures.Future[list[Record]]] = []

    def add(self, ready: list[tuple[Record, Sequence[float]]]) -> None:
        self.waiting.extend(ready)
        while len(self.waiting) >= self.piece:
            self._send(self.waiting[: self.piece])
            del self.waiting[: self.piece]

    def _send(self, chunk: list[tuple[Record, Sequence[float]]]) -> None:
        failed = next((f for f in self._sent if f.done() and f.exception()), None)
        if failed is not None:
            failed.result()  # an earlier piece failed: stop embedding, report it
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="outbox-chroma-upsert"
            )
        self._sent.append(self._pool.submit(self._write, chunk))

    def _write(self, chunk: list[tuple[Record, Sequence[float]]]) -> list[Record]:
        self.sink._held.active = self.active  # this thread's calls use the caller's index
        try:
            self.sink._upsert(chunk)
        finally:
            self.sink._held.active = None
        return [record for record, _ in chunk]

    def __enter__(self) -> _Upserts:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None and self.waiting:
            self._send(self.waiting)
            self.waiting = []
        try:
            for future in self._sent:  # all of them, even after a failure: none left running
                concurrent.futures.wait([future])
            if kind is None:
                for future in self._sent:
                    self.stored.extend(future.result())
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
