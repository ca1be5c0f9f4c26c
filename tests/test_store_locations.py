"""The store records where its mirrors live, and an open pointing elsewhere is refused
(issue 13, point 3): one error line naming both paths and the setting, and nothing written.

Driven through the real command where a user would meet it; the PostgreSQL case shares one
database between two machines (two mirror ids), each with its own mirrors.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from alembic import command

from outbox import Outbox, load_settings
from outbox.store import migrate
from outbox.store.engine import make_engine
from outbox.store.locations import LocationMismatch, judge
from outbox.store.steady import MirrorPlaces
from tests.helpers.subproc import child_env, run_cli
from tests.pg import NOOP_SINK, new_database


def _store_row(root: Path) -> list[tuple[str, str, str]]:
    with sqlite3.connect(root / ".outbox" / "outbox.db") as conn:
        rows = conn.execute("SELECT mirror_id, jsonl_path, markdown_dir FROM store_locations")
        return [tuple(row) for row in rows]


def _records(root: Path) -> int:
    with sqlite3.connect(root / ".outbox" / "outbox.db") as conn:
        return int(conn.execute("SELECT count(*) FROM records").fetchone()[0])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A store made by a first ``outbox add`` with the default places."""
    folder = tmp_path / "project"
    folder.mkdir()
    done = run_cli(["add", "the first memory of this store"], cwd=folder, env=child_env())
    assert done.returncode == 0, done.stderr
    return folder


def test_creation_records_the_absolute_places(root: Path) -> None:
    ((mirror_id, jsonl, folder),) = _store_row(root)
    assert mirror_id  # the machine's id (its host name by default)
    assert jsonl == str(root / ".outbox" / "outbox.jsonl")
    assert folder == str(root / "docs.local" / "decisions")


@pytest.mark.parametrize(
    ("setting", "recorded"),
    [
        ("OUTBOX_MARKDOWN_DIR", "docs.local/decisions"),
        ("OUTBOX_JSONL_PATH", ".outbox/outbox.jsonl"),
    ],
)
def test_an_open_pointing_elsewhere_is_one_error_naming_both_paths(
    root: Path, setting: str, recorded: str
) -> None:
    elsewhere = root / "elsewhere" / "place"
    env = child_env(**{setting.removeprefix("OUTBOX_").lower(): str(elsewhere)})
    log_before = (root / ".outbox" / "outbox.jsonl").read_bytes()
    for args in (["status"], ["add", "a memory for the wrong mirrors"], ["verify"]):
        done = run_cli(args, cwd=root, env=env)
        assert done.returncode == 1, (args, done.stdout)
        lines = done.stderr.decode("utf-8").splitlines()
        assert len(lines) == 1, lines  # one line, no traceback
        assert str(root / recorded) in lines[0] and str(elsewhere) in lines[0]
        assert f"set {setting}={root / recorded}" in lines[0]
    assert not (root / "elsewhere").exists()  # nothing written at the other place
    assert _records(root) == 1
    assert (root / ".outbox" / "outbox.jsonl").read_bytes() == log_before
    assert run_cli(["status"], cwd=root, env=child_env()).returncode == 0  # the right places


def test_a_symlinked_path_to_the_same_folder_is_the_same_place(root: Path, tmp_path: Path) -> None:
    link = tmp_path / "link-to-notes"
    link.symlink_to(root / "docs.local" / "decisions")
    done = run_cli(
        ["add", "a memory through the link"], cwd=root, env=child_env(markdown_dir=str(link))
    )
    assert done.returncode == 0, done.stderr
    assert _records(root) == 2


def test_a_store_moved_whole_records_its_new_places(root: Path, tmp_path: Path) -> None:
    moved = tmp_path / "moved-project"
    shutil.move(root, moved)
    done = run_cli(["-v", "status", "--json"], cwd=moved, env=child_env())
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["records"] == 1
    assert "moved" in done.stderr.decode("utf-8")
    ((_, jsonl, folder),) = _store_row(moved)
    assert (jsonl, folder) == (
        str(moved / ".outbox" / "outbox.jsonl"),
        str(moved / "docs.local" / "decisions"),
    )
    verified = run_cli(["verify"], cwd=moved, env=child_env())
    assert verified.returncode == 0, verified.stdout


def test_a_store_older_than_the_check_records_its_places_on_first_open(tmp_path: Path) -> None:
    """A database at revision 0005 (before the table existed) opens without an error, and
    from then on refuses other places like a new store."""
    settings = load_settings(env={}, home=tmp_path / ".outbox")
    engine = make_engine(settings)
    config = migrate.alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0005")
    engine.dispose()
    assert migrate.current_revision(make_engine(settings, writer=False)) == "0005"

    first = run_cli(["status"], cwd=tmp_path, env=child_env())
    assert first.returncode == 0, first.stderr
    assert [row[1:] for row in _store_row(tmp_path)] == [
        (str(tmp_path / ".outbox" / "outbox.jsonl"), str(tmp_path / "docs.local" / "decisions"))
    ]
    other = run_cli(["status"], cwd=tmp_path, env=child_env(markdown_dir=str(tmp_path / "md")))
    assert other.returncode == 1
    assert "OUTBOX_MARKDOWN_DIR" in other.stderr.decode("utf-8")


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def test_each_machine_keeps_its_own_places_in_a_shared_database(
    backend: str, tmp_path: Path
) -> None:
    """PostgreSQL shared by two machines: each mirror id has its own log and folder, and each
    is held to its own, not to the other's."""
    with new_database(backend, tmp_path) as url:

        def machine(name: str, folder: str) -> Outbox:
            return Outbox.open(
                load_settings(
                    env={},
                    db_url=url,
                    home=tmp_path / folder / ".outbox",
                    markdown_dir=tmp_path / folder / "md",
                    sinks=NOOP_SINK,
                    mirror_id=name,
                )
            )

        with machine("alpha", "alpha") as alpha, machine("beta", "beta") as beta:
            alpha.add("a memory written on alpha")
            beta.add("a memory written on beta")
            places = {name: alpha.storage.locations.recorded(name) for name in ("alpha", "beta")}
        assert places == {
            name: MirrorPlaces(tmp_path / name / ".outbox" / "outbox.jsonl", tmp_path / name / "md")
            for name in ("alpha", "beta")
        }
        with machine("alpha", "alpha") as again:  # its own places: fine
            assert again.status()["records"] == 2
        with pytest.raises(LocationMismatch) as refused:
            machine("beta", "alpha")  # beta's id with alpha's places
        assert str(tmp_path / "beta" / "md") in str(refused.value)
        assert str(tmp_path / "alpha" / "md") in str(refused.value)


def test_judge_names_every_place_that_differs_and_moves_only_what_is_gone() -> None:
    recorded = MirrorPlaces(Path("/a/log.jsonl"), Path("/a/md"))
    configured = MirrorPlaces(Path("/b/log.jsonl"), Path("/b/md"))
    never = judge(recorded, configured, same_place=lambda _a, _b: False, exists=lambda _p: True)
    assert len(never.problems) == 2 and not never.moved
    assert "OUTBOX_JSONL_PATH" in never.problems[0] and "OUTBOX_MARKDOWN_DIR" in never.problems[1]
    gone = judge(
        recorded,
        configured,
        same_place=lambda _a, _b: False,
        exists=lambda path: str(path).startswith("/b"),
    )
    assert not gone.problems and len(gone.moved) == 2
    same = judge(recorded, configured, same_place=lambda _a, _b: True, exists=lambda _p: True)
    assert same == judge(recorded, recorded, same_place=lambda _a, _b: False, exists=bool)
