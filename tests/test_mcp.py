"""A real MCP client (stdio_client + ClientSession) against `outbox mcp` as a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from outbox import Outbox, load_settings
from outbox.core.errors import ValidationError
from outbox.faces.mcp_server import TOOLS, ArgumentCheck
from tests.brainlayer_env import brainlayer_environ, setup_brainlayer

SINK = "outbox.testing.sinks:FaultySink"


def _params(
    tmp_path: Path, *extra: str, env: Mapping[str, str] | None = None
) -> StdioServerParameters:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "OUTBOX_HOME": str(tmp_path / ".outbox"),
        "OUTBOX_MARKDOWN_DIR": str(tmp_path / "md"),
        "OUTBOX_SINKS": SINK,
        "OUTBOX_POLL_INTERVAL": "0.1",
        **(env or {}),
    }
    return StdioServerParameters(
        command=sys.executable, args=["-m", "outbox", "mcp", *extra], env=env, cwd=str(tmp_path)
    )


async def _session_calls(tmp_path: Path) -> dict[str, Any]:
    async with (
        stdio_client(_params(tmp_path)) as (read, write),
        ClientSession(read, write) as session,
    ):
        await asyncio.wait_for(session.initialize(), 30)
        tools = await session.list_tools()
        added = await session.call_tool(
            "add_memory",
            {
                "prompt": "Which port does the staging Chroma server listen on?",
                "thought": "The runbook says the loopback port for staging.",
                "response": "Staging Chroma listens on 127.0.0.1 port 18765 (zanzibar).",
                "sessionId": "s-1",
                "agent": "@tester",
            },
        )
        recent = await session.call_tool("query_recent_turns", {"limit": 5})
        raw = await session.call_tool("query_raw_memories", {"query": "zanzibar staging"})
        others = await session.call_tool(
            "query_raw_memories", {"query": "zanzibar staging", "agent": "@other"}
        )
        misspelt = await session.call_tool(
            "query_raw_memories", {"query": "zanzibar", "sesionId": "s-1"}
        )
        stored = await session.call_tool(
            "brain_store",
            {"content": "Decision: keep WAL FULL.", "tags": ["decision"], "importance": 7},
        )
        bad = await session.call_tool(
            "add_memory", {"prompt": " ", "thought": "t", "response": "r"}
        )
        status = await session.call_tool("outbox_status", {})
        return {
            "tools": tools,
            "added": added,
            "recent": recent,
            "raw": raw,
            "others": others,
            "misspelt": misspelt,
            "stored": stored,
            "bad": bad,
            "status": status,
        }


def test_every_tool_over_stdio(tmp_path: Path) -> None:
    out = asyncio.run(_session_calls(tmp_path))
    names = {tool.name for tool in out["tools"].tools}
    assert {
        "add_memory",
        "query_recent_turns",
        "query_raw_memories",
        "brain_store",
        "outbox_status",
    } <= names

    added = out["added"]
    assert not added.is_error
    body = added.structured_content
    assert "error" not in body
    assert body["status"] == "queued" and body["sessionId"] == "s-1"
    assert body["visibility"]["recencyQueryable"] is True
    assert body["visibility"]["semanticQueryable"] is False

    # Read-after-write with no dispatcher running: recency and the lexical overlay see it.
    turns = out["recent"].structured_content["turns"]
    assert turns[0]["id"] == body["id"] and turns[0]["agent"] == "@tester"
    assert turns[0]["response"].endswith("(zanzibar).")
    hits = out["raw"].structured_content["results"]
    assert hits and hits[0]["id"] == body["id"] and hits[0]["legs"] == ["lexical"]
    assert 0.0 < hits[0]["relevance"] <= 1.0
    # Filters are arguments the schema names; a name it does not know is an error naming it.
    (schema,) = [t.input_schema for t in out["tools"].tools if t.name == "query_raw_memories"]
    filters = {"agent", "tags", "minImportance", "since", "until", "minRelevance", "sessionId"}
    assert filters <= set(schema["properties"])
    assert out["others"].structured_content["results"] == []
    assert out["misspelt"].is_error and "sesionId" in out["misspelt"].content[0].text

    stored = out["stored"]
    assert not stored.is_error
    assert stored.structured_content["status"] == "queued"
    assert stored.structured_content["chunk_id"] is None
    assert "Stored" not in stored.content[0].text

    bad = out["bad"]
    assert bad.is_error
    assert bad.content[0].text == "invalid prompt: is only whitespace"

    status = out["status"].structured_content
    assert status["records"] == 2 and status["sinks"][SINK]["pending"] == 2


async def _add_then_kill(tmp_path: Path, count: int) -> list[str]:
    keys: list[str] = []
    async with (
        stdio_client(_params(tmp_path)) as (read, write),
        ClientSession(read, write) as session,
    ):
        await asyncio.wait_for(session.initialize(), 30)
        for i in range(count):
            result = await session.call_tool(
                "add_memory",
                {"prompt": f"question {i}", "thought": "thinking", "response": f"answer {i}"},
            )
            keys.append(result.structured_content["id"])
        # One more call in flight while the server is killed.
        pending = asyncio.ensure_future(
            session.call_tool(
                "add_memory", {"prompt": "last", "thought": "t", "response": "in flight"}
            )
        )
        await asyncio.sleep(0)
        for proc in _server_processes(tmp_path):
            os.kill(proc, signal.SIGKILL)
        with pytest.raises(Exception):  # noqa: B017 - any transport failure is expected
            await asyncio.wait_for(pending, 10)
    return keys


def _server_processes(tmp_path: Path) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"mcp" in cmdline and str(tmp_path).encode() in environ:
            pids.append(int(entry.name))
    return pids


def test_killing_the_server_loses_no_accepted_write(tmp_path: Path) -> None:
    keys = asyncio.run(_add_then_kill(tmp_path, 20))
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "md", sinks=SINK
    )
    with Outbox.open(settings) as ob:
        stored = ob.get_records(keys)
        assert set(stored) == set(keys)
        assert ob.verify().ok


async def _call_once(
    tmp_path: Path, env: Mapping[str, str], tool: str, args: dict[str, Any]
) -> Any:
    async with (
        stdio_client(_params(tmp_path, env=env)) as (read, write),
        ClientSession(read, write) as session,
    ):
        await asyncio.wait_for(session.initialize(), 30)
        return await session.call_tool(tool, args)


@pytest.mark.parametrize("argument", ["type", "memory_type"])
def test_brain_store_type_reaches_brainlayer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argument: str
) -> None:
    """A decision stored through the MCP tool is a decision in BrainLayer's own database,
    not BrainLayer's default note: under BrainLayer's argument name and under the older one."""
    bl = setup_brainlayer(tmp_path / "bl", monkeypatch)
    env = {
        **brainlayer_environ(bl.root),
        "OUTBOX_SINKS": "brainlayer",
        "OUTBOX_BRAINLAYER_DB": str(bl.db),
    }
    content = "Decision: the outbox database stays in WAL mode with synchronous FULL."
    stored = asyncio.run(
        _call_once(
            tmp_path,
            env,
            "brain_store",
            {"content": content, argument: "decision", "project": "outbox", "importance": 8},
        )
    )
    assert not stored.is_error, stored.content
    key = stored.structured_content["key"]

    settings = load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks="brainlayer",
        brainlayer_db=bl.db,
    )
    with Outbox.open(settings) as ob:
        assert ob.drain(timeout=60).ok
        (delivery,) = ob.deliveries_of([key])[key]
    assert delivery.sink_id is not None
    chunk = bl.chunk(delivery.sink_id)
    assert chunk is not None and chunk["content"] == content
    assert (chunk["content_type"], chunk["project"], chunk["importance"]) == (
        "decision",
        "outbox",
        8.0,
    )


def _raw_session(tmp_path: Path, lines: list[bytes]) -> list[dict[str, Any]]:
    """Speak JSON-RPC to ``outbox mcp`` byte for byte (what an SDK client would never send,
    such as the number 1e400), and read one answer per request sent.

    The answers are read by a thread into a queue, never by ``select`` on the pipe followed
    by a buffered ``readline``: that readline took every answer already in the pipe into its
    buffer, where ``select`` cannot see them, so on a busy machine (answers arriving together)
    the test waited out its deadline for answers it already held."""
    import json
    import queue
    import subprocess
    import threading
    import time

    params = _params(tmp_path)
    hello = {
        "jsonrpc": "2.0",
        "id": 0,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"},
        },
    }
    ready = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    sent = [json.dumps(hello).encode(), json.dumps(ready).encode(), *lines]
    proc = subprocess.Popen(
        [params.command, *params.args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=params.env,
        cwd=params.cwd,
    )
    assert proc.stdin is not None and proc.stdout is not None
    stdout = proc.stdout
    received: queue.Queue[bytes] = queue.Queue()

    def read_answers() -> None:
        for line in stdout:
            received.put(line)
        received.put(b"")  # the server closed its stdout

    reader = threading.Thread(target=read_answers, daemon=True)
    reader.start()
    proc.stdin.write(b"\n".join(sent) + b"\n")
    proc.stdin.flush()
    answers: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30  # a line left unanswered must fail, not hang, the test
    while len(answers) < len(lines) + 1:  # the initialize answer, then one per request
        try:
            line = received.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            line = b""
        if not line:
            proc.kill()
            break
        answers.append(json.loads(line))
    proc.stdin.close()
    proc.wait(timeout=60)
    reader.join(timeout=60)
    assert proc.stderr is not None
    errors = proc.stderr.read()
    assert b"Traceback" not in errors, errors.decode()[-2000:]
    return [answer for answer in answers if answer.get("id") != 0]


def _call(number: int, tool: str, arguments: str) -> bytes:
    return (
        f'{{"jsonrpc": "2.0", "id": {number}, "method": "tools/call", '
        f'"params": {{"name": "{tool}", "arguments": {arguments}}}}}'
    ).encode()


def test_out_of_range_numbers_are_tool_errors_naming_the_argument(tmp_path: Path) -> None:
    """``limit: 1e400`` gave JSON-RPC error code 0 and a traceback on the server's stderr;
    every bad number is now a tool error that names its argument, and the server goes on."""
    answers = _raw_session(
        tmp_path,
        [
            _call(1, "query_recent_turns", '{"limit": 1e400}'),
            _call(2, "query_recent_turns", '{"limit": 2.5}'),
            _call(3, "query_recent_turns", '{"limit": "ten"}'),
            _call(4, "query_raw_memories", '{"query": "anything", "nResults": 0}'),
            _call(5, "query_recent_turns", '{"limit": 3}'),
        ],
    )
    by_id = {answer["id"]: answer for answer in answers}
    assert sorted(by_id) == [1, 2, 3, 4, 5]
    for number, name in [(1, "limit"), (2, "limit"), (3, "limit"), (4, "nResults")]:
        result = by_id[number]["result"]
        assert result["isError"] is True, by_id[number]
        assert name in result["content"][0]["text"]
    assert by_id[5]["result"].get("isError") is not True


def test_a_line_that_is_no_request_gets_an_answer(tmp_path: Path) -> None:
    """Malformed JSON and a request without a method got no reply, and the client hung;
    they now get JSON-RPC's parse error and invalid-request answers, and the server goes on."""
    answers = _raw_session(
        tmp_path,
        [
            b"{this is not json",
            b'{"jsonrpc": "2.0", "id": 7}',
            _call(8, "query_recent_turns", '{"limit": 3}'),
        ],
    )
    assert len(answers) == 3
    parse, invalid = (a for a in answers if "error" in a)
    assert (parse["error"]["code"], parse.get("id")) == (-32700, None)
    assert (invalid["error"]["code"], invalid["id"]) == (-32600, 7)
    (good,) = (a for a in answers if a.get("id") == 8)
    assert good["result"].get("isError") is not True


