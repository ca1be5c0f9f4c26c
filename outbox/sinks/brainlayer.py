"""The BrainLayer sink: each record becomes one BrainLayer memory, under an id BrainLayer reports.

Two modes, chosen by settings:

- **In process** (default, here). BrainLayer's own Python store path: ``open_writer_store``
  and ``store_memory(embed_fn=None, …)`` on ``OUTBOX_BRAINLAYER_DB`` (else BrainLayer's own
  default path). The record keeps its identity there: the chunk id is derived from the record
  key (``chunk_id_for``) and ``created_at`` is the record's canonical timestamp, so a repeat
  delivery is BrainLayer's DUPLICATE, never a second memory. The writer is opened per batch
  and closed after it, because BrainLayer allows one writer process per database: holding it
  between batches would lock out a BrainLayer MCP server or any other writer.
- **MCP** (``OUTBOX_BRAINLAYER_MCP``): see ``brainlayer_mcp``.

Outcomes, both modes: STORED, DUPLICATE and MERGED with a chunk id are deliveries. A busy or
locked database, another writer, an unusable schema, and DEFERRED (queued inside BrainLayer,
not yet in its database) are ``Transient`` (``db_busy``, or ``queued_null_chunk`` when queued
for another reason). Content BrainLayer refuses is ``Rejected`` for good. A reply without a
concrete chunk id is never a delivery. ``brainlayer_errors`` reads BrainLayer's failures.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from outbox.core.config import Settings
from outbox.core.record import FALLBACK_SOURCE_PATH, REPLAYED_BY, Record
from outbox.sinks.base import Deleted, DeleteOutcome, Held, Outcome
from outbox.sinks.brainlayer_errors import (
    failure_of,
    is_lock_error,
    refused,
    safe_text,
    store_outcome,
)

if TYPE_CHECKING:
    from outbox.sinks.brainlayer_mcp import BrainLayerMcpSink

log = logging.getLogger(__name__)

SINK_NAME = "brainlayer"
BRAINLAYER_VERSION = "1.5.78"
INSTALL_HINT = (
    f"pip install --no-deps brainlayer=={BRAINLAYER_VERSION} "
    "&& pip install apsw sqlite-vec abydos numpy orjson pyyaml"
)
DEFAULT_MEMORY_TYPE = "note"


# Where BrainLayer keeps a chunk's vectors, when its schema has them.
_VECTOR_TABLES = frozenset({"chunk_vectors", "chunk_vectors_binary"})
_TABLES = "SELECT name FROM sqlite_master WHERE type = 'table'"


class BrainLayerMissing(ImportError):
    """The brainlayer package (or a module its store path needs) is not installed.

    An ImportError, not a ValueError: the dispatcher retries it, so records wait for the
    install instead of being dead-lettered.
    """


def chunk_id_for(key: str) -> str:
    """The BrainLayer chunk id of a record: ``"manual-"`` and the key's first 16 hex digits.

    That is exactly the shape BrainLayer mints for its own manual memories, so every
    BrainLayer tool treats it as one of its own. That much of the key keeps ids of different
    records apart, and equal keys (same content, same instant) give equal ids, so a repeat
    is a DUPLICATE.
    """
    return f"manual-{key[:16]}"


def memory_type_of(record: Record, valid: frozenset[str] | None = None) -> str:
    """BrainLayer's ``type`` for a record: ``metadata["type"]`` when BrainLayer knows it."""
    wanted = record.metadata.get("type")
    if isinstance(wanted, str) and (valid is None or wanted in valid):
        return wanted
    return DEFAULT_MEMORY_TYPE


def project_of(record: Record) -> str | None:
    """BrainLayer's ``project`` for a record: ``metadata["project"]`` when it is text."""
    project = record.metadata.get("project")
    return project if isinstance(project, str) and project.strip() else None


def provenance_of(record: Record) -> dict[str, str]:
    """Where a replayed fallback file was and what replayed it (``outbox replay`` puts both
    in the metadata), under the names BrainLayer's own replay gives them; empty otherwise."""
    found = {name: record.metadata.get(name) for name in (FALLBACK_SOURCE_PATH, REPLAYED_BY)}
    return {name: value for name, value in found.items() if isinstance(value, str) and value}


@dataclass(frozen=True)
class _Api:
    """The BrainLayer names the in-process mode uses, imported once."""

    open_writer_store: Any
    store_memory: Any
    vector_store: Any
    busy_timeout: Any
    default_db_path: Any
    memory_types: frozenset[str]
    takes_provenance: bool  # store_memory has fallback_source_path and replayed_by


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or name
        raise BrainLayerMissing(
            f"the BrainLayer sink needs {missing!r}, which is not installed: {INSTALL_HINT}"
        ) from None


def load_api() -> _Api:
    """Import BrainLayer's store path lazily: only processes that deliver to it pay."""
    runtime = _import("brainlayer.runtime_store")
    store = _import("brainlayer.store")
    vector_store = _import("brainlayer.vector_store")
    paths = _import("brainlayer.paths")
    memory_types = _import("brainlayer.memory_types")
    return _Api(
        open_writer_store=runtime.open_writer_store,
        store_memory=store.store_memory,
        vector_store=vector_store.VectorStore,
        busy_timeout=vector_store.temporary_write_busy_timeout_ms,
        default_db_path=paths.get_db_path,
        memory_types=frozenset(memory_types.VALID_MEMORY_TYPES),
        takes_provenance={FALLBACK_SOURCE_PATH, REPLAYED_BY}
        <= set(inspect.signature(store.store_memory).parameters),
    )


