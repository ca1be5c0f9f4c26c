"""What the files and folders say is so (issue 22 point 6), through the real ``outbox``
command: a delivered record's front matter says it was delivered; a failure it got over
keeps the failure's class; a read, or a replay with nothing to import, in a place without a
store creates nothing; so does ``status`` when ``OUTBOX_DB_URL`` names a missing folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from outbox import Outbox, load_settings
from outbox.testing.conformance import make_due
from tests.helpers.checks import markdown_files, split_markdown
from tests.helpers.subproc import child_env, run_cli
from tests.test_replay import FIXTURES, PENDING

MALFORMED_ONLY = "2026-03-18-invalid-yaml.md"


def _everything_under(folder: Path) -> list[str]:
    return sorted(
        str(Path(root, name).relative_to(folder))
        for root, dirs, files in os.walk(folder)
        for name in dirs + files
    )


def _file_of(folder: Path, content: str) -> dict[str, object]:
    """The front matter of the one file holding ``content``."""
    (matter,) = [
        matter
        for matter, body in map(split_markdown, markdown_files(folder))
        if body == content.encode()
    ]
    return matter


def test_front_matter_says_delivered_or_the_failure_it_got_over(tmp_path: Path) -> None:
    """A record delivered at the first try says ``reason: delivered`` (not ``pending``); one
    delivered after a failure keeps the failure's class, as contract section 3 says."""
    md = tmp_path / "decisions"
    env = child_env(tmp_path / ".outbox", markdown_dir=str(md), faulty_db=str(tmp_path / "s.db"))
    first = "a memory that is delivered at the first try"
    assert run_cli(["add", first], cwd=tmp_path, env=env).returncode == 0
    assert _file_of(md, first)["reason"] == "pending"
    drained = run_cli(["drain", "--timeout", "60"], cwd=tmp_path, env=env, timeout=120)
    assert drained.returncode == 0, drained.stderr
    matter = _file_of(md, first)  # loaded with yaml.safe_load
    assert matter["reason"] == "delivered"
    assert (matter["retry_attempted"], matter["chunk_id"]) == (False, None)
    # Not a pending file for replay: it names no BrainLayer delivery to wait for.
    replayed = run_cli(["replay", "--json"], cwd=tmp_path, env=env)
    assert json.loads(replayed.stdout)["pending"] == 0

    second = "a memory whose first try fails"
    assert run_cli(["add", second], cwd=tmp_path, env=env).returncode == 0
    failing = {**env, "OUTBOX_FAULTY_FAIL_RATE": "1"}
    assert run_cli(["drain", "--timeout", "5"], cwd=tmp_path, env=failing).returncode == 1
    assert _file_of(md, second)["reason"] == "transport_closed"
    with Outbox.open(load_settings(env=env)) as ob:
        make_due(ob)
    drained = run_cli(["drain", "--timeout", "60"], cwd=tmp_path, env=env, timeout=120)
    assert drained.returncode == 0, drained.stderr
    matter = _file_of(md, second)
    assert (matter["reason"], matter["retry_attempted"]) == ("transport_closed", True)
    assert _file_of(md, first)["reason"] == "delivered"


def test_replay_without_a_store_and_nothing_to_import_creates_nothing(tmp_path: Path) -> None:
    env = child_env()
    env.pop("OUTBOX_HOME", None)
    missing = run_cli(["replay"], cwd=tmp_path, env=env)  # no markdown folder either
    assert missing.returncode == 1
    assert "is not a folder; nothing imported" in missing.stdout.decode()
    assert _everything_under(tmp_path) == []

    folder = tmp_path / "old"
    folder.mkdir()
    (folder / MALFORMED_ONLY).write_bytes((FIXTURES / MALFORMED_ONLY).read_bytes())
    nothing = run_cli(["replay", str(folder)], cwd=tmp_path, env=env)
    assert nothing.returncode == 0, nothing.stderr
    assert nothing.stdout.decode().startswith("0 imported, 0 already in the outbox, 1 skipped")
    assert _everything_under(tmp_path) == ["old", f"old/{MALFORMED_ONLY}"]

    name = next(iter(PENDING))
    (folder / name).write_bytes((FIXTURES / name).read_bytes())
    imported = run_cli(["replay", str(folder)], cwd=tmp_path, env=env)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.decode().startswith("1 imported")
    assert (tmp_path / ".outbox").is_dir()  # a write makes the store


def test_status_with_a_database_folder_that_does_not_exist_creates_nothing(
    tmp_path: Path,
) -> None:
    home = tmp_path / ".outbox"
    home.mkdir(mode=0o700)
    nowhere = tmp_path / "nowhere" / "sub"
    env = child_env(home, db_url=f"sqlite:///{nowhere}/outbox.db")
    for command in (["status"], ["status", "--json"], ["recent"]):
        done = run_cli(command, cwd=tmp_path, env=env)
        assert done.returncode == 1, command
        (line,) = done.stderr.decode().splitlines()
        assert f"no outbox database at {nowhere}/outbox.db" in line
        assert "OUTBOX_DB_URL" in line
    assert not (tmp_path / "nowhere").exists()
    assert _everything_under(home) == []
