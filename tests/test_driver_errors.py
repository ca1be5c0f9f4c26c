"""Database errors are sorted by the code the driver gives (``store/driver_errors.py``).

The expected tables here are written out independently of the module's, by the drivers' own
names, so a code moved to another reason fails a test. The pure part is checked over every
SQLite code, every SQLSTATE psycopg knows and arbitrary values; the extraction against real
errors of the real drivers: a file of garbage, a held lock, a read-only connection, a full
database, a refused connection, a PostgreSQL lock timeout.
"""

from __future__ import annotations

import socket
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import create_engine, text

from outbox.core.errors import DatabaseTimeout, MirrorBusy, StoreUnreadable
from outbox.core.states import FallbackReason
from outbox.store.driver_errors import CodeKind, driver_code, reason_for, reason_of
from outbox.write.fallback import failure_reason

BUSY = FallbackReason.DB_BUSY
UNREACHABLE = FallbackReason.DB_UNREACHABLE
READONLY = FallbackReason.READONLY
FULL = FallbackReason.DISK_FULL
CORRUPT = FallbackReason.CORRUPT
IO = FallbackReason.IO_ERROR
UNKNOWN = FallbackReason.UNKNOWN

# Every SQLite primary result code (https://sqlite.org/rescode.html) and what it must mean.
SQLITE_PRIMARY = {
    "OK": (0, UNKNOWN),
    "ERROR": (1, UNKNOWN),
    "INTERNAL": (2, UNKNOWN),
    "PERM": (3, READONLY),
    "ABORT": (4, UNKNOWN),
    "BUSY": (5, BUSY),
    "LOCKED": (6, BUSY),
    "NOMEM": (7, UNKNOWN),
    "READONLY": (8, READONLY),
    "INTERRUPT": (9, UNKNOWN),
    "IOERR": (10, IO),
    "CORRUPT": (11, CORRUPT),
    "NOTFOUND": (12, UNKNOWN),
    "FULL": (13, FULL),
    "CANTOPEN": (14, IO),
    "PROTOCOL": (15, UNKNOWN),
    "EMPTY": (16, UNKNOWN),
    "SCHEMA": (17, UNKNOWN),
    "TOOBIG": (18, UNKNOWN),
    "CONSTRAINT": (19, UNKNOWN),
    "MISMATCH": (20, UNKNOWN),
    "MISUSE": (21, UNKNOWN),
    "NOLFS": (22, UNKNOWN),
    "AUTH": (23, READONLY),
    "FORMAT": (24, UNKNOWN),
    "RANGE": (25, UNKNOWN),
    "NOTADB": (26, CORRUPT),
    "NOTICE": (27, UNKNOWN),
    "WARNING": (28, UNKNOWN),
    "ROW": (100, UNKNOWN),
    "DONE": (101, UNKNOWN),
}
# PostgreSQL: what a whole class means, and the codes that differ from their class.
SQLSTATE_CLASSES = {"08": UNREACHABLE, "40": BUSY, "53": BUSY, "57": UNREACHABLE, "58": IO}
SQLSTATE_CODES = {
    "25006": READONLY,  # read_only_sql_transaction
    "40002": UNKNOWN,  # transaction_integrity_constraint_violation
    "42501": READONLY,  # insufficient_privilege
    "53100": FULL,  # disk_full
    "55006": BUSY,  # object_in_use
    "55P03": BUSY,  # lock_not_available
    "57014": BUSY,  # query_canceled
    "XX001": CORRUPT,  # data_corrupted
    "XX002": CORRUPT,  # index_corrupted
}
ERRNOS = {
    "ECONNREFUSED": UNREACHABLE,
    "ECONNRESET": UNREACHABLE,
    "EHOSTUNREACH": UNREACHABLE,
    "ENETUNREACH": UNREACHABLE,
    "EROFS": READONLY,
    "EACCES": READONLY,
    "EPERM": READONLY,
    "ENOSPC": FULL,
    "EDQUOT": FULL,
    "EFBIG": FULL,
    "EIO": IO,
}


def expected_sqlstate(code: str) -> FallbackReason:
    return SQLSTATE_CODES.get(code) or SQLSTATE_CLASSES.get(code[:2], UNKNOWN)


