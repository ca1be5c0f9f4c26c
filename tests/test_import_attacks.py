"""Fallback and legacy files are imported only as ``add`` would take them: the same caps, JSON
metadata without NaN, nothing outside the markdown folder, and one bad file never blocks an
open, the rest of a batch, or the write that triggered the import. Driven through the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from outbox.core.record import build_record
from outbox.write.fallback import INDEX_NAME, FallbackQueue
from tests.conftest import FAULTY
from tests.helpers.subproc import child_env, run_cli

TS = "2026-03-15T08:00:00.000000Z"

# One pending file each, with front matter as an earlier fallback skill (or an attacker who
# can write the markdown folder) might leave it.
POISON = {
    "yaml-date": "metadata:\n  when: 2026-03-15\n",
    "nan": "metadata:\n  score: .nan\n",
    "infinity": "metadata:\n  score: -.inf\n",
    "not-a-mapping": "metadata: [1, 2, 3]\n",
    # About 600 bytes that expand to 10^6 strings when anything walks or dumps them.
    "anchors": "metadata:\n"
    + "  a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(
        f"  {name}: &{name} [{', '.join(['*' + prev] * 10)}]\n"
        for prev, name in zip("abcde", "bcdef", strict=True)
    ),
    "timestamp-object": "",  # the timestamp below becomes a mapping
}


def pending_file(folder: Path, name: str, extra: str, body: str, timestamp: str = TS) -> Path:
    path = folder / f"2026-03-15-{name}.md"
    path.write_text(
        "---\nintended_brain_store: true\nimportance: 5\ntags: [legacy]\n"
        f"timestamp: {timestamp}\nchunk_id:\n{extra}---\n{body}",
        encoding="utf-8",
    )
    return path


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    # The store exists (a write that fell back created its home first), with only files in it.
    (tmp_path / ".outbox").mkdir(mode=0o700)
    return child_env(tmp_path / ".outbox", markdown_dir=str(tmp_path / "md"))


def jsonl_events(tmp_path: Path) -> list[dict[str, object]]:
    """Every line of the log, parsed strictly: NaN or Infinity would fail here."""

    def refuse(constant: str) -> object:
        raise AssertionError(f"the log holds {constant}, which is not JSON")

    text = (tmp_path / ".outbox" / "outbox.jsonl").read_text(encoding="utf-8")
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


@pytest.mark.parametrize("kind", sorted(POISON))
def test_a_poisoned_fallback_file_never_blocks_open_add_or_its_neighbour(
    kind: str, tmp_path: Path, env: dict[str, str]
) -> None:
    folder = tmp_path / "md"
    folder.mkdir()
    timestamp = "{nested: value}" if kind == "timestamp-object" else TS
    bad = pending_file(folder, "poisoned", POISON[kind], "a poisoned memory body", timestamp)
    queue = FallbackQueue(folder, (FAULTY,))
    good, _ = queue.write(
        build_record("a good memory that waited in the fallback queue"), "db_busy"
    )
    with (folder / INDEX_NAME).open("a", encoding="utf-8") as index:
        index.write(bad.name + "\n")  # as if the fallback writer had queued it
    before = bad.read_bytes()

    status = run_cli(["status", "--json"], cwd=tmp_path, env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["records"] == 1  # the good neighbour came in
    added = run_cli(["add", "a write after the poisoned import", "--json"], cwd=tmp_path, env=env)
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["status"] == "queued"

    events = jsonl_events(tmp_path)
    assert [e["content"] for e in events if e["event"] == "accepted"] == [
        "a good memory that waited in the fallback queue",
        "a write after the poisoned import",
    ]
    assert bad.read_bytes() == before  # skipped, not rewritten
    assert good.exists()
    assert (tmp_path / ".outbox" / "outbox.db").stat().st_size < 1_000_000
    verify = run_cli(["verify"], cwd=tmp_path, env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_replay_skips_each_bad_file_with_one_line_and_imports_the_rest(
    tmp_path: Path, env: dict[str, str]
) -> None:
    folder = tmp_path / "legacy"
    folder.mkdir()
    for kind, extra in POISON.items():
        if kind != "timestamp-object":
            pending_file(folder, kind, extra, f"legacy memory poisoned by {kind}")
    good = pending_file(folder, "good", "metadata:\n  source: legacy\n", "a good legacy memory")

    result = run_cli(["replay", str(folder), "--json"], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    (event,) = [e for e in jsonl_events(tmp_path) if e["event"] == "accepted"]
    assert event["content"] == "a good legacy memory"
    assert good.exists() and report["imported"] == [event["key"][:12]]
    # The owner's report names a skipped file by its path (contract 11); the digest of its
    # name, which log lines use, is there too.
    skipped = {entry["file_digest"]: entry["why"] for entry in report["skipped"]}
    paths = {entry["file_digest"]: entry["path"] for entry in report["skipped"]}
    assert paths[name_digest("2026-03-15-nan.md")] == str(folder / "2026-03-15-nan.md")
    assert len(skipped) == len(POISON) - 1
    assert all("metadata" in why and "\n" not in why for why in skipped.values())
    assert "NaN or infinity" in skipped[name_digest("2026-03-15-nan.md")]
    assert "over 65536 bytes" in skipped[name_digest("2026-03-15-anchors.md")]
    assert "nan.md" not in result.stderr.decode()


def name_digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:8]


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_the_fallback_index_never_leads_outside_the_markdown_folder(
    where: str, tmp_path: Path, env: dict[str, str]
) -> None:
    folder = tmp_path / "md"
    folder.mkdir()
    outside_dir = tmp_path / "elsewhere"
    outside_dir.mkdir()
    outside = pending_file(outside_dir, "outside", "", "a file outside the markdown folder")
    before = outside.read_bytes()
    name = str(outside) if where == "absolute" else f"../elsewhere/{outside.name}"
    (folder / INDEX_NAME).write_text(name + "\n", encoding="utf-8")

    status = run_cli(["status", "--json"], cwd=tmp_path, env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["records"] == 0
    assert outside.read_bytes() == before
    assert not (folder / INDEX_NAME).exists()  # the entry was read, and dropped
