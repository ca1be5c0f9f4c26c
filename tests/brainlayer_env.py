"""Real BrainLayer in a temporary folder, for any test that touches it.

``setup_brainlayer`` points every path BrainLayer would resolve (database, queue, writer
pidfile and heartbeat folders, ``HOME``) into the test's folder, forbids model downloads and
embedding-model loads, turns writer telemetry off, and satisfies BrainLayer's own pytest guard
(which refuses to resolve a database path under pytest without provenance). It then creates
the database the supported way. Nothing touches the real home folder.

The rest are outside actors for fault tests: another process holding BrainLayer's write lock
or its writer pidfile, a reader of its database that goes around every BrainLayer API, and
BrainLayer's own queue drain.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# The real home, captured before any test moves HOME: BrainLayer's guard protects it.
_REAL_HOME = Path(os.path.expanduser("~")).resolve()
HARNESS = Path(__file__).parent / "helpers" / "brainlayer_mcp_server.py"
_READY = "ready"


@dataclass(frozen=True)
class BrainLayerEnv:
    """Where BrainLayer lives for one test."""

    root: Path
    db: Path
    queue_dir: Path

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Read BrainLayer's database directly with apsw, read-only, bypassing BrainLayer."""
        import apsw

        conn = apsw.Connection(str(self.db), flags=apsw.SQLITE_OPEN_READONLY)
        try:
            conn.setbusytimeout(5000)
            return list(conn.execute(sql, params))
        finally:
            conn.close()

    def rows_holding(self, content: str) -> int:
        """How many active memories hold exactly this content (BrainLayer stores it stripped;
        an archive sets ``archived_at``, which BrainLayer's own reads treat as gone)."""
        ((count,),) = self.query(
            "SELECT count(*) FROM chunks WHERE content = ? AND COALESCE(archived, 0) = 0"
            " AND archived_at IS NULL AND superseded_by IS NULL",
            (content.strip(),),
        )
        return int(count)

    def chunk(self, chunk_id: str) -> dict[str, Any] | None:
        keys = (
            "id",
            "content",
            "created_at",
            "importance",
            "tags",
            "content_type",
            "project",
            "seen_count",
        )
        rows = self.query(f"SELECT {', '.join(keys)} FROM chunks WHERE id = ?", (chunk_id,))
        return dict(zip(keys, rows[0], strict=True)) if rows else None

    def queued_files(self) -> list[Path]:
        return sorted(self.queue_dir.glob("*.jsonl"))

    def drain_queue(self) -> int:
        """Apply BrainLayer's own queue of deferred writes (what its drain daemon does)."""
        from brainlayer.drain import drain_once

        applied = drain_once(
            db_path=self.db,
            queue_dir=self.queue_dir,
            log_path=self.root / "drain.log",
            pause_sentinel_path=self.root / "pause.sentinel",
        )
        return int(applied)


def brainlayer_environ(root: Path) -> dict[str, str]:
    """The environment that keeps BrainLayer inside ``root`` and offline."""
    return {
        "HOME": str(root / "home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "BRAINLAYER_FORBID_EMBEDDING_MODEL": "1",
        "BRAINLAYER_WRITER_TELEMETRY": "0",
        "BRAINLAYER_DB": str(root / "data" / "brainlayer.db"),
        "BRAINLAYER_QUEUE_DIR": str(root / "queue"),
        "BRAINLAYER_WRITER_PIDFILE_DIR": str(root / "pid"),
        "BRAINLAYER_WRITER_HEARTBEAT_DIR": str(root / "heartbeat"),
        "BRAINLAYER_DRAIN_LOG_PATH": str(root / "drain.log"),
        "BRAINLAYER_TEST_PATH_PROVENANCE": "pytest",
        "BRAINLAYER_TEST_PROTECTED_HOME": str(_REAL_HOME),
    }


def setup_brainlayer(
    root: Path, monkeypatch: pytest.MonkeyPatch, *, bootstrap: bool = True
) -> BrainLayerEnv:
    """Set the environment (undone by ``monkeypatch``) and create the database once."""
    root.mkdir(parents=True, exist_ok=True)
    for name, value in brainlayer_environ(root).items():
        monkeypatch.setenv(name, value)
    (root / "home").mkdir(exist_ok=True)
    env = BrainLayerEnv(root=root, db=root / "data" / "brainlayer.db", queue_dir=root / "queue")
    if bootstrap:
        from brainlayer.vector_store import VectorStore

        VectorStore(env.db).close()
    return env


@contextlib.contextmanager
def _holder(script: str, db: Path) -> Iterator[subprocess.Popen[str]]:
    """Run ``script`` in another process until the block ends; it prints ready when holding."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), str(db)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != _READY:
            raise RuntimeError(f"lock holder did not start (said {line!r}, rc={proc.poll()})")
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def hold_write_lock(db: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holds ``BEGIN EXCLUSIVE`` on BrainLayer's database until the block ends.

    BrainLayer runs in WAL mode, so readers carry on; every writer waits on the lock.
    """
    script = f"""
        import sqlite3, sys
        conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
        conn.execute("BEGIN EXCLUSIVE")
        print({_READY!r}, flush=True)
        sys.stdin.read()
        conn.execute("ROLLBACK")
        conn.close()
    """
    with _holder(script, db) as proc:
        yield proc


@contextlib.contextmanager
def hold_writer(db: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holds BrainLayer's single-writer pidfile (an open runtime writer),
    as a running BrainLayer MCP server does for its whole life."""
    script = f"""
        import sys
        from pathlib import Path
        from brainlayer.runtime_store import open_writer_store
        store = open_writer_store(Path(sys.argv[1]))
        print({_READY!r}, flush=True)
        sys.stdin.read()
        store.close()
    """
    with _holder(script, db) as proc:
        yield proc


def harness_command() -> str:
    """``OUTBOX_BRAINLAYER_MCP`` for the stdio test double over BrainLayer's handlers."""
    return shlex.join([sys.executable, str(HARNESS)])
