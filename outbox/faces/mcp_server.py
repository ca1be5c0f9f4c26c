"""``outbox mcp``: memory-core's tools for any MCP client, over stdio.

Tool arguments keep neo.mjs's names (``prompt``, ``sessionId``, ``nResults``…) and
``brain_store`` takes BrainLayer's input schema, so agents switch without edits. Each tool's
input schema is the only check of its arguments: a JSON Schema validator built from it
refuses an unknown argument or a value outside it, as a tool error naming the argument, so a
tool cannot accept what its schema does not say. An accepted write never comes back as an
error envelope. Calls run in worker threads so a slow database never stalls the protocol loop.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import mcp_types as types
import pydantic
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError as SchemaViolation
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

from outbox import __version__
from outbox.core.errors import OutboxError, ValidationError
from outbox.core.states import BuiltinSink, ReceiptStatus
from outbox.memory_core import MemoryService

log = logging.getLogger(__name__)

_STRING = {"type": "string"}
_TEXTS = {"type": "array", "items": _STRING}
_READ_ONLY = types.ToolAnnotations(read_only_hint=True)
# BrainLayer's brain_store arguments that only BrainLayer gives a meaning to: accepted as its
# schema accepts them and kept with the record (metadata ``brainlayer``), never dropped.
_BRAINLAYER_ONLY: dict[str, dict[str, Any]] = {
    "confidence_score": {"type": "number", "minimum": 0, "maximum": 1},
    "outcome": {"type": "string", "enum": ["pending", "validated", "reversed"]},
    "reversibility": {"type": "string", "enum": ["easy", "hard", "destructive"]},
    "files_changed": _TEXTS,
    "entity_id": _STRING,
    "status": {"type": "string", "enum": ["open", "in_progress", "done", "archived"]},
    "severity": {"type": "string", "enum": ["critical", "high", "medium", "low"]},
    "file_path": _STRING,
    "function_name": _STRING,
    "line_number": {"type": "integer"},
    "supersedes": _STRING,
}

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
            "additionalProperties": False,
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
                    "additionalProperties": False,
                },
            },
            "additionalProperties": False,
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
                "tags": {**_TEXTS, "description": "all of these"},
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
                "tags": _TEXTS,
                "importance": {"type": "integer", "minimum": 1, "maximum": 10, "default": 5},
                "project": _STRING,
                "type": {"type": "string", "description": "BrainLayer's memory type"},
                "memory_type": {"type": "string", "description": "the same as type"},
                "agent_id": {"type": "string", "description": "the agent (recall's agent filter)"},
                **_BRAINLAYER_ONLY,
            },
            "required": ["content"],
            "additionalProperties": False,
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
            "additionalProperties": False,
        },
        annotations=types.ToolAnnotations(destructive_hint=True, idempotent_hint=True),
    ),
    types.Tool(
        name="outbox_status",
        description="Counts per sink and state, oldest pending age, dead letters.",
        input_schema={"type": "object", "properties": {}, "additionalProperties": False},
        annotations=_READ_ONLY,
    ),
]


def _finite_number(_checker: Any, instance: object) -> bool:
    """JSON Schema's ``number``, less the infinities and NaN a JSON parser may hand over
    (``1e400``): no range can hold them, so they are refused as the wrong kind of value."""
    return (
        isinstance(instance, int | float)
        and not isinstance(instance, bool)
        and math.isfinite(instance)
    )


_Validator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine("number", _finite_number),
)
_KINDS = {
    "string": "text",
    "integer": "a whole number",
    "number": "a number",
    "boolean": "true or false",
    "array": "a list",
    "object": "an object",
}
# The order in which a call's problems are told: a misspelt name explains the rest.
_FIRST = {"additionalProperties": 0, "required": 1, "type": 2}


def _argument(path: Any) -> str:
    """``before.timestamp``, ``tags[2]``: where in the arguments a problem sits."""
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else f"{'.' if name else ''}{part}"
    return name


def _told(tool: str, violation: SchemaViolation) -> ValidationError:
    """One line naming the argument and what the schema wants of it; never its value, which
    may be a memory's words."""
    keyword, wanted, path = violation.validator, violation.validator_value, violation.absolute_path
    here = _argument(path)
    if keyword == "additionalProperties":
        known = violation.schema.get("properties", {})
        extra = sorted(set(violation.instance) - set(known))
        where = f"a field of {here}" if here else f"an argument of {tool}"
        takes = ", ".join(known) or "none"
        return ValidationError(_argument([*path, extra[0]]), f"is not {where} (it takes: {takes})")
    if keyword == "required":
        missing = next(name for name in wanted if name not in violation.instance)
        return ValidationError(_argument([*path, missing]), "is required")
    problems: dict[str, Callable[[Any], str]] = {
        "type": lambda kind: f"must be {_KINDS.get(kind, kind)}",
        "minimum": lambda low: f"must be at least {low}",
        "maximum": lambda high: f"must be at most {high}",
        "enum": lambda names: "must be one of " + ", ".join(map(str, names)),
    }
    tell = problems.get(keyword)
    return ValidationError(here or "arguments", tell(wanted) if tell else f"breaks {keyword}")


