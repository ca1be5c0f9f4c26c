"""``outbox mcp``: memory-core's tools for any MCP client, over stdio.

Tool arguments keep neo.mjs's names (``prompt``, ``sessionId``, ``nResults``…) and
``brain_store`` takes BrainLayer's input schema, so agents switch without edits. An accepted
write never comes back as an error envelope; invalid input is a tool error with one line.
Calls run in worker threads so a slow database never stalls the protocol loop.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import anyio
import mcp_types as types
import pydantic
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

from outbox import __version__
from outbox.core.errors import OutboxError, ValidationError
from outbox.core.states import BuiltinSink, ReceiptStatus
from outbox.memory_core import MemoryService

log = logging.getLogger(__name__)

_STRING = {"type": "string"}
_READ_ONLY = types.ToolAnnotations(read_only_hint=True)

TOOLS: list[types.Tool] = [
    types.Tool(
        name="add_memory",
        description=(
            "Save this turn (prompt, thought, response) as a memory. Returns at once once the "
            "write is durable; query_recent_turns sees it immediately."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "prompt": {"type": "string", "description": "the user's verbatim prompt"},
                "thought": {"type": "string", "description": "the agent's reasoning"},
                "response": {"type": "string", "description": "the final response"},
                "sessionId": _STRING,
                "agent": _STRING,
                "model": _STRING,
            },
            "required": ["prompt", "thought", "response"],
        },
    ),
    types.Tool(
        name="query_recent_turns",
        description="Newest memories first (recency recall), paged with nextCursor.",
        input_schema={
            "type": "object",
            "properties": {
                "limit": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
                "sessionId": _STRING,
                "agent": _STRING,
                "before": {
                    "type": "object",
                    "properties": {"timestamp": _STRING, "id": _STRING},
                    "required": ["timestamp"],
                },
            },
        },
        annotations=_READ_ONLY,
    ),
    types.Tool(
        name="query_raw_memories",
        description=(
            "Search every memory by words and by meaning (once embedded), fused; each result "
            "says which legs found it and its relevance (0..1). Filters apply inside the search."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "query": _STRING,
                "nResults": {"type": "integer", "minimum": 1, "maximum": 100, "default": 10},
                "sessionId": _STRING,
                "agent": _STRING,
                "tags": {"type": "array", "items": _STRING, "description": "all of these"},
                "minImportance": {"type": "integer", "minimum": 1, "maximum": 10},
                "since": {"type": "string", "description": "ISO 8601, inclusive"},
                "until": {"type": "string", "description": "ISO 8601, exclusive"},
                "minRelevance": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
        annotations=_READ_ONLY,
    ),
    types.Tool(
        name="brain_store",
        description=(
            "Store a memory (BrainLayer's brain_store input). Says Stored only with a "
            "concrete id from the sink; otherwise Queued, which is durable."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "content": _STRING,
                "tags": {"type": "array", "items": _STRING},
                "importance": {"type": "integer", "minimum": 1, "maximum": 10},
                "project": _STRING,
                "type": {"type": "string", "description": "BrainLayer's memory type"},
                "memory_type": {"type": "string", "description": "the same as type"},
            },
            "required": ["content"],
        },
    ),
    types.Tool(
        name="forget_memory",
        description=(
            "Remove a memory from the outbox, every sink and the markdown mirror, and redact it "
            "in the JSONL log. Takes its key or a unique prefix."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "id": {"type": "string", "description": "the memory's key or a unique prefix"}
            },
            "required": ["id"],
        },
        annotations=types.ToolAnnotations(destructive_hint=True, idempotent_hint=True),
    ),
    types.Tool(
        name="outbox_status",
        description="Counts per sink and state, oldest pending age, dead letters.",
        input_schema={"type": "object", "properties": {}},
        annotations=_READ_ONLY,
    ),
]


def _known_only(tool: str, args: dict[str, Any]) -> None:
    """An argument the tool's schema does not name is an error naming it, not a no-op: a
    misspelt filter would otherwise widen the search silently."""
    schema = next(item.input_schema for item in TOOLS if item.name == tool)
    unknown = sorted(set(args) - set(schema["properties"]))
    if unknown:
        raise ValidationError(unknown[0], f"is not an argument of {tool}")


def _number(args: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    """A whole-number argument within its schema's bounds; anything else (text, 1.5, 1e400,
    true) is a tool error naming the argument, never a crash."""
    value = args.get(name)
    if value is None:
        return default
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value == int(value) and low <= value <= high):
        raise ValidationError(name, f"must be a whole number from {low} to {high}")
    return int(value)


def _optional(args: dict[str, Any], name: str) -> Any:
    value = args.get(name)
    return None if value in (None, "") else value


class ToolHandlers:
    """Maps each tool name to a MemoryService call with neo.mjs's argument names."""

    def __init__(self, service: MemoryService, store_wait: float = 0.0) -> None:
        self.service = service
        self.store_wait = store_wait
        self.calls: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "add_memory": self.add_memory,
            "query_recent_turns": self.query_recent_turns,
            "query_raw_memories": self.query_raw_memories,
            "brain_store": self.brain_store,
            "outbox_status": lambda _args: self.service.outbox.status(),
            "forget_memory": self.forget_memory,
        }

    def add_memory(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.service.add_memory(
            prompt=args.get("prompt"),  # type: ignore[arg-type]
            thought=args.get("thought"),  # type: ignore[arg-type]
            response=args.get("response"),  # type: ignore[arg-type]
            session_id=_optional(args, "sessionId"),
            agent=_optional(args, "agent"),
            model=_optional(args, "model"),
        )

    def query_recent_turns(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.service.query_recent_turns(
            session_id=_optional(args, "sessionId"),
            agent=_optional(args, "agent"),
            limit=_number(args, "limit", 20, 1, 100),
            before=_optional(args, "before"),
        )

    def query_raw_memories(self, args: dict[str, Any]) -> dict[str, Any]:
        _known_only("query_raw_memories", args)
        importance, relevance = _optional(args, "minImportance"), _optional(args, "minRelevance")
        return self.service.query_raw_memories(
            query=args.get("query"),  # type: ignore[arg-type]
            n_results=_number(args, "nResults", 10, 1, 100),
            session_id=_optional(args, "sessionId"),
            agent=_optional(args, "agent"),
            tags=_optional(args, "tags"),
            min_importance=None if importance is None else int(importance),
            since=_optional(args, "since"),
            until=_optional(args, "until"),
            min_relevance=None if relevance is None else float(relevance),
        )

    def forget_memory(self, args: dict[str, Any]) -> dict[str, Any]:
        _known_only("forget_memory", args)
        key = args.get("id")
        if not isinstance(key, str):
            raise ValidationError("id", "must be a key or a unique prefix of one (hex text)")
        return self.service.forget(key)

    def brain_store(self, args: dict[str, Any]) -> dict[str, Any]:
        """BrainLayer's ``brain_store``; its ``type`` (or ``memory_type``) reaches the sink."""
        receipt = self.service.remember(
            args.get("content"),  # type: ignore[arg-type]
            importance=args.get("importance", 5),
            tags=args.get("tags"),
            memory_type=_optional(args, "type") or _optional(args, "memory_type"),
            project=_optional(args, "project"),
        )
        if self.store_wait > 0 and receipt.status == ReceiptStatus.QUEUED:
            receipt = self.service.outbox.wait_delivered(receipt.key, timeout=self.store_wait)
        answer = receipt.to_dict()
        answer["chunk_id"] = receipt.sink_ids.get(BuiltinSink.BRAINLAYER)
        return answer

    def call(self, name: str, args: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """(result, error text): exactly one is set."""
        handler = self.calls.get(name)
        if handler is None:
            return None, f"unknown tool {name!r}"
        try:
            return handler(args), ""
        except (ValidationError, OutboxError) as exc:
            return None, str(exc)
        except (TypeError, ValueError, OverflowError) as exc:
            return None, f"invalid arguments: {exc.__class__.__name__}"


def build_server(handlers: ToolHandlers) -> Server[Any]:
    async def list_tools(
        _ctx: Any, _params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=TOOLS)

    async def call_tool(_ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        args = dict(params.arguments or {})
        result, error = await anyio.to_thread.run_sync(handlers.call, params.name, args)
        if result is None:
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=error)], is_error=True
            )
        text = result.get("message") or json.dumps(result, ensure_ascii=False, default=str)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=json.loads(json.dumps(result, default=str)),
        )

    return Server(
        "outbox",
        version=__version__,
        instructions="Durable agent memory: add_memory never fails; recall is read-after-write.",
        on_list_tools=list_tools,
        on_call_tool=call_tool,
    )