TURN = {"prompt": "Which port?", "thought": "The runbook says.", "response": "Port 18765."}
# For every tool: an argument its schema does not name, and a value outside its schema;
# each a tool error naming the argument (the third item), with nothing written.
BAD_CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("add_memory", {**TURN, "session_id": "s1"}, "session_id"),
    ("add_memory", {**TURN, "sessionId": 7}, "sessionId"),
    ("add_memory", {"prompt": "p", "thought": "t"}, "response"),
    ("query_recent_turns", {"session_id": "s1"}, "session_id"),
    ("query_recent_turns", {"limit": 101}, "limit"),
    ("query_recent_turns", {"before": {"timestamp": "2030-01-01", "key": "ab"}}, "before.key"),
    ("query_raw_memories", {"query": "port", "session": "s1"}, "session"),
    ("query_raw_memories", {"query": "port", "minRelevance": 1.5}, "minRelevance"),
    ("brain_store", {"content": "Decision: keep WAL.", "timestamp": "2030-01-01"}, "timestamp"),
    ("brain_store", {"content": "Decision: keep WAL.", "importance": 11}, "importance"),
    ("brain_store", {"content": "Decision: keep WAL.", "outcome": "maybe"}, "outcome"),
    ("forget_memory", {"id": "<key>", "force": True}, "force"),
    ("forget_memory", {"id": 7}, "id"),
    ("outbox_status", {"verbose": True}, "verbose"),
]


