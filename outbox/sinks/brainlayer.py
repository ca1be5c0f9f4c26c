"""The BrainLayer sink: each record becomes one BrainLayer memory, under an id BrainLayer reports.

Two modes, chosen by settings:

- **In process** (default). BrainLayer's own Python store path: ``open_writer_store`` and
  ``store_memory(embed_fn=None, …)`` on ``OUTBOX_BRAINLAYER_DB`` (else BrainLayer's own
  default path). The record keeps its identity there: the chunk id is derived from the record
  key (``chunk_id_for``) and ``created_at`` is the record's canonical timestamp, so a repeat
  delivery is BrainLayer's DUPLICATE, never a second memory. The writer is opened per batch
  and closed after it, because BrainLayer allows one writer process per database: holding it
  between batches would lock out a BrainLayer MCP server or any other writer.
- **MCP** (``OUTBOX_BRAINLAYER_MCP`` = a command line that starts a stdio MCP server with a
  ``brain_store`` tool). The server mints the id and stamps its own time; a repeat is caught
  by BrainLayer's content-hash dedupe, which returns the first id again.

Outcomes, both modes: STORED, DUPLICATE and MERGED with a chunk id are deliveries. A busy or
locked database, another writer, an unusable schema, and DEFERRED (queued inside BrainLayer,
not yet in its database) are transient (``db_busy``, or ``queued_null_chunk`` when queued
for another reason). Content BrainLayer refuses is ``Rejected`` for good. A reply without a
concrete chunk id is never a delivery. The markdown front matter's ``chunk_id`` is filled
from the delivered row by the mirror code, not here.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from outbox.config import Settings
from outbox.dispatch.classify import DB_BUSY, QUEUED_NULL_CHUNK, UNKNOWN
from outbox.record import Record
from outbox.sinks.base import Delivered, NotDelivered, Outcome, Rejected

if TYPE_CHECKING:
    from outbox.sinks.mcp_client import StdioMcpClient

log = logging.getLogger(__name__)

SINK_NAME = "brainlayer"
BRAINLAYER_VERSION = "1.5.78"
INSTALL_HINT = (
    f"pip install --no-deps brainlayer=={BRAINLAYER_VERSION} "
    "&& pip install apsw sqlite-vec abydos numpy orjson pyyaml"
)
DEFAULT_MEMORY_TYPE = "note"
DELIVERED_OUTCOMES = frozenset({"stored", "duplicate", "merged"})
# DEFERRED reasons that mean "the database could not take it now"; any other reason means
# "queued behind other work": both are retried, under different front-matter reasons.
_BUSY_DEFERRALS = frozenset({"DB_BUSY", "SCHEMA_FINGERPRINT_MISMATCH"})
# How much of the dispatcher's hard timeout the MCP mode spends on calls, so it answers
# (with per-record timeouts) before the dispatcher has to abandon it mid-call.
_MCP_CALL_SHARE = 0.8
# Starting a Python MCP server imports a large package; a tight call timeout must not make
# startup impossible on a busy machine.
_MCP_MIN_START_TIMEOUT = 15.0
# Characters of the content that, found in an error text, mean the text quotes the memory.
_QUOTE_PROBE = 32


class BrainLayerMissing(ImportError):
    """The brainlayer package (or a module its store path needs) is not installed.

    An ImportError, not a ValueError: the dispatcher retries it, so records wait for the
    install instead of being dead-lettered.
    """


def chunk_id_for(key: str) -> str:
    """The BrainLayer chunk id of a record: ``"manual-" + key[:16]``.

    That is exactly the shape BrainLayer mints for its own manual memories (``manual-`` and
    16 lowercase hex), so every BrainLayer tool treats it as one of its own. 64 bits of the
    key keep ids of different records apart (a clash needs about 4 billion records), and
    equal keys (same content, same instant) give equal ids, so a repeat is a DUPLICATE.
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


def safe_text(text: str, record: Record) -> str:
    """``text`` unless it quotes the record's content; error texts end up in logs."""
    probe = record.content.strip()[:_QUOTE_PROBE]
    if probe and probe in text:
        return "(details withheld: they quote the memory)"
    return text


