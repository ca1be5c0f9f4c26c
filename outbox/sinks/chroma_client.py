"""Talking to Chroma: the collection calls the sink makes, where they run (a ``chroma run``
server from here, or an embedded store in a child process), and what chromadb's and httpx's
exceptions mean for a delivery.

chromadb and httpx load only inside these functions, in the processes that talk to Chroma.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

from outbox.core.errors import ConfigError
from outbox.core.states import FailureReason
from outbox.sinks.base import Permanent, Transient, describe
from outbox.sinks.chroma_documents import MetadataValue
from outbox.sinks.embedding import builtin_name, load_embedding, register_with_chroma

if TYPE_CHECKING:
    from chromadb.api import ClientAPI
    from chromadb.api.models.Collection import Collection

log = logging.getLogger(__name__)

EMBEDDING_KEY = "outbox_embedding"  # collection metadata: which embedder built its vectors
_INCLUDE = ["distances", "documents", "metadatas"]
_NEAREST = ["distances"]  # what recall's vector leg reads
# chromadb's refusals of what was sent: the same records would be refused again.
_REFUSALS = ("InvalidArgumentError", "DuplicateIDError", "InvalidDimensionException")
# chromadb reports SQLite trouble of the embedded store only in an error's text.
_STORE_WORDING = (
    (FailureReason.READONLY, ("readonly database", "read-only")),
    (FailureReason.DB_BUSY, ("database is locked", "database is busy", "sqlite_busy")),
    (FailureReason.TIMEOUT, ("timed out", "timeout")),
)
# httpx's errors that mean the server's connection is gone.
_TRANSPORT = ("ConnectError", "ReadError", "WriteError", "RemoteProtocolError")
_TIMEOUT_STATUS = frozenset({408, 504})
Result = TypeVar("Result")


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


def chroma_failure(exc: BaseException) -> Transient | Permanent | None:
    """What a chromadb or httpx exception means for the records; None for any other.

    Only modules already loaded are consulted: an exception of a module this process never
    imported cannot be one of its classes, so classifying never loads chromadb.
    """
    errors = sys.modules.get("chromadb.errors")
    if errors is not None and isinstance(exc, errors.ChromaError):
        if any(isinstance(exc, getattr(errors, name)) for name in _REFUSALS):
            return Permanent(describe(exc), FailureReason.REJECTED)
        text = str(exc).lower()
        for reason, phrases in _STORE_WORDING:
            if any(phrase in text for phrase in phrases):
                return Transient(describe(exc), reason)
        return Transient(describe(exc), FailureReason.UNKNOWN)
    httpx = sys.modules.get("httpx")
    if httpx is not None and isinstance(exc, httpx.HTTPError):
        return _http_failure(exc, httpx)
    if isinstance(exc, ValueError) and "could not connect to a chroma server" in str(exc).lower():
        # chromadb.HttpClient's own heartbeat, when the server went away after ours.
        return Transient(describe(exc), FailureReason.TRANSPORT_CLOSED)
    return None


def _http_failure(exc: BaseException, httpx: Any) -> Transient | None:
    if isinstance(exc, httpx.TimeoutException):
        return Transient(describe(exc), FailureReason.TIMEOUT)
    if any(isinstance(exc, getattr(httpx, name)) for name in _TRANSPORT):
        return Transient(describe(exc), FailureReason.TRANSPORT_CLOSED)
    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in _TIMEOUT_STATUS:
        return Transient(describe(exc), FailureReason.TIMEOUT)
    return None


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
        """The ``n_results`` documents nearest ``vector``: ids, distances, texts, metadata."""
        return self._query(name, embedding, vector, n_results, where, _INCLUDE)

    def nearest(
        self,
        name: str,
        embedding: str,
        vector: Any,
        n_results: int,
        where: dict[str, Any] | None,
    ) -> dict[str, list[Any]]:
        """``query`` with ids and distances alone, all recall reads: Chroma's fetch of the
        documents and metadata is a third of its query's time on a small collection."""
        return self._query(name, embedding, vector, n_results, where, _NEAREST)

    def query_text(
        self,
        name: str,
        embedding: str,
        spec: str,
        text: str,
        n_results: int,
        where: dict[str, Any] | None,
    ) -> dict[str, list[Any]]:
        """``query`` for a text, embedded here by the built-in embedder ``spec``: the shared
        server keeps the model loaded, so a short-lived caller (``outbox search``) loads
        neither the model nor numpy. Only built-ins: no caller names a module to import."""
        vector = _text_vector(spec, embedding, text)
        return self._query(name, embedding, vector, n_results, where, _INCLUDE)

    def nearest_text(
        self,
        name: str,
        embedding: str,
        spec: str,
        text: str,
        n_results: int,
        where: dict[str, Any] | None,
    ) -> dict[str, list[Any]]:
        """``nearest`` for a text, embedded as ``query_text`` embeds it."""
        vector = _text_vector(spec, embedding, text)
        return self._query(name, embedding, vector, n_results, where, _NEAREST)

    def _query(
        self,
        name: str,
        embedding: str,
        vector: Any,
        n_results: int,
        where: dict[str, Any] | None,
        include: list[str],
    ) -> dict[str, list[Any]]:
        reply: dict[str, Any] = dict(
            self._with(
                name,
                embedding,
                lambda c: c.query(
                    query_embeddings=[vector],
                    n_results=n_results,
                    where=where,
                    include=include,  # type: ignore[arg-type]
                ),
            )
        )
        return {field: list((reply.get(field) or [[]])[0]) for field in ["ids", *include]}

    def count(self, name: str, embedding: str) -> int:
        return self._with(name, embedding, lambda c: c.count())

    def delete(self, name: str, embedding: str, ids: list[str]) -> None:
        """Remove these documents; an id the collection does not hold is no error."""
        self._with(name, embedding, lambda c: c.delete(ids=ids))

    def drop(self, name: str, embedding: str) -> bool:
        """Delete collection ``name`` (an index a reindex replaced); False when it was not
        there. ``embedding`` is unused: every operation takes the same leading arguments."""
        from chromadb.errors import NotFoundError

        self._collections.pop(name, None)
        try:
            self.client.delete_collection(name)
        except NotFoundError:
            return False
        return True

    def close(self) -> None:
        close = getattr(self.client, "close", None)  # on chromadb's Client, not its ClientAPI
        if close is not None:
            close()


def _text_vector(spec: str, embedding: str, text: str) -> Any:
    """The query vector of ``text`` from the built-in embedder ``spec``, which must be the
    one named ``embedding`` (the collection's)."""
    if builtin_name(spec) != embedding:
        raise ValueError(f"{spec!r} is not the built-in embedder {embedding!r}")
    embedder = load_embedding(spec)
    (vector,) = getattr(embedder, "embed_query", embedder)([text])
    return vector


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
