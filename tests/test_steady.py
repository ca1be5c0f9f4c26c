"""The store's one steady-state check (``store/steady.py``): it names each kind of work the
repair owes, counts only what this machine's repair would do, and agrees with the repair: what
the full repair clears, the check no longer owes."""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from outbox import Outbox, Settings
from outbox.store.steady import MIRRORS_DUE, PURGE_DUE, Owed, SteadyCheck, Watermark, log_owed


@pytest.mark.parametrize(
    ("mark", "torn", "continues", "owed"),
    [
        (Watermark(3, 900, "h"), False, True, None),
        (Watermark(3, 900, "h"), True, True, Owed.TORN_LOG),
        (Watermark(0, 0, None), False, True, Owed.NEVER_REPAIRED),
        (Watermark(3, 900, "h"), False, False, Owed.LOG_REPLACED),
    ],
)
def test_the_log_is_owed_a_rescan_for_a_torn_tail_no_watermark_or_a_broken_chain(
    mark: Watermark, torn: bool, continues: bool, owed: Owed | None
) -> None:
    assert log_owed(mark, torn=torn, continues=continues) == owed


@dataclass
class Log:
    """The mirrors as the check sees them: a whole log whose chain continues, holding the
    accepted lines and files of every record unless a test says otherwise."""

    keys: set[str]
    files: set[str]
    torn_tail: bool = False
    continues: bool = True
    moved_to: list[int] = field(default_factory=list)

    def torn(self) -> bool:
        return self.torn_tail

    def continues_at(self, offset: int, line_hash: str | None) -> bool:
        return self.continues

    def accepted_since(self, offset: int) -> Collection[str]:
        return self.keys

    def has_file(self, name: str) -> bool:
        return name in self.files

    def end(self) -> tuple[int, str | None]:
        self.moved_to.append(4242)
        return 4242, "end-hash"


@pytest.fixture
def store(settings: Settings) -> Iterator[tuple[Settings, sqlite3.Connection]]:
    """A store in its steady state (one record, repaired), and a bare connection to it."""
    with Outbox.open(settings) as ob:
        ob.add("the first memory of a steady store")
        ob.wait_mirrored(10)
        ob.sync_mirrors()
    conn = sqlite3.connect(settings.home / "outbox.db", isolation_level=None)
    try:
        yield settings, conn
    finally:
        conn.close()


def mirrored(conn: sqlite3.Connection) -> Log:
    rows = conn.execute('SELECT "key", markdown_name FROM records').fetchall()
    return Log({key for key, _ in rows}, {name for _, name in rows})


def owed(settings: Settings, conn: sqlite3.Connection, log: Log | None = None) -> Owed | None:
    return SteadyCheck(conn).catch_up(
        settings.mirror_id, log or mirrored(conn), fallback_waits=False
    )


def add_record(settings: Settings, content: str) -> str:
    with Outbox.open(settings, repair=False) as ob:
        key = ob.add(content).key
        ob.wait_mirrored(10)
    return key


def test_a_steady_store_owes_nothing_and_its_watermark_moves_past_new_records(
    store: tuple[Settings, sqlite3.Connection],
) -> None:
    settings, conn = store
    assert owed(settings, conn) is None
    add_record(settings, "a second memory, mirrored by its own writer")
    log = mirrored(conn)
    assert owed(settings, conn, log) is None
    assert log.moved_to == [4242]
    assert conn.execute(
        "SELECT record_seq, jsonl_offset, line_hash FROM mirror_state WHERE mirror_id = ?",
        (settings.mirror_id,),
    ).fetchone() == (2, 4242, "end-hash")


def test_fallback_files_and_a_broken_log_are_owed(
    store: tuple[Settings, sqlite3.Connection],
) -> None:
    settings, conn = store
    check = SteadyCheck(conn)
    assert check.catch_up(settings.mirror_id, mirrored(conn), fallback_waits=True) == Owed.FALLBACK
    torn = mirrored(conn)
    torn.torn_tail = True
    assert owed(settings, conn, torn) == Owed.TORN_LOG
    replaced = mirrored(conn)
    replaced.continues = False
    assert owed(settings, conn, replaced) == Owed.LOG_REPLACED
    conn.execute("UPDATE mirror_state SET jsonl_offset = 0")
    assert owed(settings, conn) == Owed.NEVER_REPAIRED