def protocol_error(exc: Exception) -> SessionMessage:
    """The JSON-RPC answer to a line that is no message (the transport would otherwise drop
    it and leave the client waiting): -32700 for text that is not JSON, -32600 for JSON that
    is no valid request, with the request's id when it had one."""
    errors = exc.errors() if isinstance(exc, pydantic.ValidationError) else []
    not_json = not errors or any(error.get("type") == "json_invalid" for error in errors)
    sent: dict[str, Any] = next(
        (error["input"] for error in errors if isinstance(error.get("input"), dict)), {}
    )
    ident = sent.get("id")
    if isinstance(ident, bool) or not isinstance(ident, int | str):
        ident = None
    code, message = (
        (-32700, "Parse error: the line is not JSON")
        if not_json
        else (-32600, "Invalid Request: not a JSON-RPC 2.0 request, response or notification")
    )
    return SessionMessage(
        types.JSONRPCError(
            jsonrpc="2.0", id=ident, error=types.ErrorData(code=code, message=message)
        )
    )


async def _answer_bad_lines(
    incoming: MemoryObjectReceiveStream[SessionMessage | Exception],
    forward: MemoryObjectSendStream[SessionMessage | Exception],
    outgoing: MemoryObjectSendStream[SessionMessage],
) -> None:
    """Pass messages on to the server; answer a line that is no message straight away."""
    async with forward:
        async for item in incoming:
            if isinstance(item, Exception):
                await outgoing.send(protocol_error(item))
            else:
                await forward.send(item)


def serve(drain: bool = False, store_wait: float = 0.0) -> None:
    """Run the stdio server; with ``drain`` a dispatcher delivers in a background thread."""
    service = MemoryService()
    handlers = ToolHandlers(service, store_wait=store_wait)
    stop = threading.Event()
    dispatcher_thread = None
    if drain:
        dispatcher = service.outbox.dispatcher()
        dispatcher_thread = threading.Thread(
            target=dispatcher.run, args=(stop,), name="outbox-mcp-dispatcher", daemon=True
        )
        dispatcher_thread.start()
    server = build_server(handlers)

    async def main() -> None:
        async with stdio_server() as (read_stream, write_stream):
            forward, checked = anyio.create_memory_object_stream[SessionMessage | Exception](0)
            async with anyio.create_task_group() as group:
                group.start_soon(_answer_bad_lines, read_stream, forward, write_stream)
                await server.run(checked, write_stream, server.create_initialization_options())

    try:
        anyio.run(main)
    finally:
        stop.set()
        if dispatcher_thread is not None:
            dispatcher_thread.join(timeout=service.outbox.settings.sink_timeout + 5)
            dispatcher.close()
        service.close()
