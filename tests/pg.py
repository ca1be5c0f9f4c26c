"""PostgreSQL for the tests: a fresh database per test on the server named by the environment.

``OUTBOX_TEST_PG_URL`` (``postgresql+psycopg://user@host:port/db``) names a server and a
database the tests may connect to and create databases from. Without it the PostgreSQL tests
skip with that reason, so a laptop without a server still runs everything else; with
``OUTBOX_REQUIRE_PG=1`` (set by ``.ci/run``) a missing or unreachable server, or any
PostgreSQL test that skips for whatever reason, is a failure instead, so CI cannot go green
without having run them.

Both variables are read when this module is imported: the suite's autouse fixture removes
every other ``OUTBOX_*`` variable from the environment before each test runs.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from outbox import Outbox, load_settings

PG_URL_ENV = "OUTBOX_TEST_PG_URL"
REQUIRE_ENV = "OUTBOX_REQUIRE_PG"

PG_URL: str | None = os.environ.get(PG_URL_ENV) or None
REQUIRE_PG: bool = os.environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes")

# Prefix of the databases the fixtures create, so a leftover from a killed run is recognisable.
DB_PREFIX = "outbox_t_"


def unavailable(reason: str) -> None:
    """Skip the test, or fail it when CI demands PostgreSQL."""
    if REQUIRE_PG:
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def server_url() -> str:
    """The configured URL, checked for the driver the library uses (psycopg 3)."""
    if not PG_URL:
        unavailable(f"PostgreSQL tests need {PG_URL_ENV}=postgresql+psycopg://user@host:port/db")
    assert PG_URL is not None
    url = make_url(PG_URL)
    if url.get_backend_name() != "postgresql":
        pytest.fail(f"{PG_URL_ENV} is not a postgresql URL: {url.drivername}", pytrace=False)
    return PG_URL


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    """Create an empty database on the server, yield its URL, drop it afterwards.

    A whole database rather than a schema: the migration's advisory lock, ``alembic_version``
    and the library's own connection options all stay exactly as in a real deployment.
    """
    base = make_url(server_url())
    admin = create_engine(base, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})
    name = f"{DB_PREFIX}{uuid.uuid4().hex[:16]}"
    try:
        try:
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE template0'))
        except OperationalError as exc:
            unavailable(f"PostgreSQL at {base.render_as_string()} is unreachable: {exc.orig}")
        try:
            yield base.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as conn:
                # FORCE ends connections a failed test may have left in its pools.
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """URL of a fresh, empty PostgreSQL database for this test alone."""
    with fresh_database() as url:
        yield url


NOOP_SINK = "outbox.testing.sinks:NoopSink"


@contextlib.contextmanager
def new_database(backend: str, folder: Path) -> Iterator[str]:
    """URL of a new, empty database: a SQLite file in ``folder``, or a fresh PostgreSQL one."""
    if backend == "sqlite":
        yield f"sqlite:///{folder / 'outbox.db'}"
        return
    with fresh_database() as url:
        yield url


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgresql", id="postgresql", marks=pytest.mark.postgres),
    ]
)
def either_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Outbox]:
    """An outbox delivering to the no-op sink, on SQLite, then on a fresh PostgreSQL database:
    for tests that must behave alike on both."""
    with new_database(request.param, tmp_path) as url:
        settings = load_settings(
            env={},
            db_url=url,
            home=tmp_path / ".outbox",
            markdown_dir=tmp_path / "md",
            sinks=NOOP_SINK,
        )
        with Outbox.open(settings) as ob:
            yield ob


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under ``OUTBOX_REQUIRE_PG=1`` a skipped ``postgres``-marked test counts as a failure,
    whoever skipped it (a ``skipif`` on a missing driver, say): CI must not go green on
    PostgreSQL tests that never ran."""
    report = yield
    if (
        REQUIRE_PG
        and report.skipped
        and not hasattr(report, "wasxfail")
        and item.get_closest_marker("postgres") is not None
    ):
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_ENV}=1 but this PostgreSQL test was skipped: {report.longrepr}"
    return report
