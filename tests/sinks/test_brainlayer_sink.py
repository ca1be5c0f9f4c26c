"""The BrainLayer sink in process, against real BrainLayer 1.5.78 with its database in the
test's folder (``test_brainlayer_mcp.py`` has the MCP mode).

Faults are real too: another process holding BrainLayer's write lock or its writer pidfile,
content BrainLayer's own gates refuse, a database BrainLayer will not write. Each failure
comes out of the sink already classified, as the dispatcher sees it.
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import apsw
import pytest
import yaml
from brainlayer.runtime_store import SchemaFingerprintMismatch
from brainlayer.vector_store import WriterInUseError

import outbox
from outbox import Outbox
from outbox.core.record import Record, build_record
from outbox.dispatch.classify import classify
from outbox.mirror import markdown
from outbox.sinks.brainlayer import INSTALL_HINT, BrainLayerMissing, BrainLayerSink, chunk_id_for
from outbox.sinks.brainlayer_errors import failure_of
from outbox.sinks.registry import load_sink
from outbox.testing.conformance import TEXTS, SinkConformance, SinkHarness, make_due
from tests.brainlayer_env import BrainLayerEnv, hold_write_lock, hold_writer, setup_brainlayer
from tests.helpers.checks import contract_key
from tests.helpers.subproc import child_env, run_cli
from tests.sinks.brainlayer_support import CANONICAL_TS, POISON, TS, bl_settings, row_of


def _copies(bl: BrainLayerEnv, record: Record) -> int:
    """The row under the chunk id derived from the key, then every active row holding that
    row's content: a second memory of the record would show up whatever its id."""
    row = bl.chunk(chunk_id_for(record.key))
    return 0 if row is None else bl.rows_holding(row["content"])


class TestBrainLayerInProcessConformance(SinkConformance):
    @pytest.fixture
    def sink_harness(self, tmp_path: Path, bl: BrainLayerEnv) -> SinkHarness:
        # The hang: BrainLayer waits on a locked database for OUTBOX_BUSY_TIMEOUT (5 s here),
        # longer than the suite's 2 s sink timeout, so the dispatcher's timeout fires while
        # BrainLayer is still blocked in SQLite's busy handler.
        return SinkHarness(
            bl_settings(tmp_path, bl),
            stored_copies=partial(_copies, bl),
            poison=POISON,
            hang=partial(hold_write_lock, bl.db),
        )


# -- in process ----------------------------------------------------------------------------


def test_chunk_id_timestamp_importance_and_tags_reach_brainlayer(
    tmp_path: Path, bl: BrainLayerEnv
) -> None:
    with Outbox.open(bl_settings(tmp_path, bl)) as ob:
        receipt = ob.add(TEXTS[2], importance=8, tags=["decision", "storage"], timestamp=TS)
        assert ob.drain(timeout=60).ok
        row = row_of(ob, receipt.key)
    assert row.sink_id == chunk_id_for(receipt.key)
    assert row.sink_id.startswith("manual-") and len(row.sink_id) == len("manual-") + 16
    stored = bl.chunk(row.sink_id)
    assert stored is not None
    assert stored["created_at"] == CANONICAL_TS == receipt.timestamp
    assert stored["content"] == TEXTS[2]
    assert stored["importance"] == 8.0
    assert json.loads(stored["tags"]) == ["decision", "storage"]
    assert stored["content_type"] == "note"


def test_metadata_type_and_project_reach_brainlayer(tmp_path: Path, bl: BrainLayerEnv) -> None:
    with Outbox.open(bl_settings(tmp_path, bl)) as ob:
        known = ob.add(TEXTS[0], metadata={"type": "decision", "project": "outbox"})
        unknown = ob.add(TEXTS[1], metadata={"type": "rumour"})
        assert ob.drain(timeout=60).ok
    decision = bl.chunk(chunk_id_for(known.key))
    note = bl.chunk(chunk_id_for(unknown.key))
    assert decision is not None and note is not None
    assert (decision["content_type"], decision["project"]) == ("decision", "outbox")
    assert (note["content_type"], note["project"]) == ("note", None)