def sqlite_extended_codes() -> dict[str, int]:
    """The extended result codes the ``sqlite3`` module names (SQLITE_BUSY_TIMEOUT, ...)."""
    return {
        name: value
        for name, value in vars(sqlite3).items()
        if isinstance(value, int)
        and any(name.startswith(f"SQLITE_{primary}_") for primary in SQLITE_PRIMARY)
        and value > 0xFF
    }


# -- the pure mapping ------------------------------------------------------------------------


def test_every_sqlite_primary_code_has_its_one_reason() -> None:
    for name, (code, reason) in SQLITE_PRIMARY.items():
        assert getattr(sqlite3, f"SQLITE_{name}", code) == code, name
        assert reason_for(CodeKind.SQLITE, code) == reason, name
    named = {code for code, _ in SQLITE_PRIMARY.values()}
    for code in set(range(256)) - named:
        assert reason_for(CodeKind.SQLITE, code) == UNKNOWN, code


def test_every_extended_sqlite_code_maps_like_its_primary_code() -> None:
    extended = sqlite_extended_codes()
    assert {"SQLITE_BUSY_TIMEOUT", "SQLITE_IOERR_WRITE", "SQLITE_READONLY_DIRECTORY"} <= set(
        extended
    )
    primary = {code: reason for code, reason in SQLITE_PRIMARY.values()}
    for name, code in extended.items():
        assert reason_for(CodeKind.SQLITE, code) == primary[code & 0xFF], name


@given(st.integers())
def test_any_sqlite_code_maps_like_its_low_eight_bits(code: int) -> None:
    assert reason_for(CodeKind.SQLITE, code) == reason_for(CodeKind.SQLITE, code & 0xFF)


def test_every_sqlstate_psycopg_knows_maps_like_its_class_unless_listed() -> None:
    errors = pytest.importorskip("psycopg.errors")
    states = (getattr(value, "sqlstate", None) for value in vars(errors).values())
    codes = {state for state in states if isinstance(state, str)}
    assert len(codes) > 200 and set(SQLSTATE_CODES) <= codes
    for code in codes:
        assert reason_for(CodeKind.SQLSTATE, code) == expected_sqlstate(code), code


_ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@given(
    st.one_of(st.sampled_from(sorted(SQLSTATE_CLASSES)), st.text(_ALNUM, min_size=2, max_size=2)),
    st.text(_ALNUM, min_size=3, max_size=3),
)
def test_any_sqlstate_maps_like_its_class_unless_listed(klass: str, rest: str) -> None:
    code = klass + rest
    assert reason_for(CodeKind.SQLSTATE, code) == expected_sqlstate(code)


def test_the_errnos_of_a_database_on_a_file_system_or_a_network() -> None:
    import errno

    for name, reason in ERRNOS.items():
        assert reason_for(CodeKind.ERRNO, getattr(errno, name)) == reason, name
        assert reason_of(OSError(getattr(errno, name), "x")) == reason, name
    assert reason_for(CodeKind.ERRNO, errno.ENOENT) == UNKNOWN


@given(
    st.sampled_from(CodeKind),
    st.one_of(st.integers(), st.text(), st.booleans(), st.floats(), st.none()),
)
def test_the_mapping_is_total_and_never_raises(kind: CodeKind, code: object) -> None:
    """A value of any type under any kind gives a reason; one of the wrong type is UNKNOWN."""
    reason = reason_for(kind, code)  # type: ignore[arg-type]
    assert isinstance(reason, FallbackReason)
    if isinstance(code, bool) or not isinstance(code, int | str):
        assert reason == UNKNOWN


@given(st.text(max_size=8))
def test_an_unknown_sqlstate_is_unknown(code: str) -> None:
    if len(code) != 5 or code[:2] in SQLSTATE_CLASSES:
        return
    assert reason_for(CodeKind.SQLSTATE, code) == (SQLSTATE_CODES.get(code) or UNKNOWN)


# -- finding the code on an exception ------------------------------------------------------------


class _Wrapper(Exception):
    """SQLAlchemy's shape: the driver's error as ``.orig``."""

    def __init__(self, orig: BaseException) -> None:
        super().__init__(str(orig))
        self.orig = orig


def _wrapped(inner: BaseException, shapes: list[bool]) -> BaseException:
    """``inner`` inside one layer per shape: ``.orig`` (True) or ``raise ... from`` (False)."""
    outer = inner
    for orig in shapes:
        if orig:
            outer = _Wrapper(outer)
        else:
            cause = outer
            outer = RuntimeError("while writing")
            outer.__cause__ = cause
    return outer


