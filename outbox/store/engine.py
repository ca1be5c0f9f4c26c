"""Engines with the connection discipline the guarantees rest on.

SQLite: WAL, the chosen ``synchronous`` level and ``busy_timeout`` on every connection, and
every transaction opened with ``BEGIN IMMEDIATE`` so a writer waits for the lock up front
instead of failing half-way (a deferred read-then-write cannot upgrade and gets SQLITE_BUSY
without waiting). Readers get their own engine with plain deferred BEGIN.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from outbox.core.config import Settings
from outbox.core.folders import ensure_private_dir
from outbox.store.driver_errors import UNAVAILABLE_BARE
from outbox.store.sqlite_writes import apply_discipline, sqlite_url

# What makes a write go to the fallback file instead of failing, SQLAlchemy's errors included.
UNAVAILABLE = (DBAPIError, *UNAVAILABLE_BARE)


def _prepare_sqlite_file(path: Path) -> None:
    """Create the folder owner-only and the file 0600 before SQLite creates it world-readable."""
    if not path.parent.exists():
        ensure_private_dir(path.parent)
    if not path.exists():
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        os.close(fd)


def _prepare_before_connecting(engine: Engine, path: Path) -> None:
    """The file is made owner-only just before a connection would create it, not when the
    engine is built: an open that finds the database deleted (``mirror/gap.py``) then leaves
    nothing in its place."""

    @event.listens_for(engine, "do_connect")
    def _before(*_args: Any) -> None:
        # When this fails SQLite reports it on first use, and the write then falls back.
        with contextlib.suppress(OSError):
            _prepare_sqlite_file(path)


def make_engine(settings: Settings, *, writer: bool = True) -> Engine:
    """An engine for ``settings.db_url``; ``writer`` picks BEGIN IMMEDIATE on SQLite."""
    url = settings.db_url
    sqlite = sqlite_url(url)
    if sqlite is not None:
        path = sqlite.path
        engine = create_engine(
            url,
            connect_args={"timeout": settings.busy_timeout, "check_same_thread": False},
            hide_parameters=True,
        )
        if path is not None:
            _prepare_before_connecting(engine, path)
        _install_sqlite_discipline(engine, settings, writer=writer)
        return engine
    return _make_postgres_engine(url, settings)


def _make_postgres_engine(db_url: str, settings: Settings) -> Engine:
    """PostgreSQL through psycopg 3, with the busy timeout as ``lock_timeout``.

    A bare ``postgresql://`` means psycopg 3 (the driver the ``postgres`` extra installs),
    not whatever SQLAlchemy's default driver is. ``lock_timeout`` is at least 1 ms because 0
    would mean "wait forever", the opposite of a zero busy timeout. ``options`` given in the
    URL (a ``search_path``, say) are kept: connect arguments would otherwise replace them.
    """
    url = make_url(db_url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    connect_args: dict[str, Any] = {}
    if url.get_driver_name() in ("psycopg", "psycopg2"):
        timeout_ms = max(1, int(settings.busy_timeout * 1000))
        given = url.query.get("options", ())
        options = [f"-c lock_timeout={timeout_ms}"]  # first, so the URL's own setting wins
        options.extend([given] if isinstance(given, str) else given)
        url = url.difference_update_query(["options"])
        connect_args["options"] = " ".join(options)
        connect_args["connect_timeout"] = max(1, int(settings.busy_timeout) + 1)
    return create_engine(url, connect_args=connect_args, pool_pre_ping=True, hide_parameters=True)


def _install_sqlite_discipline(engine: Engine, settings: Settings, *, writer: bool) -> None:
    busy_ms = int(settings.busy_timeout * 1000)
    synchronous = settings.synchronous

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        apply_discipline(dbapi_conn, busy_ms=busy_ms, synchronous=synchronous, writer=writer)

    begin = "BEGIN IMMEDIATE" if writer else "BEGIN"

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # Straight to the driver: exec_driver_sql would add SQLAlchemy's overhead to every
        # transaction.
        conn.connection.driver_connection.execute(begin)


@contextlib.contextmanager
def driver_of(engine: Engine) -> Iterator[sqlite3.Connection]:
    """A pooled SQLite connection's own driver for the block (its discipline applied), given
    back to the pool after: for statements run once per dispatcher batch on every record,
    where SQLAlchemy's handling of them cost more than the database's work."""
    pooled = engine.raw_connection()
    try:
        driver = pooled.driver_connection
        assert isinstance(driver, sqlite3.Connection)
        yield driver
    finally:
        pooled.close()
