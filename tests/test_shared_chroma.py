"""Many processes, one store folder, nothing configured: they share one Chroma server
that the first of them starts, that outlives it, and that the next one restarts if it dies.

Real processes and real Chroma throughout: ``outbox run``, ``outbox mcp --drain`` with a real
MCP client, ``outbox search``, ``outbox drain`` and a ``MemoryService`` in this process. Every
test stops the server it caused (``stop_shared_server``): it would otherwise outlive the run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import chromadb
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from outbox import Outbox, Settings, load_settings
from outbox.memory_core import MemoryService
from outbox.sinks.chroma import ChromaSink
from outbox.sinks.chroma_local import OWNER_LOCK
from outbox.sinks.chroma_service import (
    ChromaServerDown,
    SharedBackend,
    SharedServer,
    answers,
    private_folder,
    read_state,
    server_key,
)
from outbox.sinks.embedding import builtin_name
from tests.chroma_server import shared_server_processes, stop_shared_server, supervisors

TOPICS = [
    "The staging database migrates every Tuesday at 03:00 UTC.",
    "Our cat Pixel refuses to eat anything but salmon pate.",
    "The release train leaves from the main branch on Fridays.",
    "Grandmother's lemon cake needs two hours in a slow oven.",
    "The VPN certificate for the lab expires in March.",
    "Rooftop solar panels produced twelve kilowatt hours on Sunday.",
]


def outbox_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without OUTBOX_* settings, plus the folders of the test: everything
    else, Chroma included, at its default."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_HOME=str(tmp_path / ".outbox"),
        OUTBOX_MARKDOWN_DIR=str(tmp_path / "md"),
        OUTBOX_POLL_INTERVAL="0.2",
    )
    env.update({f"OUTBOX_{name.upper()}": value for name, value in extra.items()})
    return env


def settings_of(env: dict[str, str]) -> Settings:
    return load_settings(env={k: v for k, v in env.items() if k.startswith("OUTBOX_")})


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    env = outbox_env(tmp_path)
    yield env
    stop_shared_server(settings_of(env).chroma_path)


def cli(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        cwd=env["OUTBOX_HOME"].rsplit("/", 1)[0],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def daemon(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "outbox", "run"], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def wait_for(check: Callable[[], bool], what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.2)


def delivered(settings: Settings, keys: list[str]) -> bool:
    with Outbox.open(settings) as ob:
        rows = ob.deliveries_of(keys)
    return all(row.state == "delivered" for key in keys for row in rows.get(key, [])) and all(
        rows.get(key) for key in keys
    )


def documents_by_id(settings: Settings, keys: list[str]) -> tuple[int, int]:
    """(documents whose id is one of ``keys``, documents in the collection), read with a client
    of our own once the shared server is stopped (it answers only the sink's calls)."""
    state = read_state(settings.chroma_path)
    assert state is not None and answers(settings.chroma_path, state)
    sink = ChromaSink.from_settings(settings)  # the collection name, however it is chosen
    stop_shared_server(settings.chroma_path)
    client: Any = chromadb.PersistentClient(str(settings.chroma_path))
    try:
        collection = client.get_collection(sink.collection_name)
        return len(collection.get(ids=keys, include=[])["ids"]), int(collection.count())
    finally:
        client.close()
        sink.close()


def by_vector(result: dict[str, Any]) -> bool:
    """Whether the vector leg found this result (``legs`` or the older ``source``)."""
    return "vector" in (result.get("legs") or []) or result.get("source") == "vector"


def assert_found_by_vector(answer: dict[str, Any], key: str) -> None:
    assert "degraded" not in answer, answer.get("degraded")
    hits = {result["id"]: result for result in answer["results"]}
    assert key in hits, answer
    assert by_vector(hits[key]), hits[key]


# -- (a) side by side ----------------------------------------------------------------------


async def _mcp_side_by_side(env: dict[str, str], tmp_path: Path) -> list[str]:
    settings = settings_of(env)
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "outbox", "mcp", "--drain"], env=env, cwd=str(tmp_path)
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await asyncio.wait_for(session.initialize(), 60)
        keys = []
        for i, topic in enumerate(TOPICS[:3]):
            added = await session.call_tool(
                "add_memory", {"prompt": f"note {i}", "thought": "noted", "response": topic}
            )
            keys.append(added.structured_content["id"])
        service = MemoryService(Outbox.open(settings))
        try:
            for i, topic in enumerate(TOPICS[3:]):
                keys.append(service.add_memory(f"fact {i}", "noted", topic)["id"])
            await asyncio.to_thread(wait_for, lambda: delivered(settings, keys), "delivery")
            # Searches from three processes while the daemon and the MCP server are up.
            assert_found_by_vector(service.query_raw_memories("cat food salmon", 6), keys[1])
            raw = await session.call_tool("query_raw_memories", {"query": "lemon cake oven"})
            assert_found_by_vector(raw.structured_content, keys[3])
            searched = await asyncio.to_thread(cli, env, "search", "--json", "VPN certificate")
            assert searched.returncode == 0, searched.stderr
            assert_found_by_vector(json.loads(searched.stdout), keys[4])
            # A drain in another shell beside a service that has searched.
            extra = await asyncio.to_thread(cli, env, "add", "The bike shed is painted green.")
            assert extra.returncode == 0, extra.stderr
            drained = await asyncio.to_thread(cli, env, "drain", "--json")
            assert drained.returncode == 0, drained.stdout + drained.stderr
            assert "db_busy" not in drained.stdout
        finally:
            service.close()
    with Outbox.open(settings) as ob:
        every = [row.key for row in ob.recent_memories(50)]
    assert len(every) == len(TOPICS) + 1
    wait_for(lambda: delivered(settings, every), "delivery of the drained record")
    return every


