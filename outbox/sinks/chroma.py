"""The Chroma sink: records become documents whose id is the record key, written by upsert.

Embedded by default: a ``PersistentClient`` in a child process (see ``chroma_local`` for
why); a ``chroma run`` server when ``OUTBOX_CHROMA_URL`` is set, the only safe choice when
several processes write (docs/research/chroma.md). Collections get no embedding function:
the sink always sends precomputed vectors, so Chroma never reaches for its default model (a
download) and a ConnectError always means the server. Nothing connects before the first call,
which runs under the dispatcher's timeout.
"""

from __future__ import annotations

import logging
import math
import threading
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

from outbox.config import Settings
from outbox.errors import ConfigError, OutboxError
from outbox.record import Record
from outbox.sinks.base import Delivered, Outcome, Rejected
from outbox.sinks.embedding import Embedder, embedding_name, load_embedding, register_with_chroma

if TYPE_CHECKING:
    from chromadb.api import ClientAPI
    from chromadb.api.models.Collection import Collection

log = logging.getLogger(__name__)

EMBEDDING_KEY = "outbox_embedding"  # collection metadata: which embedder built its vectors
# Metadata keys the sink writes itself; a record's own metadata cannot override them.
RESERVED_KEYS = frozenset({"timestamp", "timestamp_epoch", "importance", "tags"})
_INT64 = (-(2**63), 2**63 - 1)
_TS_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
_INCLUDE = ["distances", "documents", "metadatas"]

Scalar = str | int | float | bool
MetadataValue = Scalar | list[str] | list[int] | list[float] | list[bool]
Result = TypeVar("Result")


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


