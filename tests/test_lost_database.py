"""A store whose JSONL log names records its database lacks is never quietly treated as empty
(issue 21, case 13): the database is not written, every write goes to the fallback queue
(reason ``db_missing``), ``status`` and ``verify`` say what is missing and name `outbox
rebuild`, the reads (``search``, ``recent``, ``show``, ``export``, memory-core's queries, the
dashboard) of a deleted database refuse with the same words instead of answering as if the
store were empty (an older copy answers with what it holds), and
the rebuild brings back every record and every write made meanwhile, once.

Through the real command in child processes, the Python façade and memory-core, on the
files they leave.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from collections import Counter
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from outbox import Outbox, Settings, load_settings
from outbox.core.errors import DatabaseLacksRecords
from outbox.memory_core import MemoryService
from tests.conftest import FAULTY
from tests.helpers.checks import jsonl_events
from tests.helpers.subproc import child_env, run_cli
from tests.pg import fresh_database


def _env(settings: Settings) -> dict[str, str]:
    return child_env(settings.home, db_url=settings.db_url, markdown_dir=str(settings.markdown_dir))


def _cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[bytes]:
    return run_cli(list(args), cwd=settings.home.parent, env=_env(settings), timeout=120)


def _json(settings: Settings, *args: str) -> dict[str, Any]:
    done = _cli(settings, *args, "--json")
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert isinstance(payload, dict)
    return payload


def _written(settings: Settings, count: int) -> list[str]:
    """``count`` records written by the real command; their keys."""
    return [_json(settings, "add", f"memory {n} kept in the log")["key"] for n in range(count)]


def _lose(settings: Settings) -> Path:
    database = settings.home / "outbox.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{database}{suffix}").unlink(missing_ok=True)
    return database


def _refused_add(settings: Settings, content: str, command: str) -> dict[str, Any]:
    """``outbox add`` on a store with the gap: accepted into the fallback queue (exit 0, the
    receipt says so), and one line on stderr naming ``command``."""
    done = _cli(settings, "add", content, "--json")
    assert done.returncode == 0, done.stderr
    receipt = json.loads(done.stdout)
    assert (receipt["status"], receipt["reason"]) == ("fallback", "db_missing")
    assert Path(receipt["markdown_path"]).is_file()
    (line,) = done.stderr.decode("utf-8").splitlines()
    assert f"run `{command}`" in line and content not in line
    assert isinstance(receipt, dict)
    return receipt


def _stored_keys(settings: Settings) -> Counter[str]:
    with Outbox.open(settings, repair=False) as ob:
        assert ob.missing is None
        return Counter(item.record.key for item in ob.storage.records.iter_records())


def _logged_keys(settings: Settings) -> Counter[str]:
    return Counter(e["key"] for e in jsonl_events(settings.jsonl_path) if e["event"] == "accepted")


def test_a_deleted_database_is_refused_until_rebuilt_and_loses_nothing(settings: Settings) -> None:
    before = _written(settings, 3)
    database = _lose(settings)

    cli = _refused_add(settings, "written by the command after the loss", "outbox rebuild")
    assert not database.exists()  # the deleted file is not replaced by an empty one
    with Outbox.open(settings) as ob:
        assert ob.missing is not None and ob.missing.command == "outbox rebuild"
        api = ob.add("written from Python after the loss")
        assert (api.status, api.reason) == ("fallback", "db_missing")
        core = MemoryService(ob).add_memory(
            prompt="asked after the loss", thought="thinking", response="answered anyway"
        )
    assert core["status"] == "fallback" and Path(core["markdownPath"]).is_file()
    assert "`outbox rebuild`" in core["visibility"]["hint"]
    assert not database.exists()

    status = _json(settings, "status")
    assert status["records"] == 0
    assert status["missing"] == {
        "database_records": 0,
        "log_records": 3,
        "fallback_waiting": 3,
        "run": "outbox rebuild",
        "problem": status["missing"]["problem"],
    }
    text_status = _cli(settings, "status")
    assert text_status.returncode == 0
    assert (
        "warning: the database holds 0 records; the log holds 3; 3 writes wait in the "
        "fallback queue; run `outbox rebuild`"
    ) in text_status.stdout.decode("utf-8")
    verified = _cli(settings, "verify")
    assert verified.returncode == 1 and b"run `outbox rebuild`" in verified.stdout
    assert not database.exists()
    for read in (["search", "memory kept"], ["recent"], ["show", before[0][:12]], ["export"]):
        done = _cli(settings, *read)  # never an empty answer, as if the store held nothing
        (line,) = done.stderr.decode("utf-8").splitlines()
        assert done.returncode == 1 and "run `outbox rebuild`" in line, read
        assert done.stdout == b"", read
    with Outbox.open(settings, repair=False) as ob:
        service = MemoryService(ob)
        for ask in (lambda: service.query_recent_turns(), lambda: service.query_raw_memories("x")):
            with pytest.raises(DatabaseLacksRecords):
                ask()
    assert not database.exists()

    rebuilt = _json(settings, "rebuild")
    assert (rebuilt["from_log"], rebuilt["from_markdown"]) == (3, 3)
    assert _json(settings, "add", "written after the rebuild")["status"] == "queued"
    assert _cli(settings, "verify").returncode == 0
    stored, logged = _stored_keys(settings), _logged_keys(settings)
    assert {*before, cli["key"], api.key, core["id"]} <= set(stored) and len(stored) == 7
    assert max(stored.values()) == 1 and stored == logged  # each once, in both
    assert "missing" not in _json(settings, "status")


def test_an_older_copy_put_back_names_the_merge(settings: Settings) -> None:
    """The direct write (a steady SQLite store, no SQLAlchemy) must refuse too: the copy has
    its schema and recorded places, but not the log's newest records."""
    _written(settings, 2)
    database = settings.home / "outbox.db"
    with closing(sqlite3.connect(database)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    backup = settings.home.parent / "backup.db"
    shutil.copyfile(database, backup)
    newer = _written(settings, 2)
    _lose(settings)
    shutil.copyfile(backup, database)

    receipt = _refused_add(settings, "written onto the older copy", "outbox rebuild --merge")
    status = _json(settings, "status")
    assert (status["records"], status["missing"]["log_records"]) == (2, 4)
    assert status["missing"]["run"] == "outbox rebuild --merge"
    assert b"`outbox rebuild --merge`" in _cli(settings, "verify").stdout
    assert _json(settings, "recent")["count"] == 2  # reads answer with what the copy holds

    merged = _json(settings, "rebuild", "--merge")
    assert merged["restored"] == 3 and merged["already_there"] == 2
    stored = _stored_keys(settings)
    assert {*newer, receipt["key"]} <= set(stored) and max(stored.values()) == 1
    assert _cli(settings, "verify").returncode == 0
    assert stored == _logged_keys(settings)


def test_a_new_store_and_an_empty_log_just_work(settings: Settings) -> None:
    """No log yet, or an empty one: nothing is missing, the first write is committed."""
    settings.home.mkdir(mode=0o700)
    settings.jsonl_path.touch(mode=0o600)
    receipt = _json(settings, "add", "the very first memory")
    assert receipt["status"] == "queued"
    assert "missing" not in _json(settings, "status")


@pytest.mark.postgres
def test_postgres_tables_dropped_are_refused_until_rebuilt(tmp_path: Path) -> None:
    """On PostgreSQL the open's migration brings dropped tables back empty; the check then
    finds the log's records missing, as for a deleted SQLite file."""
    with fresh_database() as url:
        settings = load_settings(
            env={},
            db_url=url,
            home=tmp_path / ".outbox",
            markdown_dir=tmp_path / "docs.local" / "decisions",
            sinks=FAULTY,
        )
        before = _written(settings, 3)
        engine = create_engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(text("DROP SCHEMA public CASCADE"))
                conn.execute(text("CREATE SCHEMA public"))
        finally:
            engine.dispose()

        receipt = _refused_add(settings, "written after the tables went", "outbox rebuild")
        status = _json(settings, "status")
        assert (status["records"], status["missing"]["log_records"]) == (0, 3)
        assert _cli(settings, "verify").returncode == 1

        assert _json(settings, "rebuild")["restored"] == 4
        stored = _stored_keys(settings)
        assert {*before, receipt["key"]} == set(stored) and max(stored.values()) == 1
        assert _cli(settings, "verify").returncode == 0