def test_daemon_mcp_server_and_searchers_share_one_server(
    env: dict[str, str], tmp_path: Path
) -> None:
    runner = daemon(env, tmp_path / "run.log")
    try:
        every = asyncio.run(_mcp_side_by_side(env, tmp_path))
        assert runner.poll() is None, (tmp_path / "run.log").read_text()
    finally:
        stop(runner)
    folder = settings_of(env).chroma_path
    state = read_state(folder)
    assert state is not None and supervisors(folder) == [state.pid]
    assert "db_busy" not in (tmp_path / "run.log").read_text()
    assert documents_by_id(settings_of(env), every) == (len(every), len(every))


# -- (b) the starter dies; the server dies -------------------------------------------------


def test_the_server_outlives_its_starter_and_is_restarted_when_it_dies(
    env: dict[str, str], tmp_path: Path
) -> None:
    settings = settings_of(env)
    folder = settings.chroma_path
    with Outbox.open(settings) as ob:
        keys = [ob.add(TOPICS[0]).key]
    starter = daemon(env, tmp_path / "run.log")  # the first to need Chroma: it starts it
    try:
        wait_for(lambda: delivered(settings, keys), "delivery by the daemon")
        state = read_state(folder)
        assert state is not None and supervisors(folder) == [state.pid]
    finally:
        starter.kill()  # SIGKILL
        starter.wait(30)
    time.sleep(1.0)
    assert answers(folder, state), "the server died with its starter"
    assert read_state(folder) == state

    service = MemoryService(Outbox.open(settings))
    try:
        assert_found_by_vector(service.query_raw_memories("staging database migration"), keys[0])
        keys.append(service.add_memory("q", "t", TOPICS[1])["id"])
        assert cli(env, "drain").returncode == 0
        assert read_state(folder) == state, "another server was started"

        os.kill(state.pid, signal.SIGKILL)  # the server itself: its Chroma goes with it
        wait_for(lambda: not shared_server_processes(folder), "the server's end", 60)
        keys.append(service.add_memory("q", "t", TOPICS[2])["id"])
        drained = cli(env, "drain", "--json")  # the next process restarts it
        assert drained.returncode == 0, drained.stdout + drained.stderr
        restarted = read_state(folder)
        assert restarted is not None and restarted.pid != state.pid
        # The service's own connection went with the old server; it finds the new one.
        assert_found_by_vector(service.query_raw_memories("cat salmon"), keys[1])
    finally:
        service.close()
    assert delivered(settings, keys)
    assert supervisors(folder) == [restarted.pid]
    assert documents_by_id(settings, keys) == (len(keys), len(keys))


# -- (c) a race to start it ----------------------------------------------------------------

RACER = """
import json, sys
from pathlib import Path
from outbox.sinks.chroma_service import SharedServer
sys.stdin.readline()
state = SharedServer(Path(sys.argv[1]), 600.0).endpoint()
print(json.dumps([state.pid]), flush=True)
"""


def test_processes_racing_to_start_it_start_exactly_one(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    try:
        time.sleep(1.0)  # every racer imported and waiting at the line
        for racer in racers:
            assert racer.stdin is not None
            racer.stdin.write("go\n")
            racer.stdin.flush()
        answers_seen = {racer.communicate(timeout=180)[0].strip() for racer in racers}
        assert len(answers_seen) == 1, answers_seen
        (pid,) = json.loads(answers_seen.pop())
        assert supervisors(folder) == [pid]
        log = (folder / "outbox-server.log").read_text(encoding="utf-8")
        assert log.count("outbox chroma supervisor") == 1, log
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
        stop_shared_server(folder)


# -- idle stop and the embedded mode --------------------------------------------------------


def test_an_unused_server_stops_by_itself_and_a_user_keeps_it(tmp_path: Path) -> None:
    folder = tmp_path / "store"
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", chroma_path=folder, chroma_idle="2s", embedding="hashing"
    )
    sink = ChromaSink.from_settings(settings)
    try:
        assert sink.count() == 0
        state = read_state(folder)
        assert state is not None
        time.sleep(4.0)  # longer than the idle time, but the sink is still open
        assert answers(folder, state)
    finally:
        sink.close()
        wait_for(lambda: not shared_server_processes(folder), "the idle stop", 60)
        stop_shared_server(folder)
    assert read_state(folder) is None
    assert "OUTBOX_CHROMA_IDLE" in (folder / "outbox-server.log").read_text(encoding="utf-8")