def _sqlite_error(code: int) -> sqlite3.Error:
    error = sqlite3.OperationalError("whatever the text says")
    error.sqlite_errorcode = code
    return error


@given(
    st.sampled_from([code for code, _ in SQLITE_PRIMARY.values()]),
    st.lists(st.booleans(), max_size=4),
)
def test_the_code_is_found_through_orig_and_cause(code: int, shapes: list[bool]) -> None:
    found = reason_of(_wrapped(_sqlite_error(code), shapes))
    assert found == reason_for(CodeKind.SQLITE, code)


def test_a_cycle_of_causes_ends() -> None:
    error = RuntimeError("a")
    error.__cause__ = _Wrapper(error)
    assert reason_of(error) == UNKNOWN and driver_code(error) is None


def test_the_words_alone_decide_nothing() -> None:
    """An error that says "locked" but carries no code is no evidence of a lock."""
    assert reason_of(sqlite3.OperationalError("database is locked")) == UNKNOWN
    assert reason_of(RuntimeError("file is not a database")) == UNKNOWN


def test_the_write_path_keeps_its_own_reasons_for_its_own_bounds() -> None:
    assert failure_reason(MirrorBusy("lock held")) == BUSY
    assert failure_reason(DatabaseTimeout("no answer")) == UNREACHABLE
    assert failure_reason(_sqlite_error(sqlite3.SQLITE_FULL)) == FULL


# -- real SQLite errors -----------------------------------------------------------------------


def _raised(action: Callable[[], object]) -> BaseException:
    with pytest.raises(Exception) as caught:
        action()
    return caught.value


@pytest.fixture
def database(tmp_path: Path) -> Path:
    path = tmp_path / "real.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.executemany("INSERT INTO t VALUES (?)", [(b"\x01" * 200,)] * 500)
    return path