BRAINLAYER_STORE = {
    "content": "Decision: the outbox keeps WAL with synchronous FULL.",
    "type": "decision",
    "confidence_score": 0.9,
    "outcome": "pending",
    "files_changed": ["outbox/store/sqlite.py"],
    "agent_id": "@me",
}


def _closed(schema: Mapping[str, Any]) -> bool:
    """Every object in the schema, nested ones too, refuses arguments it does not name."""
    if schema.get("type") == "array":
        return _closed(schema["items"])
    if schema.get("type") != "object":
        return True
    return schema.get("additionalProperties") is False and all(
        _closed(spec) for spec in schema["properties"].values()
    )


async def _bad_calls(tmp_path: Path) -> dict[str, Any]:
    async with (
        stdio_client(_params(tmp_path)) as (read, write),
        ClientSession(read, write) as session,
    ):
        await asyncio.wait_for(session.initialize(), 30)
        tools = (await session.list_tools()).tools
        kept = await session.call_tool("add_memory", TURN)
        key = kept.structured_content["id"]
        stored = await session.call_tool("brain_store", BRAINLAYER_STORE)
        assert not stored.is_error, stored.content
        answers = []
        for tool, args, _name in BAD_CALLS:
            if args.get("id") == "<key>":
                args = {**args, "id": key}
            answers.append(await session.call_tool(tool, args))
        recent = await session.call_tool("query_recent_turns", {"limit": 3.0, "sessionId": "s1"})
        stored_key = stored.structured_content["key"]
        return {"tools": tools, "keys": [key, stored_key], "answers": answers, "recent": recent}