def _scrubbed(exc: BaseException, record: Record) -> BaseException:
    """``exc`` itself unless its text quotes the memory, else a stand-in that does not."""
    if safe_text(str(exc), record) == str(exc):
        return exc
    return RuntimeError(f"BrainLayer failed with {type(exc).__name__} (details withheld)")


@dataclass(frozen=True)
class _Api:
    """The BrainLayer names the in-process mode uses, imported once."""

    open_writer_store: Any
    store_memory: Any
    vector_store: Any
    busy_timeout: Any
    default_db_path: Any
    memory_types: frozenset[str]


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
        deadline = time.monotonic() + self.busy_timeout
        self._bootstrap(deadline)
        with self._api.busy_timeout(self._remaining_ms(deadline), deadline=deadline):
            return self._api.open_writer_store(self.db_path)

    def _store(self, store: Any, record: Record) -> dict[str, Any]:
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
        )
        return result

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        """Store each record; a lock error stops the batch (the rest would wait as long).

        Opening the writer can fail for the whole batch (another writer holds it, the
        database is locked or has a schema BrainLayer will not write): that is raised, and
        the dispatcher retries the batch.
        """
        store = self._open()
        outcomes: list[Outcome] = []
        try:
            for index, record in enumerate(batch):
                try:
                    result = self._store(store, record)
                except ValueError as exc:  # BrainLayer's content gates: nothing was written
                    reason = safe_text(str(exc), record)
                    outcomes.append(Rejected(f"BrainLayer refused it: {reason}"))
                    continue
                except Exception as exc:
                    if _is_lock_error(exc):
                        outcomes.extend([exc] * (len(batch) - index))
                        break
                    outcomes.append(_scrubbed(exc, record))
                    continue
                outcomes.append(_outcome(result))
        finally:
            _close_store(store)
        return outcomes

    def close(self) -> None:
        """Nothing is held between batches."""


def _is_lock_error(exc: BaseException) -> bool:
    """A busy/locked database or a writer held elsewhere: a wait, not a fault of this record."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"BusyError", "LockedError", "WriterInUseError"}) or (
        "locked" in str(exc).lower()
    )


def _outcome(result: Mapping[str, Any]) -> Outcome:
    """``store_memory``'s reply as an outcome: a delivery only with a concrete chunk id."""
    chunk_id = result.get("id")
    # Releases before the outcome field returned only after COMMIT: that was a store.
    outcome = str(result.get("outcome") or "stored").lower()
    if isinstance(chunk_id, str) and chunk_id and outcome in DELIVERED_OUTCOMES:
        return Delivered(chunk_id)
    return NotDelivered(
        f"BrainLayer answered {outcome} without a stored chunk id", reason=QUEUED_NULL_CHUNK
    )