def test_same_content_and_timestamp_is_one_memory(tmp_path: Path, bl: BrainLayerEnv) -> None:
    """Two outboxes (two machines, say) deliver the same record: BrainLayer holds it once."""
    ids = []
    for name in ("a", "b"):
        settings = bl_settings(tmp_path / name, bl)
        with Outbox.open(settings) as ob:
            receipt = ob.add(TEXTS[4], timestamp=TS)
            assert ob.drain(timeout=60).ok
            ids.append(row_of(ob, receipt.key).sink_id)
    assert ids[0] == ids[1] == chunk_id_for(receipt.key)
    assert bl.rows_holding(TEXTS[4]) == 1
    stored = bl.chunk(ids[0])
    assert stored is not None and stored["seen_count"] == 2


def test_writer_held_elsewhere_is_db_busy_then_delivered_once(
    tmp_path: Path, bl: BrainLayerEnv
) -> None:
    with Outbox.open(bl_settings(tmp_path, bl)) as ob:
        receipt = ob.add(TEXTS[0], timestamp=TS)
        with hold_writer(bl.db):
            report = ob.drain(timeout=60)
            row = row_of(ob, receipt.key)
            assert not report.ok
            assert (row.state, row.error_class, row.sink_id) == ("pending", "db_busy", None)
            assert bl.rows_holding(TEXTS[0]) == 0
        make_due(ob)
        assert ob.drain(timeout=60).ok
        row = row_of(ob, receipt.key)
    assert (row.state, row.attempts, row.sink_id) == ("delivered", 2, chunk_id_for(receipt.key))
    assert bl.rows_holding(TEXTS[0]) == 1


def test_lock_shorter_than_sink_timeout_is_db_busy(tmp_path: Path, bl: BrainLayerEnv) -> None:
    """With the busy wait inside the sink timeout, a held lock is a busy database, reported
    by the sink itself (not a timeout), and the record lands once the lock is gone."""
    settings = bl_settings(tmp_path, bl, busy_timeout=0.5, sink_timeout=30.0)
    with Outbox.open(settings) as ob:
        receipts = [ob.add(text) for text in TEXTS[:3]]
        with hold_write_lock(bl.db):
            report = ob.drain(timeout=60)
        assert not report.ok
        for receipt in receipts:
            row = row_of(ob, receipt.key)
            assert (row.state, row.error_class) == ("pending", "db_busy")
        make_due(ob)
        assert ob.drain(timeout=60).ok
    for text in TEXTS[:3]:
        assert bl.rows_holding(text) == 1


def test_a_held_lock_costs_one_busy_wait_per_batch(tmp_path: Path, bl: BrainLayerEnv) -> None:
    settings = bl_settings(tmp_path, bl, busy_timeout=2.0)
    with Outbox.open(settings) as ob:
        records = [ob.prepare(f"Memory {i}: {TEXTS[i % len(TEXTS)]}") for i in range(10)]
    sink = load_sink("brainlayer", settings)
    with hold_write_lock(bl.db):
        started = time.monotonic()
        outcomes = sink.deliver(records)
        elapsed = time.monotonic() - started
    sink.close()
    assert [classify(o).reason for o in outcomes] == ["db_busy"] * 10  # type: ignore[arg-type]
    assert elapsed < 10, "waiting per record would take 20 s"
    assert all(bl.rows_holding(record.content) == 0 for record in records)


def test_missing_database_is_created_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = setup_brainlayer(tmp_path / "bl", monkeypatch, bootstrap=False)
    assert not env.db.exists()
    with Outbox.open(bl_settings(tmp_path, env)) as ob:
        receipt = ob.add(TEXTS[1])
        assert ob.drain(timeout=60).ok
        first_inode = env.db.stat().st_ino
        ob.add(TEXTS[3])
        assert ob.drain(timeout=60).ok
        assert row_of(ob, receipt.key).state == "delivered"
    assert env.db.stat().st_ino == first_inode
    assert env.rows_holding(TEXTS[1]) == env.rows_holding(TEXTS[3]) == 1