def _close_store(store: Any) -> None:
    """Close a BrainLayer store and drop the exit hook its open registered.

    Every writer open registers ``atexit`` to release its pidfile; closing releases it but
    leaves the hook, which keeps the closed store alive until the process exits. One store
    per batch would make a long-running dispatcher grow without bound.
    """
    try:
        store.close()
    finally:
        release = getattr(store, "_release_writer_pidfile", None)
        if release is not None:
            atexit.unregister(release)


class BrainLayerSink:
    """In-process delivery through BrainLayer's own store path (see the module docstring)."""

    semantic: bool = False  # BrainLayer is a memory store, not the vector index recall uses

    def __init__(
        self,
        db_path: Path | None = None,
        *,
        busy_timeout: float = 5.0,
        name: str = SINK_NAME,
    ) -> None:
        self.name = name
        self.busy_timeout = busy_timeout
        self._api = load_api()
        self.db_path = Path(db_path) if db_path is not None else Path(self._api.default_db_path())

    @classmethod
    def from_settings(cls, settings: Settings) -> BrainLayerSink | BrainLayerMcpSink:
        """The in-process sink, or the MCP one when ``OUTBOX_BRAINLAYER_MCP`` is set.

        The wait for a locked BrainLayer database is ``OUTBOX_BUSY_TIMEOUT``, the same bound
        the outbox puts on its own database.
        """
        if settings.brainlayer_mcp:
            from outbox.sinks.brainlayer_mcp import BrainLayerMcpSink

            return BrainLayerMcpSink.from_settings(settings)
        return cls(settings.brainlayer_db, busy_timeout=settings.busy_timeout)

    def _bootstrap(self, deadline: float) -> None:
        """Create a missing database the way BrainLayer supports: its migrating store.

        The runtime writer never creates or migrates a schema; without this a fresh install
        would refuse every write with a schema mismatch.
        """
        if self.db_path.exists():
            return
        log.info("creating the BrainLayer database at %s", self.db_path)
        with self._api.busy_timeout(self._remaining_ms(deadline), deadline=deadline):
            _close_store(self._api.vector_store(self.db_path))

    @staticmethod
    def _remaining_ms(deadline: float) -> int:
        return max(1, int((deadline - time.monotonic()) * 1000))

    def _open(self) -> Any:
        """BrainLayer's writer, or ``Transient``/``Permanent`` for the whole batch (another
        writer holds it, the database is locked or has a schema BrainLayer will not write)."""
        deadline = time.monotonic() + self.busy_timeout
        try:
            self._bootstrap(deadline)
            with self._api.busy_timeout(self._remaining_ms(deadline), deadline=deadline):
                return self._api.open_writer_store(self.db_path)
        except Exception as exc:
            failure = failure_of(exc)
            if failure is exc:
                raise
            raise failure from exc

    def _store(self, store: Any, record: Record) -> Outcome:
        provenance = provenance_of(record) if self._api.takes_provenance else {}
        result: dict[str, Any] = self._api.store_memory(
            store,
            None,
            content=record.content,
            memory_type=memory_type_of(record, self._api.memory_types),
            project=project_of(record),
            tags=list(record.tags) or None,
            importance=record.importance,
            chunk_id=chunk_id_for(record.key),
            created_at=record.timestamp,
            busy_deadline=time.monotonic() + self.busy_timeout,
            **provenance,
        )
        return store_outcome(result)

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        """Store each record; a lock error stops the batch (the rest would wait as long)."""
        store = self._open()
        outcomes: list[Outcome] = []
        try:
            for index, record in enumerate(batch):
                try:
                    outcomes.append(self._store(store, record))
                except ValueError as exc:  # BrainLayer's content gates: nothing was written
                    outcomes.append(refused(safe_text(str(exc), record)))
                except Exception as exc:
                    failure = failure_of(exc, record)
                    if is_lock_error(exc):
                        outcomes.extend([failure] * (len(batch) - index))
                        break
                    outcomes.append(failure)
        finally:
            _close_store(store)
        return outcomes

    def delete(self, items: Sequence[Held]) -> list[DeleteOutcome]:
        """Remove forgotten records for good: the chunk row (BrainLayer's triggers take its
        search rows with it) and its vectors. BrainLayer's own ``archive`` would only hide it."""
        store = self._open()
        try:
            cursor = store.conn.cursor()
            tables = {str(row[0]) for row in cursor.execute(_TABLES)}
            with store.conn:  # one transaction for the batch
                for item in items:
                    chunk_id = item.sink_id or chunk_id_for(item.key)
                    for table in _VECTOR_TABLES & tables:
                        cursor.execute(f"DELETE FROM {table} WHERE chunk_id = ?", (chunk_id,))
                    cursor.execute("DELETE FROM chunks WHERE id = ?", (chunk_id,))
        except Exception as exc:
            failure = failure_of(exc)
            if failure is exc:
                raise
            raise failure from exc
        finally:
            _close_store(store)
        return [Deleted(item.key) for item in items]

    def close(self) -> None:
        """Nothing is held between batches."""