def test_every_tool_refuses_what_its_schema_does_not_hold(tmp_path: Path) -> None:
    """An unknown argument (``session_id`` for ``sessionId``) stored a turn under a random
    session and widened a query to every session; now, for every tool, it and any value
    outside the schema are a tool error naming the argument, and nothing is written."""
    out = asyncio.run(_bad_calls(tmp_path))
    assert {tool.name for tool in out["tools"]} == {tool for tool, _, _ in BAD_CALLS}
    for tool in out["tools"]:
        assert _closed(tool.input_schema), tool.name
    for (tool, args, name), answer in zip(BAD_CALLS, out["answers"], strict=True):
        assert answer.is_error, (tool, args)
        (text,) = [block.text for block in answer.content]
        assert text.startswith(f"invalid {name}: "), (tool, text)
        assert "\n" not in text and "WAL" not in text and "18765" not in text
    # The server goes on; an integer sent as 3.0 is the integer 3; no turn is in session s1.
    assert not out["recent"].is_error
    assert out["recent"].structured_content["turns"] == []

    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "md", sinks=SINK
    )
    turn_key, stored_key = out["keys"]
    with Outbox.open(settings) as ob:
        assert sorted(row.key for row in ob.recent_memories(10)) == sorted(out["keys"])
        assert ob.get_records([turn_key])[turn_key].record.metadata["session_id"] != "s1"
        # BrainLayer's own fields are taken as its schema takes them, and kept.
        meta = ob.get_records([stored_key])[stored_key].record.metadata
    assert meta["agent"] == "@me" and meta["type"] == "decision"
    assert meta["brainlayer"] == {
        name: BRAINLAYER_STORE[name] for name in ("confidence_score", "outcome", "files_changed")
    }
    assert len(list((tmp_path / "md").rglob("*.md"))) == 2


