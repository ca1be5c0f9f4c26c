"""The BrainLayer sink over MCP: ``OUTBOX_BRAINLAYER_MCP`` is a command line that starts a stdio
MCP server with a ``brain_store`` tool, and each record is one call of it.

The server mints the id and stamps its own time; a repeat is caught by BrainLayer's
content-hash dedupe, which returns the first id again. Tool results are read here into
outcomes (statuses of BrainLayer 1.5.x); ``brainlayer_errors`` reads BrainLayer's failures.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from outbox.core.config import Settings
from outbox.core.record import Record
from outbox.core.states import FailureReason
from outbox.sinks.base import (
    Deleted,
    DeleteOutcome,
    Delivered,
    Held,
    NotDelivered,
    Outcome,
    Permanent,
    Transient,
)
from outbox.sinks.brainlayer import (
    SINK_NAME,
    BrainLayerMissing,
    memory_type_of,
    project_of,
    provenance_of,
)
from outbox.sinks.brainlayer_errors import deferred, failure_of, refused, safe_text

if TYPE_CHECKING:
    from outbox.sinks.mcp_client import StdioMcpClient

# How much of the dispatcher's hard timeout the MCP mode spends on calls, so it answers
# (with per-record timeouts) before the dispatcher has to abandon it mid-call.
_MCP_CALL_SHARE = 0.8
# Starting a Python MCP server imports a large package; a tight call timeout must not make
# startup impossible on a busy machine.
_MCP_MIN_START_TIMEOUT = 15.0
_DELIVERED_STATUSES = frozenset({"", "STORED", "DUPLICATE", "MERGED"})
# Failures after which the rest of the batch would fare the same.
_BATCH_ENDING = frozenset({FailureReason.TIMEOUT, FailureReason.TRANSPORT_CLOSED})


# The tool that exposes BrainLayer's gated tools (brain_archive among them) to a session.
_EXPAND = "expand_palette"


class BrainLayerMcpSink:
    """Delivery through an MCP server's ``brain_store`` tool, one server per sink object.

    The server is started when the sink is made (outside the dispatcher's per-call clock)
    and restarted on the next batch after its transport failed. Every call has a timeout,
    and a batch spends at most ``_MCP_CALL_SHARE`` of ``OUTBOX_SINK_TIMEOUT`` on calls.
    """

    semantic: bool = False  # BrainLayer is a memory store, not the vector index recall uses

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
        ``timestamp`` gets the record's canonical timestamp, and one that declares
        ``fallback_source_path`` and ``replayed_by`` a replayed file's provenance
        (BrainLayer 1.5.78's ``brain_store`` declares neither: its in-process path takes them).
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
            **provenance_of(record),
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
            try:
                if remaining <= 0:
                    raise Transient(
                        f"brain_store batch budget of {self.call_budget:g}s spent",
                        FailureReason.TIMEOUT,
                    )
                result = client.call("brain_store", self.arguments(record, declared), remaining)
            except Transient as exc:
                if exc.reason not in _BATCH_ENDING:
                    outcomes.append(exc)
                    continue
                if exc.reason is FailureReason.TRANSPORT_CLOSED:
                    self.close()
                outcomes.extend([exc] * (len(batch) - index))
                break
            except Exception as exc:
                outcomes.append(failure_of(exc, record))
                continue
            outcomes.append(reply_outcome(result, record))
        return outcomes

    def delete(self, items: Sequence[Held]) -> list[DeleteOutcome]:
        """``brain_archive`` each forgotten chunk, by the id the server gave it: the one
        removal BrainLayer's MCP tools offer. It hides the chunk from search and drops its
        vectors; the row itself stays in BrainLayer's database (docs/sinks.md says so)."""
        deadline = time.monotonic() + self.call_budget
        self.connect(min(self.start_timeout, self.call_budget))
        client = self._client
        assert client is not None
        outcomes: list[DeleteOutcome] = []
        for item in items:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcomes.append(
                    Transient(
                        f"brain_archive budget of {self.call_budget:g}s spent",
                        FailureReason.TIMEOUT,
                    )
                )
            elif item.sink_id is None:
                # The server minted the id and its delivery row is gone: nothing to name.
                outcomes.append(
                    Permanent(
                        "BrainLayer's id for this record is not known here (its delivery "
                        "row was pruned); archive it in BrainLayer by hand",
                        FailureReason.REJECTED,
                    )
                )
            else:
                outcomes.append(self._archive(client, item, remaining))
        return outcomes

    def _archive(self, client: StdioMcpClient, item: Held, remaining: float) -> DeleteOutcome:
        arguments = {"chunk_id": item.sink_id}
        try:
            result = client.call("brain_archive", arguments, remaining)
            if getattr(result, "is_error", False) and _EXPAND in _text_of(result):
                # BrainLayer's core profile gates brain_archive until the palette grows.
                client.call(_EXPAND, {}, remaining)
                result = client.call("brain_archive", arguments, remaining)
        except Exception as exc:
            return exc
        text = _text_of(result)
        if getattr(result, "is_error", False) and "not found" not in text.lower():
            return Transient(f"brain_archive failed: {text[:200]}", FailureReason.UNKNOWN)
        return Deleted(item.key)  # archived, or BrainLayer no longer has it

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


def reply_outcome(result: Any, record: Record) -> Outcome:
    """A ``brain_store`` tool result as an outcome.

    Tool errors: "✖ REJECTED" and schema validation failures are permanent; anything else
    ("✖ ERROR … Retry once", a handler exception) is retried. Results: STORED, DUPLICATE,
    MERGED, or no status at all (servers before the status field), each with a chunk id,
    are deliveries; DEFERRED is not (the write sits in BrainLayer's queue, not its database).
    """
    text = _text_of(result)
    if getattr(result, "is_error", False):
        summary = safe_text(text.split(" ─ ", 1)[0].strip(), record) or "brain_store failed"
        if text.startswith("✖ REJECTED") or text.startswith("Input validation error"):
            return refused(summary)
        return NotDelivered(f"brain_store did not store it: {summary}", FailureReason.UNKNOWN)
    data = result.structured_content if isinstance(result.structured_content, dict) else {}
    status = str(data.get("status") or "").upper()
    chunk_id = data.get("chunk_id")
    if status == "DEFERRED" or data.get("queued"):
        details = data.get("deferred")
        why = details.get("reason") if isinstance(details, dict) else None
        return deferred(str(why or "unknown reason"))
    if isinstance(chunk_id, str) and chunk_id and status in _DELIVERED_STATUSES:
        return Delivered(chunk_id)
    return NotDelivered(f"brain_store answered {status or 'no status'} without a chunk id")
