"""The WAL page count benchmarks/wal_pages.py reports: every frame a commit writes is counted
once, and named by the table or index it belongs to."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from benchmarks.wal_pages import pages_per_commit


def _database(path: Path, index: bool) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
    if index:
        conn.execute("CREATE INDEX ix_notes_body ON notes (body)")
    return conn


def test_each_commit_names_the_pages_it_wrote(tmp_path: Path) -> None:
    conn = _database(tmp_path / "indexed.db", index=True)

    def commit(number: int) -> None:
        conn.execute("INSERT INTO notes (body) VALUES (?)", (f"note {number}",))

    pages = pages_per_commit(tmp_path / "indexed.db", commit, 5)
    assert pages["notes"] == 1.0  # one small row a commit: the table's one leaf
    assert pages["ix_notes_body"] == 1.0
    assert pages["total"] == sum(value for name, value in pages.items() if name != "total")


def test_an_index_left_out_is_a_page_less(tmp_path: Path) -> None:
    totals = {}
    for index in (True, False):
        path = tmp_path / f"{index}.db"
        conn = _database(path, index)
        for number in range(50):  # past the first pages, as a store in use
            conn.execute("INSERT INTO notes (body) VALUES (?)", (f"warm {number}",))

        def commit(number: int, conn: sqlite3.Connection = conn) -> None:
            conn.execute("INSERT INTO notes (body) VALUES (?)", (f"note {number}",))

        totals[index] = pages_per_commit(path, commit, 5)["total"]
    assert totals[True] - totals[False] == 1.0