def test_foreign_database_is_retried_never_migrated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that is not a current BrainLayer database fails BrainLayer's schema check: the
    record waits (db_busy) and the file is left exactly as it was."""
    env = setup_brainlayer(tmp_path / "bl", monkeypatch, bootstrap=False)
    env.db.parent.mkdir(parents=True)
    with sqlite3.connect(env.db) as conn:
        conn.execute("CREATE TABLE chunks (id TEXT PRIMARY KEY, content TEXT)")
    before = env.db.read_bytes()
    with Outbox.open(bl_settings(tmp_path, env)) as ob:
        receipt = ob.add(TEXTS[0])
        assert not ob.drain(timeout=60).ok
        row = row_of(ob, receipt.key)
    assert (row.state, row.error_class) == ("pending", "db_busy")
    assert "SchemaFingerprintMismatch" in (row.last_error or "")
    assert env.db.read_bytes() == before


def test_default_database_is_brainlayers_own(tmp_path: Path, bl: BrainLayerEnv) -> None:
    """Without OUTBOX_BRAINLAYER_DB the sink writes where BrainLayer itself would (here the
    temporary BRAINLAYER_DB)."""
    settings = replace(bl_settings(tmp_path, bl), brainlayer_db=None)
    sink = load_sink("brainlayer", settings)
    assert isinstance(sink, BrainLayerSink)
    assert sink.db_path == bl.db


def test_markdown_front_matter_gets_brainlayers_chunk_id(tmp_path: Path, bl: BrainLayerEnv) -> None:
    # Leading/trailing whitespace (BrainLayer strips it, the mirror must not), a fence-like
    # line, YAML-looking text and no final newline.
    content = "  chunk_id: fake\n---\nkey: [not, yaml]\n\u00e9t\u00e9 \U0001f9e0 done  "
    with Outbox.open(bl_settings(tmp_path, bl)) as ob:
        receipt = ob.add(content, tags=["a: b", "- c"], importance=9)
        path = receipt.markdown_path
        assert path is not None
        assert ob.wait_mirrored(10)  # the receipt names the file the mirror writer writes
        before = path.read_bytes()
        _, body_before = markdown.parse(before)
        assert body_before == content.encode("utf-8")
        assert yaml.safe_load(before.split(b"---\n")[1])["chunk_id"] is None
        with hold_writer(bl.db):
            ob.drain(timeout=60)  # one failed attempt first, so retry_attempted turns true
        make_due(ob)
        assert ob.drain(timeout=60).ok
        chunk_id = row_of(ob, receipt.key).sink_id
    data = path.read_bytes()
    matter_text, body = data[len(b"---\n") :].split(b"\n---\n", 1)
    matter = yaml.safe_load(matter_text)
    assert matter["chunk_id"] == chunk_id == chunk_id_for(receipt.key)
    assert bl.chunk(chunk_id) is not None
    assert matter["retry_attempted"] is True
    assert matter["tags"] == ["a: b", "- c"] and matter["importance"] == 9
    assert body == content.encode("utf-8")


def test_poison_never_appears_in_logs_or_errors(
    tmp_path: Path, bl: BrainLayerEnv, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with Outbox.open(bl_settings(tmp_path, bl)) as ob:
        bad = ob.add(POISON)
        ob.drain(timeout=60)
        row = row_of(ob, bad.key)
    assert (row.state, row.error_class) == ("dead", "rejected")
    assert "recursive MCP output" in (row.last_error or "")
    assert POISON not in (row.last_error or "")
    assert all(POISON not in r.getMessage() for r in caplog.records if r.levelno >= logging.INFO)
    assert bl.rows_holding(POISON) == 0


def test_missing_brainlayer_is_one_clear_retryable_error(
    tmp_path: Path, bl: BrainLayerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "brainlayer.runtime_store", None)
    with pytest.raises(BrainLayerMissing) as caught:
        load_sink("brainlayer", bl_settings(tmp_path, bl))
    message = str(caught.value)
    assert "\n" not in message and INSTALL_HINT in message
    assert "pip install --no-deps brainlayer==1.5.78" in message
    assert classify(caught.value).transient


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (apsw.BusyError("database is locked"), ("db_busy", True)),
        (apsw.ReadOnlyError("attempt to write a readonly database"), ("readonly", True)),
        (WriterInUseError("another writer is using /x/brainlayer.db (pid 5)"), ("db_busy", True)),
        (
            SchemaFingerprintMismatch(
                "runtime schema fingerprint mismatch", actual_fingerprint="0"
            ),
            ("db_busy", True),
        ),
        (
            SchemaFingerprintMismatch(
                "readonly database does not exist: /x", actual_fingerprint="0"
            ),
            ("readonly", True),
        ),
        (sqlite3.OperationalError("database is locked"), ("db_busy", True)),
        (RuntimeError("DEFERRED: Memory queued (DB busy)"), ("queued_null_chunk", True)),
        (apsw.LockedError("database table is locked"), ("unknown", True)),
        (RuntimeError("something odd"), ("unknown", True)),
        (TypeError("store_memory() got an unexpected keyword argument"), ("rejected", False)),
    ],
)
def test_brainlayers_own_exceptions_keep_their_classes(
    exc: BaseException, expected: tuple[str, bool]
) -> None:
    failure = classify(failure_of(exc))
    assert (failure.reason, failure.transient) == expected
    assert type(exc).__name__ in failure.message


def test_an_error_quoting_the_memory_is_classified_without_quoting_it() -> None:
    # Words of the memory ("timed out") must not steer the class either.
    record = build_record("a private memory that timed out in the text")
    quoted = apsw.BusyError(f"could not store {record.content!r}")
    failure = classify(failure_of(quoted, record))
    assert (failure.reason, failure.transient) == ("db_busy", True)
    assert record.content not in failure.message
    odd = RuntimeError(f"odd failure for {record.content!r}")
    assert record.content not in str(failure_of(odd, record))


SEED_FILE = "2026-03-14-quoted-timestamp.md"  # a seed-000 fallback file, pending
FIXTURES = Path(__file__).parent.parent / "fixtures" / "legacy"


def test_a_replayed_seed_000_file_reaches_brainlayer_with_its_provenance(
    tmp_path: Path, bl: BrainLayerEnv
) -> None:
    """``outbox replay`` (the real command) imports a seed-000 file; the drain hands
    BrainLayer's ``store_memory`` the file's absolute path and ``outbox <version>``, as
    BrainLayer's own replay does, and BrainLayer keeps both on the chunk. The key is still
    the content's and the timestamp's."""
    settings = bl_settings(tmp_path, bl)
    settings.markdown_dir.mkdir(mode=0o700)
    source = settings.markdown_dir / SEED_FILE
    shutil.copyfile(FIXTURES / SEED_FILE, source)
    env = child_env(
        settings.home,
        markdown_dir=str(settings.markdown_dir),
        sinks="brainlayer",
        brainlayer_db=str(bl.db),
    )
    done = run_cli(["replay", "--json"], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    (prefix,) = json.loads(done.stdout)["imported"]
    body = source.read_bytes().split(b"---\n", 2)[2].decode("utf-8")
    key = contract_key(body, "2026-03-14T09:15:00.000000Z")
    assert key.startswith(prefix)
    with Outbox.open(settings) as ob:
        assert ob.drain(timeout=60).ok
        assert row_of(ob, key).sink_id == chunk_id_for(key)
    ((stored,),) = bl.query("SELECT metadata FROM chunks WHERE id = ?", (chunk_id_for(key),))
    metadata = json.loads(stored)
    assert metadata["fallback_source_path"] == str(source.resolve())
    assert metadata["replayed_by"] == f"outbox {outbox.__version__}"
    matter, _body = markdown.read(source)
    assert (matter["chunk_id"], matter["reason"]) == (chunk_id_for(key), "db_busy")