def parse_chroma_url(url: str) -> tuple[str, int, bool]:
    """``http[s]://host[:port]`` to (host, port, ssl); without a port, the scheme's own."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError("OUTBOX_CHROMA_URL", f"expected http://host:port, got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError("OUTBOX_CHROMA_URL", "a path, query or fragment is not supported")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError("OUTBOX_CHROMA_URL", f"bad port in {url!r}") from None
    ssl = parts.scheme == "https"
    return parts.hostname, port or (443 if ssl else 80), ssl


def has_visible_text(content: str) -> bool:
    """False when every character is whitespace, a control or format character (zero-width
    space, BOM, bidi marks), a lone accent (Mn) or U+FFFD (what a decoding error leaves):
    MiniLM's tokenizer drops all of them, so such content embeds to the vector of the empty
    string, one point shared by every such record, which no query can tell apart."""
    return any(
        unicodedata.category(ch)[0] not in "CZ"
        and unicodedata.category(ch) != "Mn"
        and ch != "\ufffd"
        for ch in content
    )


def vector_problem(vector: Sequence[float]) -> str | None:
    """Why Chroma should not get this vector (a custom embedder's NaN, an all-zero vector)."""
    import numpy as np

    values = np.asarray(vector, dtype=np.float64).ravel()
    if values.size == 0:
        return "the embedding is empty"
    if not np.isfinite(values).all():
        return "the embedding holds NaN or infinity"
    if not values.any():
        return "the embedding is all zeros (no cosine direction)"
    return None


def _metadata_key_ok(key: str) -> bool:
    # Chroma refuses empty keys, keys starting with '#' or '$', and its 'chroma:' keys.
    return bool(key) and key[0] not in "#$" and not key.startswith("chroma:")


def _scalar(value: Any) -> Scalar | None:
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if _INT64[0] <= value <= _INT64[1] else str(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Nested mappings become dotted keys; Chroma takes no nesting."""
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{name}.")
        else:
            yield name, value


def chroma_metadata(record: Record) -> dict[str, MetadataValue]:
    """The record's scalar metadata plus timestamp (text and epoch float), importance, tags.

    Dropped, as Chroma would refuse them: None, empty or mixed-type lists, lists of
    non-scalars, keys it reserves. Integers past 64 bits become text.
    """
    metadata: dict[str, MetadataValue] = {}
    for key, value in _flatten(record.metadata):
        if key in RESERVED_KEYS or not _metadata_key_ok(key):
            continue
        if isinstance(value, list):
            items = [_scalar(item) for item in value]
            kinds = {type(item) for item in items}
            if items and len(kinds) == 1 and None not in items:
                metadata[key] = items  # type: ignore[assignment]
            continue
        scalar = _scalar(value)
        if scalar is not None:
            metadata[key] = scalar
    moment = datetime.strptime(record.timestamp, _TS_FORMAT).replace(tzinfo=UTC)
    metadata["timestamp"] = record.timestamp
    metadata["timestamp_epoch"] = moment.timestamp()
    metadata["importance"] = record.importance
    if record.tags:
        metadata["tags"] = list(record.tags)
    return metadata


class CollectionOps:
    """The Chroma calls the sink makes, by collection name. They run in this process against
    a server, and in the child process (``chroma_local``) against an embedded store."""

    def __init__(self, client: ClientAPI) -> None:
        register_with_chroma()  # chromadb rebuilds a stored embedder even for precomputed writes
        self.client = client
        self._collections: dict[str, Collection] = {}

    def _with(self, name: str, embedding: str, action: Callable[[Collection], Result]) -> Result:
        from chromadb.errors import NotFoundError

        collection = self._collections.get(name)
        if collection is None:
            collection = self.client.get_or_create_collection(
                name,
                embedding_function=None,
                configuration={"hnsw": {"space": "cosine"}},
                metadata={EMBEDDING_KEY: embedding},
            )
            self._collections[name] = collection
        try:
            return action(collection)
        except NotFoundError:  # deleted underneath us: create it again on the next call
            self._collections.pop(name, None)
            raise

    def open(self, name: str, embedding: str) -> tuple[str | None, int]:
        """Which embedder built the collection's vectors, and Chroma's largest batch."""
        metadata = self._with(name, embedding, lambda c: c.metadata) or {}
        built_with = metadata.get(EMBEDDING_KEY)
        limit = self.client.get_max_batch_size()
        return (built_with if isinstance(built_with, str) else None), (limit if limit > 0 else 1000)

    def upsert(
        self,
        name: str,
        embedding: str,
        ids: list[str],
        embeddings: Any,
        documents: list[str],
        metadatas: list[dict[str, MetadataValue]],
    ) -> None:
        self._with(
            name,
            embedding,
            lambda c: c.upsert(
                ids=ids,
                embeddings=embeddings,
                documents=documents,
                metadatas=metadatas,  # type: ignore[arg-type]
            ),
        )

    def query(
        self,
        name: str,
        embedding: str,
        vector: Any,
        n_results: int,
        where: dict[str, Any] | None,
    ) -> dict[str, list[Any]]:
        reply = self._with(
            name,
            embedding,
            lambda c: c.query(
                query_embeddings=[vector],
                n_results=n_results,
                where=where,
                include=_INCLUDE,  # type: ignore[arg-type]
            ),
        )
        return {field: list((reply.get(field) or [[]])[0]) for field in ["ids", *_INCLUDE]}

    def count(self, name: str, embedding: str) -> int:
        return self._with(name, embedding, lambda c: c.count())

    def close(self) -> None:
        self.client.close()


class Backend(Protocol):
    """Where the calls of ``CollectionOps`` run: here (server) or in a child (embedded)."""

    def call(self, op: str, *args: Any) -> Any: ...

    def close(self) -> None: ...


class ServerBackend:
    """A ``chroma run`` server through chromadb's HttpClient, every request time-bounded."""

    def __init__(self, host: str, port: int, ssl: bool, timeout: float) -> None:
        self.host, self.port, self.ssl, self.timeout = host, port, ssl, timeout
        self._ops: CollectionOps | None = None
        self._lock = threading.Lock()

    def _http_timeout(self) -> Any:
        import httpx

        return httpx.Timeout(self.timeout, connect=min(self.timeout, 5.0))

    def _connect(self) -> CollectionOps:
        """A bounded heartbeat first: chromadb's own client sends its first requests with no
        timeout at all, which would hang forever on a frozen server."""
        import chromadb
        import httpx

        scheme = "https" if self.ssl else "http"
        url = f"{scheme}://{self.host}:{self.port}/api/v2/heartbeat"
        httpx.get(url, timeout=self._http_timeout()).raise_for_status()
        client = chromadb.HttpClient(host=self.host, port=self.port, ssl=self.ssl)
        session = getattr(getattr(client, "_server", None), "_session", None)
        if session is None or not hasattr(session, "timeout"):
            log.warning("chromadb client has no session to bound; only the sink timeout applies")
        else:  # chromadb hard-codes httpx.Client(timeout=None)
            session.timeout = self._http_timeout()
        return CollectionOps(client)

    def call(self, op: str, *args: Any) -> Any:
        with self._lock:
            if self._ops is None:
                self._ops = self._connect()
            ops = self._ops
        return getattr(ops, op)(*args)

    def close(self) -> None:
        with self._lock:
            ops, self._ops = self._ops, None
        if ops is not None:
            ops.close()


class ChromaSink:
    """Delivers records to one Chroma collection; ``Delivered.sink_id`` is the record key."""

    # It serves meaning-based recall: records it holds leave the lexical pending overlay.
    semantic = True

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

    def _open(self) -> tuple[Backend, str, int]:
        """The backend, the embedder's name and the batch limit; the first call opens the
        collection and checks it was built by the same embedder (other vector sizes would
        fail every record)."""
        with self._lock:
            if self._backend is None:
                if self.server is not None:
                    self._backend = ServerBackend(*self.server, timeout=self.timeout)
                else:
                    from outbox.sinks.chroma_local import LocalBackend

                    assert self.path is not None
                    self._backend = LocalBackend(self.path, timeout=self.timeout)
            backend, max_batch = self._backend, self._max_batch
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
        """Embed and upsert ``batch``; per-record refusals come back as ``Rejected``."""
        if not batch:
            return []
        import numpy as np

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
        if todo:
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
            for start in range(0, len(ready), step):
                chunk = ready[start : start + step]
                self._call(
                    "upsert",
                    [record.key for record, _ in chunk],
                    np.asarray([vector for _, vector in chunk], dtype=np.float32),
                    [record.content for record, _ in chunk],
                    [chroma_metadata(record) for record, _ in chunk],
                )
                for record, _ in chunk:
                    outcomes[record.key] = Delivered(record.key)
        delivered = sum(isinstance(outcome, Delivered) for outcome in outcomes.values())
        log.debug("%s: %d of %d records delivered", self.name, delivered, len(outcomes))
        return [outcomes[record.key] for record in batch]

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
