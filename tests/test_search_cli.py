"""``outbox search`` and ``outbox recent`` from a shell: the answers the library gives,
without loading the model or the database toolkit.

The shared Chroma server embeds the query (``query_text``), so a search loads neither
onnxruntime, tokenizers, numpy nor chromadb; on a store in its steady state both commands read
through SQLite's bare recall reads, without SQLAlchemy either (``recall/direct.py``). These
tests hold them to the same answers as the library calls, under each filter and cursor, and
the server's query vector to the one this process would have made; a store with a fallback
file waiting is searched through the full open, which imports the file first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox import Outbox, Settings, load_settings
from outbox.faces.demo import TURNS
from outbox.memory_core import MemoryService, recall_view
from outbox.sinks.chroma_service import SharedBackend
from outbox.sinks.embedding import builtin_name, load_embedding
from outbox.write.fallback import FallbackQueue
from tests.chroma_server import stop_servers_under
from tests.helpers.faults import held_write_lock

QUERIES = (
    "when does the nightly backfill run?",  # both legs
    "which database settings did we pick",  # by meaning
    "heron quarry",  # by its words
    "banana smoothie recipe",  # nothing
)
NOT_LOADED = ("chromadb", "onnxruntime", "tokenizers", "numpy", "sqlalchemy", "alembic")
# (Outbox.recall's options, the same as command-line flags)
OPTIONS: tuple[tuple[dict[str, Any], tuple[str, ...]], ...] = (
    ({}, ()),
    ({"min_relevance": 0.0, "limit": 5}, ("-n", "5", "--min-relevance", "0")),
    ({"session_id": "a", "min_relevance": 0.0}, ("--session", "a", "--min-relevance", "0")),
    ({"tags": ["ops"], "min_relevance": 0.0}, ("--tag", "ops", "--min-relevance", "0")),
    (
        {"since": "2000-01-01", "min_importance": 5},
        ("--since", "2000-01-01", "--min-importance", "5"),
    ),
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A store of the demo's turns and a few notes, drained into its shared Chroma server."""
    folder = tmp_path_factory.mktemp("search-cli")
    settings = load_settings(
        env={}, home=folder / ".outbox", markdown_dir=folder / "md", sinks="chroma"
    )
    try:
        with Outbox.open(settings) as ob:
            for prompt, thought, response in TURNS:
                ob.add(f"{prompt} → {response}", metadata={"session_id": "a", "thought": thought})
            ob.add("The nightly backfill moved to the spare host.", tags=["ops"])
            ob.add("We chose SQLite in WAL mode with synchronous FULL.", tags=["decision"])
            assert ob.drain(timeout=120).ok
        yield settings
    finally:
        stop_servers_under(folder)


def _environ(settings: Settings) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    env.update(
        OUTBOX_HOME=str(settings.home),
        OUTBOX_MARKDOWN_DIR=str(settings.markdown_dir),
        OUTBOX_SINKS="chroma",
    )
    return env


def _shell_search(settings: Settings, *args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "search", *args, "--json"],
        env=_environ(settings),
        cwd=settings.home.parent,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answer: dict[str, object] = json.loads(done.stdout)
    return answer


def test_search_in_a_shell_answers_as_recall_does(store: Settings) -> None:
    answered = 0
    with Outbox.open(store) as ob:
        for query in QUERIES:
            for options, flags in OPTIONS:
                expected = json.loads(
                    json.dumps(recall_view(ob.recall(query, **options)), default=str)
                )
                assert _shell_search(store, query, *flags) == expected, (query, flags)
                answered += bool(expected["results"])
    assert answered >= len(QUERIES) * len(OPTIONS) // 2  # the filters left hits to compare
    meant = _shell_search(store, QUERIES[1])["results"]
    assert isinstance(meant, list) and "vector" in meant[0]["legs"]  # the server was asked


