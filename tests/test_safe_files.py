"""A store never follows a symlink planted where its files go, and refuses files and folders
that another user owns or can write, before anything is written. Through the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.subproc import child_env, run_cli

NOBODY = 65534  # a user id that is not the one running the tests


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return child_env(tmp_path / ".outbox", markdown_dir=str(tmp_path / "md"))


def first_write(tmp_path: Path, env: dict[str, str]) -> None:
    result = run_cli(
        ["add", "a memory written before anything was tampered with"], cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["outbox.jsonl", "outbox.jsonl.lock", "outbox.db"])
def test_a_symlinked_store_file_is_refused_and_its_target_untouched(
    name: str, tmp_path: Path, env: dict[str, str]
) -> None:
    home = tmp_path / ".outbox"
    home.mkdir(mode=0o700)
    target = tmp_path / "someone-elses-file.txt"
    target.write_bytes(b"precious text without a final newline")
    (home / name).symlink_to(target)

    result = run_cli(["add", "a memory that must not land in the target"], cwd=tmp_path, env=env)
    assert result.returncode == 1
    line = result.stderr.decode()
    assert "symbolic link" in line and name in line and line.count("\n") == 1
    assert target.read_bytes() == b"precious text without a final newline"
    assert not (tmp_path / "md").exists() or not any((tmp_path / "md").iterdir())


@pytest.mark.parametrize(
    ("command", "name"), [("rebuild", "rebuild.lock"), ("reindex", "reindex-agent-memory.lock")]
)
def test_a_symlinked_lock_is_refused_and_its_target_untouched(
    command: str, name: str, tmp_path: Path, env: dict[str, str]
) -> None:
    """The one-shot locks of the long commands: refused before they are taken (so before
    anything else the command would do), in one line naming the lock."""
    first_write(tmp_path, env)
    target = tmp_path / "someone-elses-file.txt"
    target.write_bytes(b"precious text without a final newline")
    (tmp_path / ".outbox" / name).symlink_to(target)

    result = run_cli([command], cwd=tmp_path, env={**env, "OUTBOX_SINKS": "chroma"})
    assert result.returncode == 1
    line = result.stderr.decode()
    assert "symbolic link" in line and name in line and line.count("\n") == 1
    assert target.read_bytes() == b"precious text without a final newline"


def test_a_home_others_can_write_is_refused(tmp_path: Path, env: dict[str, str]) -> None:
    home = tmp_path / ".outbox"
    home.mkdir()
    home.chmod(0o777)
    result = run_cli(["status"], cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert "writable by other users" in result.stderr.decode()
    assert list(home.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_log_another_user_owns_is_refused(tmp_path: Path, env: dict[str, str]) -> None:
    first_write(tmp_path, env)
    log = tmp_path / ".outbox" / "outbox.jsonl"
    before = log.read_bytes()
    os.chown(log, NOBODY, NOBODY)
    result = run_cli(["add", "a memory for a log that is not ours"], cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert f"belongs to user id {NOBODY}" in result.stderr.decode()
    assert log.read_bytes() == before


def test_a_symlinked_legacy_file_is_skipped_not_read(tmp_path: Path, env: dict[str, str]) -> None:
    folder = tmp_path / "legacy"
    folder.mkdir()
    secret = tmp_path / "secret.md"
    secret.write_text(
        "---\nintended_brain_store: true\ntimestamp: '2026-03-15T08:00:00Z'\nchunk_id:\n---\n"
        "text from outside the folder",
        encoding="utf-8",
    )
    (folder / "2026-03-15-planted.md").symlink_to(secret)
    result = run_cli(["replay", str(folder), "--json"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["imported"] == []
    assert len(report["skipped"]) == 1
    log = tmp_path / ".outbox" / "outbox.jsonl"
    assert not log.exists() or b"text from outside" not in log.read_bytes()
