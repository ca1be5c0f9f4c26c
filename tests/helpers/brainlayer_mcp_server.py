"""A stdio MCP server that serves BrainLayer 1.5.78's own tool handlers: a test double.

BrainLayer retired its Python stdio server (``brainlayer-mcp``) in 1.5.8; from then on agents
reach it through a macOS-only daemon, so nothing serves ``brain_store`` over stdio on Linux.
This program stands in for that retired server so the sink's MCP mode can be tested against
the current store logic: it hands every ``tools/list`` and ``tools/call`` to
``brainlayer.mcp.list_tools()`` / ``brainlayer.mcp.call_tool()`` unchanged, after checking the
arguments against the tool's input schema as the retired server's SDK did. It is not a
BrainLayer artifact and adds no behaviour of its own beyond that wiring.

Run it as ``python tests/helpers/brainlayer_mcp_server.py`` with the BrainLayer environment
(``BRAINLAYER_DB`` and friends) set.
"""

from __future__ import annotations

import asyncio
from typing import Any

import jsonschema  # type: ignore[import-untyped]
from brainlayer import mcp as brainlayer_mcp
from mcp import types
from mcp.server.lowlevel.server import Server
from mcp.server.stdio import stdio_server


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


async def _list_tools(_ctx: Any, _params: Any) -> types.ListToolsResult:
    return types.ListToolsResult(tools=await brainlayer_mcp.list_tools())


async def _call_tool(_ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    arguments = dict(params.arguments or {})
    schemas = {tool.name: tool.input_schema for tool in await brainlayer_mcp.list_tools()}
    schema = schemas.get(params.name)
    if schema is not None:
        try:
            jsonschema.validate(arguments, schema)
        except jsonschema.ValidationError as exc:
            return _error(f"Input validation error: {exc.message}")
    try:
        result = await brainlayer_mcp.call_tool(params.name, arguments)
    except Exception as exc:  # the retired server's SDK turned handler exceptions into tool errors
        return _error(f"{type(exc).__name__}: {exc}")
    if isinstance(result, types.CallToolResult):
        return result
    if isinstance(result, tuple):
        content, structured = result
        return types.CallToolResult(content=list(content), structured_content=structured)
    return types.CallToolResult(content=list(result))


async def main() -> None:
    server: Server[Any] = Server(
        "brainlayer-test-double", on_list_tools=_list_tools, on_call_tool=_call_tool
    )
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


if __name__ == "__main__":
    asyncio.run(main())
