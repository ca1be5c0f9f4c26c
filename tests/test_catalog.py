"""``outbox show`` and ``outbox export``, and a unique key prefix wherever a command takes a
KEY: through the CLI, against the files and the database it leaves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers.subproc import child_env, run_cli

TEXTS = [
    "We chose SQLite in WAL mode.",
    "Alice prefers short answers.",
    "Deploys wait for migrations.",
]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return child_env(tmp_path / ".outbox", faulty_db=str(tmp_path / "faulty.db"))


@pytest.fixture
def keys(tmp_path: Path, env: dict[str, str]) -> list[str]:
    found = []
    for number, text in enumerate(TEXTS):
        args = ["add", text, "--json", "--tag", "t", "--importance", str(number + 3)]
        result = run_cli(args, cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr
        found.append(json.loads(result.stdout)["key"])
    return found


def unique_prefix(key: str, others: list[str]) -> str:
    return next(key[:n] for n in range(1, 65) if not any(o.startswith(key[:n]) for o in others))


def test_show_by_unique_prefix(tmp_path: Path, env: dict[str, str], keys: list[str]) -> None:
    prefix = unique_prefix(keys[1], [k for k in keys if k != keys[1]])
    result = run_cli(["show", prefix, "--json"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert (shown["key"], shown["content"], shown["importance"]) == (keys[1], TEXTS[1], 4)
    assert [s["state"] for s in shown["sinks"]] == ["pending"]
    assert Path(shown["markdown_path"]).is_absolute() and Path(shown["markdown_path"]).exists()
    assert shown["jsonl_lines"] == [2]


def test_show_refuses_unknown_ambiguous_and_malformed_keys(
    tmp_path: Path, env: dict[str, str], keys: list[str]
) -> None:
    unknown = next(c for c in "0123456789abcdef" if not any(k.startswith(c) for k in keys))
    missing = run_cli(["show", unknown], cwd=tmp_path, env=env)
    assert (missing.returncode, missing.stdout) == (1, b"")
    assert b"no record" in missing.stderr
    bad = run_cli(["show", "not-hex"], cwd=tmp_path, env=env)
    assert bad.returncode == 2 and b"hex" in bad.stderr
    # Enough records that some one-character prefix is shared by two of them.
    for number in range(40):
        run_cli(["add", f"filler memory number {number}"], cwd=tmp_path, env=env)
    listed = run_cli(["export"], cwd=tmp_path, env=env)
    all_keys = [json.loads(line)["key"] for line in listed.stdout.splitlines()]
    shared = next(c for c in "0123456789abcdef" if sum(k.startswith(c) for k in all_keys) > 1)
    ambiguous = run_cli(["show", shared], cwd=tmp_path, env=env)
    assert ambiguous.returncode == 2
    assert b"matches several records" in ambiguous.stderr


def test_export_jsonl_and_markdown(tmp_path: Path, env: dict[str, str], keys: list[str]) -> None:
    out = tmp_path / "export.jsonl"
    result = run_cli(["export", str(out)], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    exported = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [e["key"] for e in exported] == keys
    assert [e["content"] for e in exported] == TEXTS
    again = run_cli(["export", str(out)], cwd=tmp_path, env=env)
    assert again.returncode == 1, "an existing file is never overwritten"

    folder = tmp_path / "md-export"
    result = run_cli(["export", "--format", "markdown", str(folder)], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    files = sorted(folder.glob("*.md"))
    assert len(files) == len(keys)
    bodies = set()
    for path in files:
        head, body = path.read_text(encoding="utf-8").split("---\n", 2)[1:]
        assert yaml.safe_load(head)["key"] in keys
        bodies.add(body)
    assert bodies == set(TEXTS)


def test_dead_letter_commands_take_a_prefix(
    tmp_path: Path, env: dict[str, str], keys: list[str]
) -> None:
    prefix = unique_prefix(keys[0], keys[1:])
    result = run_cli(["dead", "show", prefix, "--json"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["deliveries"]
    assert row["key"] == keys[0]
