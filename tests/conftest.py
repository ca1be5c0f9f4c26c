"""Shared fixtures: every test runs in its own folder with no OUTBOX_* setting leaking in."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import Outbox, Settings, load_settings

FAULTY = "outbox.testing.sinks:FaultySink"


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Clean OUTBOX_* environment and a private working directory per test; afterwards, no
    shared Chroma server of the test's own stores is left running."""
    for name in list(os.environ):
        if name.startswith("OUTBOX_") and name != "OUTBOX_TEST_PG_URL":
            monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    from tests.chroma_server import stop_servers_under

    stop_servers_under(tmp_path)


@pytest.fixture(scope="session", autouse=True)
def no_chroma_outlives_the_suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """At the end of the run, no Chroma process of this run's folders is left: a shared
    server, a ``chroma run`` or an embedded child still running then was left by a test (a
    supervisor would outlive the suite until its idle stop). It is stopped, and the run
    fails naming it."""
    yield
    from tests.chroma_server import processes_under, stop_servers_under

    root = tmp_path_factory.getbasetemp()
    left = processes_under(root)
    if left:
        stop_servers_under(root)
        named = "\n".join(f"  {pid}: {' '.join(args)}" for pid, args in sorted(left.items()))
        pytest.fail(f"Chroma processes left running by tests (now stopped):\n{named}")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Settings rooted in the test's folder, delivering to the fault-injection sink."""
    return load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "docs.local" / "decisions",
        sinks=FAULTY,
    )


@pytest.fixture
def outbox(settings: Settings) -> Iterator[Outbox]:
    ob = Outbox.open(settings)
    yield ob
    ob.close()


# ---- PostgreSQL (owned by tests/pg.py) -------------------------------------------------------
# A fresh database per test (`pg_url`), and under OUTBOX_REQUIRE_PG=1 (CI) a skipped
# `postgres`-marked test fails. Imported here so every test module can use them.
from tests.pg import either_backend, pg_url, pytest_runtest_makereport  # noqa: E402, F401
