"""The Alembic migrations build exactly the schema the code declares, and every SQLite
connection gets the discipline the durability promise rests on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from outbox import Outbox, Settings, load_settings
from outbox.store import migrate
from outbox.store.engine import make_engine
from outbox.store.schema import SCHEMA_REVISION, is_search_index, metadata
from tests.conftest import FAULTY
from tests.helpers.subproc import REPO, child_env

ALEMBIC = Path(sys.executable).with_name("alembic")


def head_revision() -> str:
    head = ScriptDirectory.from_config(migrate.alembic_config()).get_current_head()
    assert head is not None
    return head


def test_schema_revision_is_the_alembic_head() -> None:
    assert head_revision() == SCHEMA_REVISION


def test_upgrade_head_matches_the_declared_metadata(settings: Settings) -> None:
    engine = make_engine(settings)
    assert migrate.upgrade(engine) is True
    assert migrate.upgrade(engine) is False  # already at head: nothing runs
    with engine.connect() as conn:
        # The same comparison `alembic check` makes: the search index lives outside the
        # metadata (an FTS5 virtual table on SQLite), so its names are left out.
        context = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "include_name": lambda name, _type, _parent: not is_search_index(name),
            },
        )
        diffs = compare_metadata(context, metadata)
        version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
        frontier = conn.execute(
            text("SELECT label FROM graph_nodes WHERE id = 'frontier'")
        ).scalar_one()
    engine.dispose()
    assert diffs == []
    assert version == SCHEMA_REVISION
    assert frontier == "SYSTEM_ANCHOR"


def test_migrated_tables_are_the_declared_tables(settings: Settings) -> None:
    engine = make_engine(settings)
    migrate.upgrade(engine)
    tables = set(inspect(engine).get_table_names())
    engine.dispose()
    declared = {name for name in tables if not is_search_index(name)}
    assert declared == set(metadata.tables) | {"alembic_version"}


def run_alembic(*args: str, db: Path) -> subprocess.CompletedProcess[str]:
    env = child_env(db_url=f"sqlite:///{db}")
    return subprocess.run(
        [str(ALEMBIC), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_alembic_command_line_upgrade_and_check(tmp_path: Path) -> None:
    db = tmp_path / "cli.db"
    upgraded = run_alembic("upgrade", "head", db=db)
    assert upgraded.returncode == 0, upgraded.stderr
    checked = run_alembic("check", db=db)
    assert checked.returncode == 0, checked.stderr + checked.stdout
    assert "No new upgrade operations detected" in checked.stdout + checked.stderr
    current = run_alembic("current", db=db)
    assert current.returncode == 0
    assert SCHEMA_REVISION in current.stdout
    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one() == (
            SCHEMA_REVISION
        )
    engine.dispose()
    # The library opens the database the command line made, and writes to it.
    settings = load_settings(
        env={},
        db_url=f"sqlite:///{db}",
        home=tmp_path / "h",
        markdown_dir=tmp_path / "m",
        sinks=FAULTY,
    )
    with Outbox.open(settings) as ob:
        assert not ob.add("written after alembic upgrade head").duplicate


def pragmas(settings: Settings, writer: bool) -> dict[str, object]:
    engine = make_engine(settings, writer=writer)
    if writer:
        migrate.upgrade(engine)
    with engine.connect() as conn:
        values = {
            name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()
            for name in ("journal_mode", "synchronous", "busy_timeout", "foreign_keys")
        }
    engine.dispose()
    return values


@pytest.mark.parametrize(
    ("synchronous", "level"), [(None, 2), ("NORMAL", 1), ("FULL", 2), ("EXTRA", 3)]
)
def test_connection_discipline(tmp_path: Path, synchronous: str | None, level: int) -> None:
    settings = load_settings(
        env={},
        home=tmp_path / ".outbox",
        sinks=FAULTY,
        busy_timeout=2.5,
        synchronous=synchronous,
    )
    for writer in (True, False):
        values = pragmas(settings, writer)
        assert str(values["journal_mode"]).lower() == "wal"
        assert values["synchronous"] == level
        assert values["busy_timeout"] == 2500
        assert values["foreign_keys"] == 1


def test_outbox_engine_uses_the_discipline(outbox: Outbox) -> None:
    with outbox.engine.connect() as conn:
        assert str(conn.exec_driver_sql("PRAGMA journal_mode").scalar()).lower() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == int(
            outbox.settings.busy_timeout * 1000
        )


def test_an_up_to_date_database_opens_without_importing_alembic(
    settings: Settings, tmp_path: Path
) -> None:
    Outbox.open(settings).close()
    probe = (
        "import sys\n"
        "from outbox import Outbox\n"
        "Outbox.open().close()\n"
        "print('alembic' in sys.modules)\n"
    )
    env = child_env(home=settings.home, markdown_dir=str(settings.markdown_dir))
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_store_written_before_0009_keeps_its_edges_and_looks_them_up_by_target(
    tmp_path: Path,
) -> None:
    """0009 rebuilds the edge table on SQLite: every edge of a store written at 0008 is there
    afterwards, a look-up by target uses the new key (no index of the target's own is left),
    and forget's cascade still removes a memory's edge."""
    db = tmp_path / "old.db"
    settings = load_settings(
        env={},
        db_url=f"sqlite:///{db}",
        home=tmp_path / "h",
        markdown_dir=tmp_path / "m",
        sinks=FAULTY,
    )
    with Outbox.open(settings) as ob:
        keys = [receipt.key for receipt in ob.add_many([f"edge {n}" for n in range(50)])]
    assert run_alembic("downgrade", "0008", db=db).returncode == 0
    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        indexes = {row[0] for row in conn.execute(text("SELECT name FROM sqlite_master"))}
    engine.dispose()
    assert "ix_graph_edges_target" in indexes  # the downgrade put 0008's layout back

    with Outbox.open(settings) as ob:  # the open upgrades
        with ob.engine.connect() as conn:
            edges = conn.execute(
                text("SELECT source, target, type FROM graph_edges WHERE target != 'frontier'")
            ).all()
            plan = " ".join(
                str(row[-1])
                for row in conn.execute(
                    text("EXPLAIN QUERY PLAN SELECT id FROM graph_edges WHERE target = :t"),
                    {"t": keys[0]},
                )
            )
            version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar_one()
            now = {row[0] for row in conn.execute(text("SELECT name FROM sqlite_master"))}
        assert version == SCHEMA_REVISION
        assert sorted(edges) == sorted(("frontier", key, "SPAWNED_MEMORY") for key in keys)
        assert "ix_graph_edges_source" in now
        assert "ix_graph_edges_target" not in now
        # The unique key answers it (SQLite names it sqlite_autoindex_...), not a scan.
        assert "SEARCH" in plan and "autoindex" in plan and "(target=?)" in plan
        assert ob.forget(keys[0]) is not None
        with ob.engine.connect() as conn:
            left = conn.execute(
                text("SELECT count(*) FROM graph_edges WHERE target = :t"), {"t": keys[0]}
            ).scalar_one()
        assert left == 0
        assert ob.verify().ok