def _as_promised(schema: Mapping[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    """The schema's defaults filled in, and whole numbers sent as ``3.0`` made ints, so a
    handler reads exactly what the schema promised."""
    properties = schema["properties"]
    full = {name: spec["default"] for name, spec in properties.items() if "default" in spec}
    full.update(args)
    for name, value in full.items():
        if properties[name].get("type") == "integer" and isinstance(value, float):
            full[name] = int(value)
    return full


class ArgumentCheck:
    """Every tool's arguments held to its own input schema, by one validator per tool."""

    def __init__(self, tools: list[types.Tool]) -> None:
        self.schemas = {tool.name: tool.input_schema for tool in tools}
        self.validators = {name: _Validator(schema) for name, schema in self.schemas.items()}

    def __call__(self, tool: str, args: dict[str, Any]) -> dict[str, Any]:
        """The arguments ready for the handler, or ValidationError naming the first bad one."""
        violations = list(self.validators[tool].iter_errors(args))
        if violations:
            violations.sort(key=lambda v: (_FIRST.get(v.validator, 3), _argument(v.absolute_path)))
            raise _told(tool, violations[0])
        return _as_promised(self.schemas[tool], args)


def _optional(args: dict[str, Any], name: str) -> Any:
    value = args.get(name)
    return None if value in (None, "") else value


class ToolHandlers:
    """Maps each tool name to a MemoryService call with neo.mjs's argument names."""

    def __init__(self, service: MemoryService, store_wait: float = 0.0) -> None:
        self.service = service
        self.store_wait = store_wait
        self.check = ArgumentCheck(TOOLS)
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
            prompt=args["prompt"],
            thought=args["thought"],
            response=args["response"],
            session_id=_optional(args, "sessionId"),
            agent=_optional(args, "agent"),
            model=_optional(args, "model"),
        )

    def query_recent_turns(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.service.query_recent_turns(
            session_id=_optional(args, "sessionId"),
            agent=_optional(args, "agent"),
            limit=args["limit"],
            before=_optional(args, "before"),
        )

    def query_raw_memories(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.service.query_raw_memories(
            query=args["query"],
            n_results=args["nResults"],
            session_id=_optional(args, "sessionId"),
            agent=_optional(args, "agent"),
            tags=_optional(args, "tags"),
            min_importance=args.get("minImportance"),
            since=_optional(args, "since"),
            until=_optional(args, "until"),
            min_relevance=args.get("minRelevance"),
        )

    def forget_memory(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.service.forget(args["id"])

    def brain_store(self, args: dict[str, Any]) -> dict[str, Any]:
        """BrainLayer's ``brain_store``; its ``type`` (or ``memory_type``) reaches the sink,
        ``agent_id`` becomes the memory's agent, BrainLayer's other fields stay with it."""
        extra = {name: args[name] for name in _BRAINLAYER_ONLY if name in args}
        receipt = self.service.remember(
            args["content"],
            importance=args["importance"],
            tags=args.get("tags"),
            metadata={"brainlayer": extra} if extra else None,
            memory_type=_optional(args, "type") or _optional(args, "memory_type"),
            project=_optional(args, "project"),
            agent=_optional(args, "agent_id"),
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
            return handler(self.check(name, args)), ""
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