class BrainLayerMcpSink:
    """Delivery through an MCP server's ``brain_store`` tool, one server per sink object.

    The server is started when the sink is made (outside the dispatcher's per-call clock)
    and restarted on the next batch after its transport failed. Every call has a timeout,
    and a batch spends at most ``_MCP_CALL_SHARE`` of ``OUTBOX_SINK_TIMEOUT`` on calls.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        call_budget: float,
        start_timeout: float,
        name: str = SINK_NAME,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.call_budget = call_budget
        self.start_timeout = start_timeout
        self._client: StdioMcpClient | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> BrainLayerMcpSink:
        """Make the sink and start its server now, before the dispatcher's clock runs."""
        sink = cls(
            shlex.split(settings.brainlayer_mcp or ""),
            call_budget=max(0.1, settings.sink_timeout * _MCP_CALL_SHARE),
            start_timeout=max(settings.sink_timeout, _MCP_MIN_START_TIMEOUT),
        )
        sink.connect(sink.start_timeout)
        return sink

    def connect(self, timeout: float) -> None:
        """Start the server and check it has ``brain_store`` (no-op while one is alive)."""
        if self._client is not None and self._client.alive:
            return
        self.close()
        try:
            from outbox.sinks.mcp_client import StdioMcpClient
        except ModuleNotFoundError:
            raise BrainLayerMissing(
                "the BrainLayer MCP mode needs the mcp package: pip install 'mcp>=2,<3'"
            ) from None
        client = StdioMcpClient(self.argv)
        client.start(timeout)
        if client.input_properties("brain_store") is None:
            client.close()
            raise RuntimeError(f"the MCP server {self.argv[0]!r} lists no brain_store tool")
        self._client = client

    def arguments(self, record: Record, declared: Mapping[str, Any]) -> dict[str, Any]:
        """``brain_store`` arguments, only those the tool declares (plus ``content``).

        ``type`` is checked against the tool's own enum, so a record whose metadata names a
        type the server does not know is stored as a note rather than refused. BrainLayer's
        tool has no timestamp argument; a server whose tool declares ``created_at`` or
        ``timestamp`` gets the record's canonical timestamp.
        """
        type_schema = declared.get("type")
        enum = type_schema.get("enum") if isinstance(type_schema, dict) else None
        arguments: dict[str, Any] = {"content": record.content}
        optional = {
            "tags": list(record.tags) or None,
            "importance": record.importance,
            "type": memory_type_of(record, frozenset(enum) if enum else None),
            "project": project_of(record),
            "created_at": record.timestamp,
            "timestamp": record.timestamp,
        }
        for name, value in optional.items():
            if name in declared and value is not None:
                arguments[name] = value
        return arguments

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        """Call ``brain_store`` per record until the batch's time budget is spent.

        A timeout or a closed transport ends the batch: the same fate awaits the rest. After
        a closed transport the server is restarted on the next batch, and a write that did
        land before the close comes back as BrainLayer's DUPLICATE with the same id.
        """
        deadline = time.monotonic() + self.call_budget
        self.connect(min(self.start_timeout, self.call_budget))
        client = self._client
        assert client is not None
        declared = client.input_properties("brain_store") or {}
        outcomes: list[Outcome] = []
        for index, record in enumerate(batch):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcomes.extend(
                    [TimeoutError(f"brain_store batch budget of {self.call_budget:g}s spent")]
                    * (len(batch) - index)
                )
                break
            try:
                result = client.call("brain_store", self.arguments(record, declared), remaining)
            except (TimeoutError, ConnectionError) as exc:
                if isinstance(exc, ConnectionError):
                    self.close()
                outcomes.extend([exc] * (len(batch) - index))
                break
            except Exception as exc:
                outcomes.append(_scrubbed(exc, record))
                continue
            outcomes.append(_mcp_outcome(result, record))
        return outcomes

    def close(self) -> None:
        """Stop the server process and the client's loop thread."""
        client, self._client = self._client, None
        if client is not None:
            client.close()


def _text_of(result: Any) -> str:
    for block in getattr(result, "content", None) or []:
        text = getattr(block, "text", None)
        if isinstance(text, str):
            return text
    return ""


def _mcp_outcome(result: Any, record: Record) -> Outcome:
    """A ``brain_store`` tool result as an outcome (statuses of BrainLayer 1.5.x).

    Tool errors: "✖ REJECTED" and schema validation failures are permanent; anything else
    ("✖ ERROR … Retry once", a handler exception) is retried. Results: STORED, DUPLICATE,
    MERGED, or no status at all (servers before the status field), each with a chunk id,
    are deliveries; DEFERRED is not (the write sits in BrainLayer's queue, not its database).
    """
    text = _text_of(result)
    if getattr(result, "is_error", False):
        summary = safe_text(text.split(" ─ ", 1)[0].strip(), record) or "brain_store failed"
        if text.startswith("✖ REJECTED") or text.startswith("Input validation error"):
            return Rejected(f"BrainLayer refused it: {summary}")
        return NotDelivered(f"brain_store did not store it: {summary}", reason=UNKNOWN)
    data = result.structured_content if isinstance(result.structured_content, dict) else {}
    status = str(data.get("status") or "").upper()
    chunk_id = data.get("chunk_id")
    if status == "DEFERRED" or data.get("queued"):
        deferred = data.get("deferred") if isinstance(data.get("deferred"), dict) else {}
        why = str(deferred.get("reason") or "unknown reason")
        reason = DB_BUSY if why in _BUSY_DEFERRALS else QUEUED_NULL_CHUNK
        return NotDelivered(f"brain_store deferred it ({why}): queued, not stored", reason=reason)
    if isinstance(chunk_id, str) and chunk_id and status in {"", "STORED", "DUPLICATE", "MERGED"}:
        return Delivered(chunk_id)
    return NotDelivered(
        f"brain_store answered {status or 'no status'} without a chunk id",
        reason=QUEUED_NULL_CHUNK,
    )