def _answer_and_heavy_modules(settings: Settings, *argv: str) -> tuple[Any, list[str]]:
    """The command's ``--json`` answer in a fresh interpreter, and which of ``NOT_LOADED``
    that process had imported by the end."""
    script = (
        "import json, sys\n"
        "from outbox.faces.cli import main\n"
        f"code = main({[*argv, '--json']!r})\n"
        f"heavy = {NOT_LOADED!r}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=_environ(settings),
        cwd=settings.home.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    answer, loaded = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    return answer, loaded


def test_search_in_a_shell_loads_no_model_numpy_or_chromadb(store: Settings) -> None:
    answer, loaded = _answer_and_heavy_modules(store, "search", QUERIES[0])
    assert {"lexical", "vector"} <= set(answer["results"][0]["legs"])
    assert loaded == []


def test_the_server_embeds_a_query_as_this_process_would(store: Settings) -> None:
    """The same vector, so the same neighbours at the same distances, to the last bit."""
    name = builtin_name("minilm")
    assert name is not None
    embedder = load_embedding("minilm")
    backend = SharedBackend(store.chroma_path, timeout=60.0, idle=600.0)
    try:
        for query in QUERIES:
            (vector,) = getattr(embedder, "embed_query", embedder)([query])
            here = backend.call("query", store.chroma_collection, name, vector, 6, None)
            there = backend.call(
                "query_text", store.chroma_collection, name, "minilm", query, 6, None
            )
            assert there == here and len(there["ids"]) == 6
    finally:
        backend.close()


def test_recall_s_calls_answer_the_query_s_ids_and_distances(store: Settings) -> None:
    """``nearest`` and ``nearest_text`` leave out the documents and metadata and nothing
    else: the same neighbours at the same distances, with a filter and without."""
    name = builtin_name("minilm")
    assert name is not None
    embedder = load_embedding("minilm")
    backend = SharedBackend(store.chroma_path, timeout=60.0, idle=600.0)
    collection = store.chroma_collection
    try:
        for query in QUERIES:
            for where in (None, {"session_id": "a"}):
                (vector,) = getattr(embedder, "embed_query", embedder)([query])
                full = backend.call("query", collection, name, vector, 6, where)
                assert len(full["ids"]) == (6 if where is None else 5) and all(full["documents"])
                pairs = {"ids": full["ids"], "distances": full["distances"]}
                assert backend.call("nearest", collection, name, vector, 6, where) == pairs
                there = backend.call("nearest_text", collection, name, "minilm", query, 6, where)
                assert there == pairs
    finally:
        backend.close()


def _cli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_waiting_fallback_file_is_imported_before_the_search(tmp_path: Path) -> None:
    """The bare read would miss a memory still in the fallback queue: with one waiting, the
    search takes the full open, which imports it, and finds it by its words."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    env.update(
        OUTBOX_HOME=str(tmp_path / ".outbox"),
        OUTBOX_MARKDOWN_DIR=str(tmp_path / "md"),
        OUTBOX_SINKS="outbox.testing.sinks:FaultySink",
        OUTBOX_FAULTY_DB=str(tmp_path / "sink.db"),
    )
    first = _cli(env, tmp_path, "add", "a first memory about the heron quarry")
    assert first.returncode == 0, first.stderr
    with held_write_lock(tmp_path / ".outbox" / "outbox.db"):
        refused = _cli(
            {**env, "OUTBOX_BUSY_TIMEOUT": "0.2"}, tmp_path, "add", "--json", "the otter ledger"
        )
    assert refused.returncode == 0, refused.stderr
    assert json.loads(refused.stdout)["status"] == "fallback"
    found = _cli(env, tmp_path, "search", "otter ledger", "--json")
    assert found.returncode == 0, found.stderr
    results = json.loads(found.stdout)["results"]
    assert [hit["content"] for hit in results] == ["the otter ledger"]
    status = _cli(env, tmp_path, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["records"] == 2  # imported, not just read
    assert FallbackQueue(tmp_path / "md", ["outbox.testing.sinks:FaultySink"]).pending_count() == 0


def _shell_recent(settings: Settings, *args: str) -> dict[str, Any]:
    done = _cli(_environ(settings), settings.home.parent, "recent", *args, "--json")
    assert done.returncode == 0, done.stderr
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def test_recent_in_a_shell_answers_as_memory_core_does(store: Settings) -> None:
    """``outbox recent`` reads a steady store on the bare driver too: the same page, the same
    cursor, under each filter, following the cursor to the last page."""
    service = MemoryService(Outbox.open(store))
    try:
        for options, flags in (
            ({}, ()),
            ({"limit": 3}, ("--limit", "3")),
            ({"session_id": "a", "limit": 2}, ("--session", "a", "--limit", "2")),
            ({"agent": "nobody"}, ("--agent", "nobody")),
        ):
            expected = service.query_recent_turns(**options)
            assert _shell_recent(store, *flags) == expected, flags
        pages, cursor = 0, None
        while True:
            flags = ("--limit", "2") + (
                ("--before", f"{cursor['timestamp']}|{cursor['id']}") if cursor else ()
            )
            page = _shell_recent(store, *flags)
            assert page == service.query_recent_turns(limit=2, before=cursor)
            pages += 1
            cursor = page["nextCursor"]
            if cursor is None:
                break
        assert pages >= 3  # the demo's turns and two notes: several pages of two
    finally:
        service.close()


def test_recent_in_a_shell_loads_no_database_toolkit(store: Settings) -> None:
    answer, loaded = _answer_and_heavy_modules(store, "recent")
    assert answer["count"] > 0
    assert loaded == []
