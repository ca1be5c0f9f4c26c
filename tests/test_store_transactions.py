"""The dialect's own parts of the store: which URL is SQLite (one reading, as SQLAlchemy's),
the store built from settings, and each dialect's write transaction, whose shortened lock
wait times out as the busy timeout would, and only for that transaction."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from outbox import Outbox, Settings, load_settings
from outbox.store.postgres_transactions import PostgresTransactions
from outbox.store.sqlite_writes import sqlite_path, sqlite_url
from outbox.store.storage import Storage
from outbox.store.transactions import SqliteTransactions, transactions_for
from tests.helpers.faults import held_write_lock


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:////var/lib/outbox/outbox.db",
        "sqlite:///relative/outbox.db",
        "sqlite:///with%20space.db",
        "sqlite:///outbox.db?mode=ro",
        "sqlite+pysqlite:////tmp/outbox.db",
        "sqlite:///:memory:",
        "sqlite://",
        "postgresql+psycopg://u@h/db",
    ],
)
def test_a_sqlite_url_names_the_file_sqlalchemy_opens(url: str) -> None:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        assert sqlite_url(url) is None
        return
    database = parsed.database
    expected = Path(database) if database and database != ":memory:" else None
    assert sqlite_path(url) == expected


def test_storage_from_settings_reads_sqlite_on_an_engine_of_its_own(settings: Settings) -> None:
    storage = Storage.from_settings(settings)
    try:
        assert storage.dialect == "sqlite" and storage.reader is not storage.engine
    finally:
        storage.close()


def test_the_sqlite_transaction_waits_only_its_shortened_time_then_the_busy_timeout(
    settings: Settings,
) -> None:
    with Outbox.open(settings):  # the schema
        pass
    db = settings.home / "outbox.db"
    assert settings.busy_timeout > 2.0  # room for the lock held 1 s below
    transactions = transactions_for(settings, lambda: pytest.fail("no engine on SQLite"))
    assert isinstance(transactions, SqliteTransactions)
    try:
        with held_write_lock(db):
            started = time.monotonic()
            with pytest.raises(sqlite3.OperationalError), transactions.transaction(0.2):
                pass
            assert time.monotonic() - started < settings.busy_timeout / 2
        with transactions.transaction(0.2) as conn:
            conn.execute("INSERT INTO mirror_state VALUES ('elsewhere', 0, 0, 0, NULL)")
        # The shortened wait was for that one: this one waits out a lock held for 1 s.
        with held_write_lock(db, seconds=1.0), transactions.transaction(None) as conn:
            conn.execute("INSERT INTO mirror_state VALUES ('later', 0, 0, 0, NULL)")
    finally:
        transactions.close()


@pytest.mark.postgres
def test_the_postgres_transaction_times_out_on_a_locked_table_as_its_lock_wait_says(
    pg_url: str,
    tmp_path: Path,
) -> None:
    settings = load_settings(env={}, db_url=pg_url, home=tmp_path / ".outbox", busy_timeout=5)
    with Outbox.open(settings) as ob:
        transactions = transactions_for(settings, lambda: ob.storage)
        assert isinstance(transactions, PostgresTransactions)
        with ob.engine.connect() as holder, holder.begin():
            holder.execute(text("LOCK TABLE mirror_state IN ACCESS EXCLUSIVE MODE"))
            started = time.monotonic()
            with (
                pytest.raises(OperationalError, match="lock timeout"),
                transactions.transaction(0.2) as conn,
            ):
                conn.execute(text("SELECT count(*) FROM mirror_state")).scalar_one()
            assert time.monotonic() - started < 2
        with transactions.transaction(None) as conn:  # the engine's own wait again
            assert conn.execute(text("SHOW lock_timeout")).scalar_one() == "5s"
