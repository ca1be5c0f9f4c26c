"""Helpers for the Chroma sink's tests: settings, a chromadb client of the test's own, and an
outside process holding the embedded store's SQLite lock.

``chroma_settings`` gives the embedded mode unless a URL or ``chroma_mode`` is passed: most of
these tests are about the embedded child; the shared server has its own (test_shared_chroma).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import chromadb

from outbox import Settings, load_settings
from outbox.core.record import Record
from outbox.sinks.chroma_client import parse_chroma_url
from tests.chroma_server import stop_shared_server

# Zero-width space, word joiner, BOM: passes the outbox's own validation (str.strip() keeps
# them), but the tokenizer drops every one, so it would embed to the empty string's vector.
INVISIBLE = "\u200b\u2060\ufeff\u200b"

HOLD_LOCK = """
import select, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
select.select([sys.stdin], [], [], float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


def chroma_settings(tmp_path: Path, **overrides: Any) -> Settings:
    if not overrides.get("chroma_url"):
        overrides.setdefault("chroma_mode", "embedded")
    overrides.setdefault("chroma_collection", f"test-{uuid.uuid4().hex[:12]}")
    return load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks="chroma",
        chroma_path=tmp_path / "chroma",
        **overrides,
    )


@contextlib.contextmanager
def open_client(settings: Settings) -> Iterator[Any]:
    """A chromadb client of our own, to look at the store without the sink's code."""
    client: Any
    if settings.chroma_url:
        host, port, ssl = parse_chroma_url(settings.chroma_url)
        client = chromadb.HttpClient(host=host, port=port, ssl=ssl)
    else:
        # The shared server answers only the sink's own calls, over its owner-only socket:
        # stop it (never open a folder a server owns; the sink's next call starts it again).
        if settings.chroma_mode == "server":
            stop_shared_server(settings.chroma_path)
        client = chromadb.PersistentClient(str(settings.chroma_path))
    try:
        yield client
    finally:
        client.close()


def stored_ids(settings: Settings) -> list[str]:
    with open_client(settings) as client:
        return list(client.get_collection(settings.chroma_collection).get(include=[])["ids"])


def stored_copies(settings: Settings, record: Record) -> int:
    """Documents under the record's key in the collection, read with our own client."""
    from chromadb.errors import NotFoundError

    with open_client(settings) as client:
        try:
            collection = client.get_collection(settings.chroma_collection)
        except NotFoundError:  # nothing was ever delivered: no collection, no copy
            return 0
        return len(collection.get(ids=[record.key], include=[])["ids"])


@contextlib.contextmanager
def exclusive_lock(database: Path) -> Iterator[None]:
    """Another process holds ``BEGIN EXCLUSIVE`` until the block ends (for a bounded time,
    so a regression fails the test instead of wedging the run)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(database), "60"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0


@contextlib.contextmanager
def locked_store(settings: Settings) -> Iterator[None]:
    """The embedded store's database locked by another process for the block."""
    with open_client(settings):  # make sure chroma.sqlite3 exists before locking it
        pass
    with exclusive_lock(settings.chroma_path / "chroma.sqlite3"):
        yield
