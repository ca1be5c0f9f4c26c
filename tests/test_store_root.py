"""One store, whatever folder a command runs in: found from any folder below its root, its
relative paths resolved against that root, absolute paths in JSON, and no read-only command
ever creating an empty store. Through the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.subproc import child_env, run_cli


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """No OUTBOX_HOME: the store is found the way a user's shell finds it."""
    found = child_env(faulty_db=str(tmp_path / "faulty.db"))
    found.pop("OUTBOX_HOME", None)
    return found


@pytest.mark.parametrize(
    "command",
    [["status"], ["verify"], ["search", "anything"], ["recent"], ["show", "ab"], ["export"]],
)
def test_a_read_only_command_never_creates_a_store(
    command: list[str], tmp_path: Path, env: dict[str, str]
) -> None:
    result = run_cli(command, cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert b"no outbox store at" in result.stderr and str(tmp_path).encode() in result.stderr
    assert list(tmp_path.iterdir()) == [], "nothing may be created"


def test_two_shells_below_one_root_share_one_store(tmp_path: Path, env: dict[str, str]) -> None:
    added = run_cli(["add", "written at the root", "--json"], cwd=tmp_path, env=env)
    assert added.returncode == 0, added.stderr
    receipt = json.loads(added.stdout)
    assert Path(receipt["markdown_path"]).is_absolute()
    assert Path(receipt["markdown_path"]).is_relative_to(tmp_path / "docs.local" / "decisions")

    deep = tmp_path / "src" / "pkg"
    deep.mkdir(parents=True)
    second = run_cli(["add", "written two folders down", "--json"], cwd=deep, env=env)
    assert second.returncode == 0, second.stderr
    status = json.loads(run_cli(["status", "--json"], cwd=deep, env=env).stdout)
    assert status["records"] == 2
    assert Path(status["markdown_dir"]) == tmp_path / "docs.local" / "decisions"
    assert not (deep / ".outbox").exists() and not (deep / "docs.local").exists()
    verify = run_cli(["verify"], cwd=deep, env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert sorted(os.listdir(tmp_path / "docs.local" / "decisions")) == sorted(
        Path(json.loads(r)["markdown_path"]).name for r in (added.stdout, second.stdout)
    )


def test_the_demo_command_keeps_its_files_in_its_own_folder(tmp_path: Path) -> None:
    """README's first command, as a user runs it: relative to the working directory, with
    the embedded default (real Chroma, the offline model)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    result = run_cli(["demo"], cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith(b"demo complete")
    files = sorted((tmp_path / "outbox-demo" / "decisions").glob("*.md"))
    assert len(files) == 5
    assert not (tmp_path / "outbox-demo" / "outbox-demo").exists()