def test_a_file_of_garbage_is_corrupt(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not an SQLite database at all\x00\xff" * 400)
    bare = _raised(lambda: sqlite3.connect(garbage).execute("SELECT * FROM sqlite_master"))
    assert driver_code(bare) == (CodeKind.SQLITE, sqlite3.SQLITE_NOTADB)
    assert failure_reason(bare) == CORRUPT
    engine = create_engine(f"sqlite:///{garbage}")
    try:
        with engine.connect() as conn:
            wrapped = _raised(lambda: conn.execute(text("SELECT * FROM sqlite_master")))
    finally:
        engine.dispose()
    assert isinstance(wrapped, sqlalchemy.exc.DBAPIError) and failure_reason(wrapped) == CORRUPT
    said = str(StoreUnreadable.of(f"sqlite:///{garbage}", wrapped, reason_of(wrapped)))
    assert "(file is not a database)" in said and "`outbox rebuild`" in said


def test_damaged_pages_are_corrupt(database: Path) -> None:
    data = bytearray(database.read_bytes())
    page = data[16] << 8 | data[17]  # the page size, big-endian at offset 16
    data[page : 3 * page] = b"\xff" * (2 * page)  # no valid b-tree page starts with 0xff
    database.write_bytes(bytes(data))
    error = _raised(lambda: sqlite3.connect(database).execute("SELECT sum(length(x)) FROM t"))
    assert driver_code(error) == (CodeKind.SQLITE, sqlite3.SQLITE_CORRUPT)
    assert failure_reason(error) == CORRUPT


@pytest.fixture
def exclusive(database: Path) -> Iterator[Path]:
    """Another connection holding ``BEGIN EXCLUSIVE`` on the database."""
    holder = sqlite3.connect(database, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield database
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_held_lock_is_busy(exclusive: Path) -> None:
    error = _raised(lambda: sqlite3.connect(exclusive, timeout=0).execute("SELECT * FROM t"))
    assert driver_code(error) == (CodeKind.SQLITE, sqlite3.SQLITE_BUSY)
    assert failure_reason(error) == BUSY
    said = str(StoreUnreadable.of(f"sqlite:///{exclusive}", error, reason_of(error)))
    assert "another process holds its lock" in said


def test_a_read_only_connection_is_readonly(database: Path) -> None:
    """``chmod 0444`` does not stop root: a read-only open and ``query_only`` do."""
    read_only = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    assert failure_reason(_raised(lambda: read_only.execute("INSERT INTO t VALUES (1)"))) == (
        READONLY
    )
    query_only = sqlite3.connect(database)
    query_only.execute("PRAGMA query_only = ON")
    error = _raised(lambda: query_only.execute("INSERT INTO t VALUES (1)"))
    assert driver_code(error) == (CodeKind.SQLITE, sqlite3.SQLITE_READONLY)
    assert failure_reason(error) == READONLY


def test_a_full_database_is_disk_full(database: Path) -> None:
    """``max_page_count`` makes SQLite meet the end of its space at once, as a full disk."""
    conn = sqlite3.connect(database)
    conn.execute("PRAGMA max_page_count = 1")
    error = _raised(lambda: conn.execute("INSERT INTO t VALUES (randomblob(100000))"))
    assert driver_code(error) == (CodeKind.SQLITE, sqlite3.SQLITE_FULL)
    assert failure_reason(error) == FULL


def test_a_database_in_a_missing_folder_cannot_be_opened(tmp_path: Path) -> None:
    error = _raised(lambda: sqlite3.connect(tmp_path / "nowhere" / "outbox.db"))
    assert driver_code(error) == (CodeKind.SQLITE, sqlite3.SQLITE_CANTOPEN)
    assert failure_reason(error) == IO


# -- real PostgreSQL errors -------------------------------------------------------------------


def _free_port() -> int:
    """A port that was free a moment ago: connecting to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_refused_connection_is_unreachable() -> None:
    psycopg = pytest.importorskip("psycopg")
    port = _free_port()
    bare = _raised(lambda: psycopg.connect(f"host=127.0.0.1 port={port} dbname=x user=x"))
    assert driver_code(bare) == (CodeKind.PG_CLIENT, "OperationalError")
    assert failure_reason(bare) == UNREACHABLE
    url = f"postgresql+psycopg://x@127.0.0.1:{port}/x"
    engine = create_engine(url)
    try:
        wrapped = _raised(engine.connect)
    finally:
        engine.dispose()
    assert failure_reason(wrapped) == UNREACHABLE
    assert "check that the server is up" in str(StoreUnreadable.of(url, wrapped, UNREACHABLE))


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[sqlalchemy.Engine]:
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (x int)"))
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_postgresql_lock_timeout_is_busy(pg_engine: sqlalchemy.Engine) -> None:
    with pg_engine.connect() as holder, pg_engine.connect() as waiter:
        holder.execute(text("LOCK TABLE t IN ACCESS EXCLUSIVE MODE"))
        waiter.execute(text("SET lock_timeout = '50ms'"))
        error = _raised(lambda: waiter.execute(text("SELECT * FROM t")))
        holder.rollback()
    assert driver_code(error) == (CodeKind.SQLSTATE, "55P03")
    assert failure_reason(error) == BUSY


@pytest.mark.postgres
def test_a_postgresql_statement_timeout_is_busy(pg_engine: sqlalchemy.Engine) -> None:
    with pg_engine.connect() as conn:
        conn.execute(text("SET statement_timeout = '50ms'"))
        error = _raised(lambda: conn.execute(text("SELECT pg_sleep(5)")))
    assert driver_code(error) == (CodeKind.SQLSTATE, "57014")
    assert failure_reason(error) == BUSY


@pytest.mark.postgres
def test_a_postgresql_read_only_transaction_is_readonly(pg_engine: sqlalchemy.Engine) -> None:
    with pg_engine.connect() as conn:
        conn.execute(text("SET TRANSACTION READ ONLY"))
        error = _raised(lambda: conn.execute(text("INSERT INTO t VALUES (1)")))
    assert driver_code(error) == (CodeKind.SQLSTATE, "25006")
    assert failure_reason(error) == READONLY


@pytest.mark.postgres
def test_a_terminated_postgresql_session_is_unreachable(pg_engine: sqlalchemy.Engine) -> None:
    with pg_engine.connect() as admin, pg_engine.connect() as victim:
        pid = victim.execute(text("SELECT pg_backend_pid()")).scalar_one()
        admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        error = _raised(lambda: victim.execute(text("SELECT 1")))
    assert driver_code(error) == (CodeKind.SQLSTATE, "57P01")
    assert failure_reason(error) == UNREACHABLE
