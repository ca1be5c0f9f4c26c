"""The PostgreSQL test harness itself: CI must not go green on PostgreSQL tests that never ran.

A small test session is run in a subprocess against a port nobody listens on, once as a
developer would (the PostgreSQL tests skip, saying why) and once as CI does with
``OUTBOX_REQUIRE_PG=1`` (the same tests fail, including one that skips itself because its
driver cannot be imported).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CONFTEST = "from tests.pg import pg_url, pytest_runtest_makereport  # noqa: F401\n"
TESTS = """
import pytest

def test_uses_the_fixture(pg_url):
    assert pg_url.startswith("postgresql")

@pytest.mark.postgres
def test_skips_by_itself():
    # As a test does when its driver is missing: this module never exists.
    pytest.importorskip("outbox_harness_missing_driver", reason="the driver is not installed")

def test_plain():
    assert True
"""


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_session(folder: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    postgres: needs PostgreSQL\n")
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "test_sample.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OUTBOX_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra_env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(folder)],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_without_a_server_postgres_tests_skip_with_a_reason(tmp_path: Path) -> None:
    result = run_session(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 2 skipped" in result.stdout
    assert "need OUTBOX_TEST_PG_URL" in result.stdout


def test_ci_fails_when_the_server_is_unreachable_or_a_test_skips(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{closed_port()}/postgres"
    result = run_session(tmp_path, OUTBOX_TEST_PG_URL=url, OUTBOX_REQUIRE_PG="1")
    assert result.returncode == 1, result.stdout + result.stderr
    # The fixture fails in setup (an error), the test that skipped itself fails.
    assert "1 failed, 1 passed, 1 error" in result.stdout
    assert "OUTBOX_REQUIRE_PG=1 but PostgreSQL at" in result.stdout
    assert "OUTBOX_REQUIRE_PG=1 but this PostgreSQL test was skipped" in result.stdout


def test_ci_fails_when_no_server_is_configured(tmp_path: Path) -> None:
    result = run_session(tmp_path, OUTBOX_REQUIRE_PG="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 1 passed, 1 error" in result.stdout
    assert "OUTBOX_REQUIRE_PG=1 but PostgreSQL tests need OUTBOX_TEST_PG_URL" in result.stdout
