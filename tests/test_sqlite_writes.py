"""The bare-driver SQLite statements against the schema they write to.

``store/sqlite_writes.py`` names its columns itself (it may not import SQLAlchemy); these
tests hold those names to the tables, so a migration that adds a column cannot leave the
write path writing rows without it."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Table

from outbox import Outbox
from outbox.store.schema import deliveries, graph_edges, graph_nodes, records
from outbox.store.sqlite_writes import (
    DELIVERY_COLUMNS,
    EDGE_COLUMNS,
    NODE_COLUMNS,
    RECORD_COLUMNS,
    sqlite_file,
)


@pytest.mark.parametrize(
    ("table", "columns"),
    [
        (records, RECORD_COLUMNS),
        (graph_nodes, NODE_COLUMNS),
        (graph_edges, EDGE_COLUMNS),
        (deliveries, DELIVERY_COLUMNS),
    ],
)
def test_each_insert_names_every_column_but_the_generated_one(
    table: Table, columns: tuple[str, ...]
) -> None:
    generated = {column.name for column in table.columns if column.autoincrement is True}
    assert len(columns) == len(set(columns))
    assert set(columns) == {column.name for column in table.columns} - generated


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:////var/lib/outbox/outbox.db", Path("/var/lib/outbox/outbox.db")),
        ("sqlite:///relative/outbox.db", Path("relative/outbox.db")),
        ("sqlite:///outbox.db?mode=ro", None),  # options: only the full outbox reads them
        ("sqlite+pysqlite:////tmp/outbox.db", None),
        ("sqlite:///:memory:", None),
        ("sqlite://", None),
        ("postgresql+psycopg://u@h/db", None),
    ],
)
def test_only_a_plain_sqlite_file_url_is_written_on_the_bare_driver(
    url: str, path: Path | None
) -> None:
    assert sqlite_file(url) == path


def test_a_writer_keeps_the_wal_near_sqlites_checkpoint_bound(outbox: Outbox) -> None:
    """Writers keep SQLite's checkpoint at 1,000 pages: a bound of 10,000 raised ``add``'s p99
    beside a backfill past twice its idle p99 and its median at a million records
    (docs/configuration.md), so 4,000 records in batches, over 6,000 pages of WAL, leave
    the file near the bound."""
    path = sqlite_file(outbox.settings.db_url)
    assert path is not None
    wal = path.with_name(path.name + "-wal")
    frame = 4096 + 24  # a page and its header
    largest = 0
    for batch in range(20):
        outbox.add_many([f"memory {batch}-{number} of a growing store" for number in range(200)])
        largest = max(largest, wal.stat().st_size // frame)
    # Near 1,400 here (1,000 and one commit of 200 records); 10,000 pages let it pass 6,000.
    assert 500 < largest < 3_000