@pytest.mark.parametrize("lacks", ["line", "file"])
def test_a_record_past_the_watermark_without_its_line_or_file_is_owed(
    store: tuple[Settings, sqlite3.Connection], lacks: str
) -> None:
    settings, conn = store
    key = add_record(settings, "a record whose writer died before its mirrors")
    log = mirrored(conn)
    if lacks == "line":
        log.keys.discard(key)
    else:
        (name,) = conn.execute(
            'SELECT markdown_name FROM records WHERE "key" = ?', (key,)
        ).fetchone()
        log.files.discard(name)
    assert owed(settings, conn, log) == Owed.UNMIRRORED
    assert log.moved_to == []  # owed: the watermark stays for the repair


def test_this_machines_unmirrored_outcome_is_owed_and_the_repair_clears_it(
    store: tuple[Settings, sqlite3.Connection],
) -> None:
    settings, conn = store
    conn.execute("UPDATE deliveries SET state = 'dead', attempts = 1, mirror_pending = 1")
    assert owed(settings, conn) == Owed.OUTCOMES
    with Outbox.open(settings):  # the open's repair mirrors the outcome
        pass
    assert owed(settings, conn) is None


def test_another_machines_outcomes_and_forgets_are_not_this_repairs_to_owe(
    store: tuple[Settings, sqlite3.Connection],
) -> None:
    """The repair mirrors only its own machine's records: counting another machine's work
    would send every direct write to the full path for ever."""
    settings, conn = store
    conn.execute("UPDATE records SET origin = 'another-machine'")
    conn.execute("UPDATE deliveries SET state = 'dead', attempts = 1, mirror_pending = 1")
    conn.execute(f"UPDATE records SET redaction_pending = {MIRRORS_DUE}")
    assert owed(settings, conn) is None
    with Outbox.open(settings):  # nor does the full repair clear them
        pass
    assert conn.execute("SELECT count(*) FROM deliveries WHERE mirror_pending = 1").fetchone()[0]


def test_an_unfinished_forget_is_owed_until_the_repair_finishes_it(
    store: tuple[Settings, sqlite3.Connection],
) -> None:
    settings, conn = store
    key = add_record(settings, "a memory to forget, whose forget is cut short")
    with Outbox.open(settings) as ob:
        ob.forget(key)
    conn.execute(f'UPDATE records SET redaction_pending = {MIRRORS_DUE} WHERE "key" = ?', (key,))
    assert owed(settings, conn) == Owed.FORGETS
    with Outbox.open(settings):
        pass
    assert owed(settings, conn) is None


def test_a_purge_is_owed_for_any_machines_forget_until_the_open_runs_it(
    store: tuple[Settings, sqlite3.Connection],
) -> None:
    settings, conn = store
    key = add_record(settings, "a memory forgotten on another machine, not yet purged")
    with Outbox.open(settings) as ob:
        ob.forget(key)
    conn.execute(
        f"UPDATE records SET redaction_pending = {PURGE_DUE}, origin = 'another-machine'"
        ' WHERE "key" = ?',
        (key,),
    )
    assert owed(settings, conn) == Owed.PURGE
    with Outbox.open(settings):
        pass
    assert owed(settings, conn) is None


def test_the_check_is_ready_only_for_a_current_schema_and_the_recorded_places(
    store: tuple[Settings, sqlite3.Connection], tmp_path: Path
) -> None:
    settings, conn = store
    check = SteadyCheck(conn)
    assert check.ready(settings)
    conn.execute("UPDATE store_locations SET markdown_dir = ?", (str(tmp_path / "elsewhere"),))
    assert not check.ready(settings)