def _valid(schema: Mapping[str, Any]) -> st.SearchStrategy[Any]:
    """Values the schema holds; a keyword this does not know fails the test, so a schema
    cannot grow past what the property below covers."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return st.text(max_size=12)
    if kind == "integer":
        return st.integers(schema.get("minimum", -(10**9)), schema.get("maximum", 10**9))
    if kind == "number":
        low, high = schema.get("minimum", -1e9), schema.get("maximum", 1e9)
        return st.floats(low, high, allow_nan=False, allow_infinity=False)
    if kind == "array":
        return st.lists(_valid(schema["items"]), max_size=3)
    if kind == "object":
        required = set(schema.get("required", []))
        properties = schema["properties"]
        return st.fixed_dictionaries(
            {name: _valid(properties[name]) for name in required},
            optional={n: _valid(s) for n, s in properties.items() if n not in required},
        )
    raise AssertionError(f"no strategy for {schema}")


@hypothesis.settings(max_examples=300, deadline=None)
@given(data=st.data(), tool=st.sampled_from(TOOLS))
def test_any_extra_argument_is_refused_by_name(data: st.DataObject, tool: Any) -> None:
    """Whatever valid arguments a tool is given, one more key its schema does not name makes
    the call an error naming that key; without it the same arguments pass."""
    check = ArgumentCheck(TOOLS)
    args = data.draw(_valid(tool.input_schema), label="arguments")
    check(tool.name, args)
    known = tool.input_schema["properties"]
    extra = data.draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in known))
    value = data.draw(st.none() | st.integers() | st.text(max_size=5), label="value")
    with pytest.raises(ValidationError) as refused:
        check(tool.name, {**args, extra: value})
    assert refused.value.field == extra


def test_brain_store_takes_whatever_brainlayer_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing ``brain_store``'s schema refuses no call BrainLayer's own schema accepts:
    every argument it names is ours too, and any value it holds, ours holds."""
    setup_brainlayer(tmp_path / "bl", monkeypatch, bootstrap=False)
    from brainlayer import mcp as brainlayer_mcp

    (theirs,) = [
        tool.input_schema
        for tool in asyncio.run(brainlayer_mcp.list_tools())
        if tool.name == "brain_store"
    ]
    (ours,) = [tool.input_schema for tool in TOOLS if tool.name == "brain_store"]
    assert set(theirs["properties"]) <= set(ours["properties"])
    check = ArgumentCheck(TOOLS)

    @hypothesis.settings(max_examples=200, deadline=None)
    @given(args=_valid(theirs))
    def accepted(args: dict[str, Any]) -> None:
        check("brain_store", args)

    accepted()


def test_add_loads_no_schema_validator(tmp_path: Path) -> None:
    """The validator is the MCP server's: ``outbox add`` starts without it."""
    from tests.helpers.subproc import child_env
    from tests.test_startup import loaded_by, under

    modules = loaded_by(["add", "a memory saved from the shell"], tmp_path, child_env(tmp_path))
    assert "outbox.write.writer" in modules
    assert under(modules, "jsonschema", "outbox.faces.mcp_server") == []
