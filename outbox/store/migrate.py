"""Bring a database to the current schema when it is opened.

Alembic is imported only when the stored revision differs from ``SCHEMA_REVISION``, so an
up-to-date database opens without paying for it (``outbox add`` must start fast).
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError, ProgrammingError

from outbox.store.schema import SCHEMA_REVISION


def migrations_dir() -> Path:
    """``outbox/migrations`` inside an installed wheel, ``<repo>/migrations`` in a checkout."""
    package_dir = Path(__file__).resolve().parent.parent
    for candidate in (package_dir / "migrations", package_dir.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("the outbox migrations folder is missing from this installation")


def current_revision(engine: Engine) -> str | None:
    """The stored revision, or None for a database without the version table.

    Pass a read-only engine: on SQLite a reader is not held up by another process's write
    lock, so checking an up-to-date database never waits.
    """
    try:
        with engine.connect() as conn:
            row = conn.execute(text("SELECT version_num FROM alembic_version")).first()
    except (OperationalError, ProgrammingError) as exc:
        message = str(exc.orig).lower()
        if "no such table" in message or "does not exist" in message:
            return None
        raise
    return row[0] if row else None


def alembic_config(engine_url: str | None = None):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    if engine_url:
        config.set_main_option("sqlalchemy.url", engine_url)
    return config


def upgrade(engine: Engine, reader: Engine | None = None) -> bool:
    """Run pending migrations in one transaction; returns whether anything ran."""
    if current_revision(reader or engine) == SCHEMA_REVISION:
        return False
    from alembic import command

    config = alembic_config()
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # Serialise concurrent first opens across processes and machines.
            conn.execute(text("SELECT pg_advisory_xact_lock(7171717)"))
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
    return True
