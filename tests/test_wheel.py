"""The built wheel carries its migrations: a fresh database made by the installed package
alone (the checkout not importable) reaches the Alembic head and takes a write."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from outbox.store.schema import SCHEMA_REVISION
from tests.helpers.subproc import REPO, child_env

PROBE = """
import json, sqlite3, sys
from pathlib import Path
import outbox
from outbox import Outbox
from outbox.store import migrate
with Outbox.open() as ob:
    receipt = ob.add("written by the installed wheel", timestamp="2026-11-29T08:00:00Z")
    db = Path(ob.settings.home) / "outbox.db"
    status = ob.status()
with sqlite3.connect(db) as conn:
    version = conn.execute("SELECT version_num FROM alembic_version").fetchall()
print(json.dumps({
    "outbox_file": outbox.__file__,
    "migrations": str(migrate.migrations_dir()),
    "sys_path": sys.path,
    "version": version,
    "key": receipt.key,
    "status": receipt.status,
    "records": status["records"],
}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the wheel from the checkout and install it, alone, into a target folder."""
    root = tmp_path_factory.mktemp("wheel")
    dist, target = root / "dist", root / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(REPO)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    (wheel,) = dist.glob("memory_outbox-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "outbox/migrations/env.py" in names
    assert f"outbox/migrations/versions/{SCHEMA_REVISION}_" in " ".join(names)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
         "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    return target


def test_installed_wheel_migrates_a_fresh_database(installed: Path, tmp_path: Path) -> None:
    work = tmp_path / "elsewhere"
    work.mkdir()
    site_packages = sysconfig.get_paths()["purelib"]
    env = child_env(home=work / ".outbox")
    # -S: no site module, so the editable install's .pth hook never puts the checkout on the
    # path; PYTHONPATH gives the installed wheel first, then the venv's dependencies.
    env["PYTHONPATH"] = f"{installed}:{site_packages}"
    result = subprocess.run(
        [sys.executable, "-S", "-c", PROBE],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert Path(found["outbox_file"]).is_relative_to(installed)
    assert Path(found["migrations"]).is_relative_to(installed)
    assert not any(Path(entry or ".").resolve() == REPO for entry in found["sys_path"])
    assert found["version"] == [[SCHEMA_REVISION]]
    assert found["status"] == "queued"
    assert found["records"] == 1
    assert (work / ".outbox" / "outbox.db").is_file()
    assert len(list((work / "docs.local" / "decisions").glob("*.md"))) == 1