def test_an_embedded_owner_is_named_with_the_setting_to_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.sinks import chroma_service

    monkeypatch.setattr(chroma_service, "STARTUP", 1.0)
    folder = tmp_path / "store"
    folder.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder / OWNER_LOCK)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ChromaServerDown, match="OUTBOX_CHROMA_MODE") as down:
            SharedServer(folder, 600.0).endpoint()
        assert down.value.reason == "transport_closed"
        assert not shared_server_processes(folder)
    finally:
        holder.kill()
        holder.wait(30)
        stop_shared_server(folder)


HOLD = """
import fcntl, os, sys
handle = open(sys.argv[1], "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
handle.seek(0); handle.truncate(); handle.write(f"{os.getpid()}\\n"); handle.flush()
print("held", flush=True)
sys.stdin.read()
"""


# -- (e) a store in a deep folder ----------------------------------------------------------


def test_a_store_whose_socket_path_is_longer_than_a_socket_address_still_works(
    tmp_path: Path,
) -> None:
    """A Unix socket's address holds at most 107 bytes; a store deeper than that is served
    through its folder's descriptor, and its memories are still delivered and found."""
    deep = tmp_path.joinpath(*["a-rather-long-folder-name"] * 4)
    home = deep / ".outbox"
    settings = load_settings(
        home=home, markdown_dir=deep / "md", sinks="chroma", chroma_mode="server"
    )
    assert len(os.fsencode(str(settings.chroma_path / "outbox-server.sock"))) > 108
    try:
        with Outbox.open(settings) as ob:
            key = ob.add(TOPICS[0]).key
            assert ob.drain(timeout=120).ok
            answer = ob.recall("staging database migration")
        assert answer.degraded is None
        assert [hit.key for hit in answer.hits][:1] == [key]
        assert "vector" in answer.hits[0].legs
    finally:
        stop_shared_server(settings.chroma_path)


# -- (f) a server an older version of the library started ----------------------------------

# The supervisor as a version before recall's ids-and-distances calls: it refuses them as it
# refuses any call it does not know.
OLDER_SERVER = """
import sys
from outbox.sinks import chroma_supervisor
chroma_supervisor.OPS = chroma_supervisor.OPS - {"nearest", "nearest_text"}
sys.exit(chroma_supervisor.main(sys.argv[1:]))
"""


def test_recall_asks_a_server_that_predates_its_calls_the_older_way(
    env: dict[str, str], tmp_path: Path
) -> None:
    """A server started by an older library keeps running after an upgrade: recall's vector
    leg falls back to the call that server knows, gets the same neighbours, and leaves the
    server running."""
    settings = settings_of(env)
    folder = settings.chroma_path
    with Outbox.open(settings) as ob:
        keys = [ob.add(topic, metadata={"session_id": "s"}).key for topic in TOPICS]
    private_folder(folder)
    server_key(folder, create=True)
    with (tmp_path / "older.log").open("wb") as log:
        older = subprocess.Popen(
            [sys.executable, "-c", OLDER_SERVER, str(folder), "600"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=folder,
            start_new_session=True,
        )

    def older_answers() -> bool:
        found = read_state(folder)
        return found is not None and found.pid == older.pid and answers(folder, found)

    wait_for(older_answers, "the older server's first answer", 120)
    state = read_state(folder)
    sink = ChromaSink.from_settings(settings)
    backend = SharedBackend(folder, timeout=60.0, idle=600.0)
    try:
        with Outbox.open(settings) as ob:
            assert ob.drain(timeout=120).ok
        with pytest.raises(RuntimeError, match="unknown operation 'nearest_text'"):
            name = builtin_name("minilm")
            backend.call("nearest_text", sink.collection_name, name, "minilm", "cat", 3, None)
        for query, where in (("cat food salmon", None), ("lemon cake oven", {"session_id": "s"})):
            full = sink.search(query, 4, where)
            assert len(full.ids) == 4
            assert sink.nearest(query, 4, where) == list(zip(full.ids, full.distances, strict=True))
        with Outbox.open(settings) as ob:
            answer = ob.recall("cat food salmon", session_id="s")
        assert answer.degraded is None
        assert answer.hits[0].key == keys[1] and "vector" in answer.hits[0].legs
    finally:
        backend.close()
        sink.close()
    assert read_state(folder) == state and older.poll() is None
    stop_shared_server(folder)
    older.wait(30)
