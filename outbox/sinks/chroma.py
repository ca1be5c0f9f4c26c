"""The Chroma sink: records become documents whose id is the record key, written by upsert.

Embedded by default: a ``PersistentClient`` in a child process (see ``chroma_local`` for
why); a ``chroma run`` server when ``OUTBOX_CHROMA_URL`` is set, the only safe choice when
several processes write (docs/research/chroma.md). Collections get no embedding function:
the sink always sends precomputed vectors, so Chroma never reaches for its default model (a
download) and a ConnectError always means the server. Nothing connects before the first call,
which runs under the dispatcher's timeout.

A failed delivery is raised as ``Transient`` or ``Permanent`` (``chroma_client`` reads
chromadb's and httpx's exceptions); the sink's own troubles keep their own classes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.config import Settings
from outbox.errors import ConfigError, OutboxError
from outbox.record import Record
from outbox.sinks.base import Delivered, Outcome, Rejected
from outbox.sinks.chroma_client import Backend, ServerBackend, chroma_failure, parse_chroma_url
from outbox.sinks.chroma_documents import chroma_metadata, has_visible_text, vector_problem
from outbox.sinks.embedding import Embedder, embedding_name, load_embedding

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


class EmbeddingMismatch(OutboxError):
    """The collection's vectors come from another embedder than ``OUTBOX_EMBEDDING``.

    Not a ValueError, so the dispatcher retries instead of dead-lettering: the records are
    fine, the setting (or ``OUTBOX_CHROMA_COLLECTION``) needs fixing.
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
    ) -> None:
        if url is None and path is None:
            raise ConfigError("OUTBOX_CHROMA_PATH", "the Chroma sink needs a path or a URL")
        self.name = name
        self.collection_name = collection
        self.path = path
        self.server = parse_chroma_url(url) if url else None
        self.embedding = embedding
        self.timeout = timeout
        self._lock = threading.Lock()
        self._backend: Backend | None = None
        self._max_batch: int | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> ChromaSink:
        return cls(
            settings.chroma_collection,
            path=settings.chroma_path,
            url=settings.chroma_url,
            embedding=settings.embedding,
            timeout=settings.sink_timeout,
        )

    def embedder(self) -> Embedder:
        return load_embedding(self.embedding)

    def _backend_now(self) -> tuple[Backend, int | None]:
        with self._lock:
            if self._backend is None:
                if self.server is not None:
                    self._backend = ServerBackend(*self.server, timeout=self.timeout)
                else:
                    from outbox.sinks.chroma_local import LocalBackend

                    assert self.path is not None
                    self._backend = LocalBackend(self.path, timeout=self.timeout)
            return self._backend, self._max_batch

    def _open(self) -> tuple[Backend, str, int]:
        """The backend, the embedder's name and the batch limit; the first call opens the
        collection and checks it was built by the same embedder (other vector sizes would
        fail every record)."""
        backend, max_batch = self._backend_now()
        name = embedding_name(self.embedder())  # loads the model while the store starts
        if max_batch is None:
            built_with, max_batch = backend.call("open", self.collection_name, name)
            if built_with not in (None, name):
                raise EmbeddingMismatch(
                    f"Chroma collection {self.collection_name!r} holds vectors from "
                    f"{built_with!r}, but OUTBOX_EMBEDDING gives {name!r}; set the same "
                    "embedding or another OUTBOX_CHROMA_COLLECTION"
                )
            self._max_batch = max_batch
        return backend, name, max_batch

    def _call(self, op: str, *args: Any) -> Any:
        backend, name, _ = self._open()
        return backend.call(op, self.collection_name, name, *args)

    # -- the Sink interface ---------------------------------------------------------------

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        """Embed and upsert ``batch``; per-record refusals come back as ``Rejected``, and
        Chroma's own failures are raised as ``Transient`` or ``Permanent``."""
        if not batch:
            return []
        try:
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
        ready = self._embedded(todo, outcomes)
        for start in range(0, len(ready), step):
            self._upsert(ready[start : start + step])
            for record, _ in ready[start : start + step]:
                outcomes[record.key] = Delivered(record.key)
        return outcomes

    def _embedded(
        self, todo: list[Record], outcomes: dict[str, Outcome]
    ) -> list[tuple[Record, Sequence[float]]]:
        """Each record with its vector; a record whose vector is unusable is rejected."""
        if not todo:
            return []
        vectors = self.embedder()([record.content for record in todo])
        if len(vectors) != len(todo):
            raise RuntimeError(
                f"the embedding function gave {len(vectors)} vectors for {len(todo)} texts"
            )
        ready: list[tuple[Record, Sequence[float]]] = []
        for record, vector in zip(todo, vectors, strict=True):
            problem = vector_problem(vector)
            if problem:
                outcomes[record.key] = Rejected(problem)
            else:
                ready.append((record, vector))
        return ready

    def _upsert(self, chunk: list[tuple[Record, Sequence[float]]]) -> None:
        import numpy as np

        self._call(
            "upsert",
            [record.key for record, _ in chunk],
            np.asarray([vector for _, vector in chunk], dtype=np.float32),
            [record.content for record, _ in chunk],
            [chroma_metadata(record) for record, _ in chunk],
        )

    def search(
        self, query: str, n_results: int = 5, where: Mapping[str, Any] | None = None
    ) -> SearchHits:
        """Semantic recall: the ``n_results`` documents nearest to ``query``."""
        import numpy as np

        embedder = self.embedder()
        (vector,) = getattr(embedder, "embed_query", embedder)([query])
        reply = self._call(
            "query", np.asarray(vector, dtype=np.float32), n_results, dict(where) if where else None
        )
        return SearchHits(
            ids=[str(i) for i in reply["ids"]],
            distances=[float(d) for d in reply["distances"]],
            documents=[str(d) for d in reply["documents"]],
            metadatas=[dict(m or {}) for m in reply["metadatas"]],
        )

    def count(self) -> int:
        return int(self._call("count"))

    def close(self) -> None:
        with self._lock:
            backend, self._backend, self._max_batch = self._backend, None, None
        if backend is not None:
            backend.close()
