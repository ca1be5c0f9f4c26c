"""A blocking handle on one MCP server started over stdio (the BrainLayer sink's MCP mode).

The dispatcher calls sinks from plain threads, but the ``mcp`` SDK is async and its stdio
transport must be entered and left by the same task. So the session lives on a private event
loop in a thread of its own: one task owns the transport for the whole life of the handle,
and each tool call is a short task submitted to that loop. The calling thread only waits on
futures, with a timeout on each, so nothing here can block a caller for longer than it asked.

Failures come out classified: ``McpTimeout`` when the server is slow, ``McpTransportClosed``
when it went away (MCP's -32000 included), each both a ``Transient`` and the stdlib's own
timeout or connection error. A JSON-RPC error the server answers with is ``McpServerError``,
for the caller to read. No message carries tool arguments, so memory content cannot leak
into logs through them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import mcp_types
from mcp import types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError

from outbox.core.states import FailureReason
from outbox.sinks.base import Transient

# stdio_client's own shutdown waits 0.5 s for a flush, 2 s for the server to exit after its
# stdin closes, then terminates and kills it (2 s each): the handle waits a little longer.
_SHUTDOWN_WAIT = 8.0
# Margin for the loop thread to hand back a result after the SDK's own timeout fired.
_RESULT_GRACE = 2.0
_TRANSPORT_ERRORS = (
    anyio.ClosedResourceError,
    anyio.BrokenResourceError,
    anyio.EndOfStream,
    BrokenPipeError,
    ConnectionError,
    EOFError,
)


class McpServerError(RuntimeError):
    """The server answered a request with a JSON-RPC error (not a tool result)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"MCP error {code}: {message}")
        self.code = code


class McpTimeout(Transient, TimeoutError):
    """The server did not answer in time."""

    def __init__(self, message: str) -> None:
        super().__init__(message, FailureReason.TIMEOUT)


class McpTransportClosed(Transient, ConnectionError):
    """The server went away (its process, its pipes, or MCP's -32000)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, FailureReason.TRANSPORT_CLOSED)


def _timed_out(what: str, timeout: float) -> McpTimeout:
    return McpTimeout(f"{what} timed out after {timeout:g}s")


def _closed(text: str) -> McpTransportClosed:
    return McpTransportClosed(f"Transport closed: {text}")


def translate(exc: BaseException, what: str, timeout: float) -> Exception:
    """The exception a caller should see for a failed request: MCP's and anyio's failures
    classified, anything else as it came."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, MCPError):
        if exc.code == mcp_types.REQUEST_TIMEOUT:
            return _timed_out(what, timeout)
        if exc.code == mcp_types.CONNECTION_CLOSED:
            return _closed(f"{what} got MCP error -32000 Connection closed")
        return McpServerError(exc.code, exc.message)
    if isinstance(exc, TimeoutError):
        return _timed_out(what, timeout)
    if isinstance(exc, _TRANSPORT_ERRORS):
        return _closed(f"{what} failed ({type(exc).__name__})")
    if isinstance(exc, Exception):
        return exc
    return RuntimeError(f"{what} failed ({type(exc).__name__})")


class StdioMcpClient:
    """One server process and one initialized session, usable from any thread.

    ``start`` spawns the server and runs ``initialize`` and ``tools/list`` under a timeout;
    ``call`` runs one tool under a timeout; ``close`` ends the session and the process. After
    a transport failure every call fails at once: close the handle and make a new one.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        if not argv:
            raise ValueError("an MCP server command line needs at least the program")
        self.argv = list(argv)
        self.env = dict(os.environ if env is None else env)
        self.tools: dict[str, types.Tool] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._owner: concurrent.futures.Future[None] | None = None
        self._session: ClientSession | None = None
        self._stop = asyncio.Event()
        self._finished = threading.Event()

    @property
    def alive(self) -> bool:
        return self._session is not None and self._owner is not None and not self._owner.done()

    def start(self, timeout: float) -> None:
        """Spawn the server, initialize and list its tools, all within ``timeout`` seconds."""
        if self._loop is not None:
            raise RuntimeError("this MCP client was already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever, name="outbox-mcp-client", daemon=True
        )
        self._thread.start()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._owner = asyncio.run_coroutine_threadsafe(self._own(ready, timeout), loop)
        try:
            ready.result(timeout=timeout + _RESULT_GRACE)
        except Exception as exc:
            self.close()
            raise translate(exc, "starting the MCP server", timeout) from None

    async def _own(self, ready: concurrent.futures.Future[None], timeout: float) -> None:
        """Hold the transport and session open until ``close``; report startup on ``ready``."""
        params = StdioServerParameters(command=self.argv[0], args=self.argv[1:], env=self.env)
        try:
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                with anyio.fail_after(timeout):
                    await session.initialize()
                    tools = await self._list_tools(session)
                self.tools = {tool.name: tool for tool in tools}
                self._session = session
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._session = None
            self._finished.set()

    @staticmethod
    async def _list_tools(session: ClientSession) -> list[types.Tool]:
        tools: list[types.Tool] = []
        cursor: str | None = None
        while True:
            params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
            page = await session.list_tools(params=params)
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                return tools

    def input_properties(self, tool: str) -> dict[str, Any] | None:
        """The argument schemas ``tool`` declares by name, or None when the server does not
        list the tool."""
        found = self.tools.get(tool)
        if found is None:
            return None
        properties = (found.input_schema or {}).get("properties")
        return dict(properties) if isinstance(properties, dict) else {}

    def call(self, tool: str, arguments: dict[str, Any], timeout: float) -> types.CallToolResult:
        """Run ``tool`` and return its result (tool errors included); raise ``Transient`` on
        transport failure or no answer in time, ``McpServerError`` on a JSON-RPC error."""
        session, loop = self._session, self._loop
        if session is None or loop is None or not self.alive:
            raise _closed(f"the MCP session for {tool} is not open")
        future = asyncio.run_coroutine_threadsafe(
            session.call_tool(tool, arguments, read_timeout_seconds=timeout), loop
        )
        try:
            return future.result(timeout=timeout + _RESULT_GRACE)
        except Exception as exc:
            future.cancel()
            raise translate(exc, f"{tool} call", timeout) from None

    def close(self) -> None:
        """End the session, stop the server (stdin closed, then terminate, then kill) and the
        loop thread. Safe to call twice and from any thread."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._owner is not None and not self._finished.is_set():
            # Never cancel the owner: its exit path is what stops the server process.
            loop.call_soon_threadsafe(self._stop.set)
            self._finished.wait(_SHUTDOWN_WAIT)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=_SHUTDOWN_WAIT)
            if not self._thread.is_alive():
                loop.close()
        self._session = None
