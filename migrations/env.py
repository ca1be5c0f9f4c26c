"""Alembic environment shared by `alembic` in the repo and by `Outbox.open()` at run time."""

from __future__ import annotations

from alembic import context

from outbox.store.schema import is_search_index, metadata

config = context.config


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_name=lambda name, _type, _parent: not is_search_index(name),
    )
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    # Run from the command line: resolve the URL the way the library does.
    from outbox.core.config import load_settings
    from outbox.store.engine import make_engine

    engine = make_engine(load_settings())
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; run against a database")
main()
