"""Replay of files the seed-000 fallback skill left behind (contract section 4a).

The files under ``tests/fixtures/legacy/`` are hand-written in that skill's format; each test
works on a copy. Replay is run as the real ``outbox replay`` command; deliveries through the
``outbox drain`` command with the FaultySink. The report names each record by its key prefix
(issue 13, point 5: a file's name carries the first words of its memory), and a file it
skipped by its path, relative to the markdown folder: the owner reads the report in their
own terminal and has to find that file (issue 22, point 7). Logs, which travel, keep naming
a file by a digest of its name.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from outbox import Outbox, Settings
from outbox.write.fallback import INDEX_NAME
from tests.conftest import FAULTY
from tests.helpers.checks import (
    accepted_counts,
    contract_key,
    markdown_files,
    split_markdown,
)
from tests.helpers.subproc import child_env, run_cli

FIXTURES = Path(__file__).parent / "fixtures" / "legacy"

# Pending files and the canonical timestamp each one's key is made from (section 2).
PENDING = {
    "2026-03-14-quoted-timestamp.md": "2026-03-14T09:15:00.000000Z",
    "2026-03-15-bare-timestamp.md": "2026-03-15T16:40:05.250000Z",  # 18:40:05.250+02:00
    "2025-12-31-named-for-another-day.md": "2026-01-02T23:59:59.000000Z",
    "2026-03-16-no-importance-no-tags.md": "2026-03-16T07:00:00.000000Z",
    "2026-03-19-duplicate-first.md": "2026-03-19T10:00:00.000000Z",
}
DUPLICATE = "2026-03-19-duplicate-second.md"  # same body and instant as duplicate-first
MALFORMED = (
    "2026-03-18-invalid-yaml.md",
    "2026-03-18-no-closing-fence.md",
    "2026-03-18-no-timestamp.md",
)
LEFT_ALONE = ("2026-03-17-already-stored.md", "2026-03-20-not-for-brainlayer.md")


def _env(settings: Settings, **extra: str) -> dict[str, str]:
    return child_env(settings.home, markdown_dir=str(settings.markdown_dir), **extra)


def _replay_json(settings: Settings, *args: str) -> tuple[int, dict[str, object]]:
    done = run_cli(["replay", *args, "--json"], cwd=settings.home.parent, env=_env(settings))
    lines = done.stdout.decode("utf-8").splitlines()
    assert len(lines) == 1, done.stdout  # --json: one object on stdout, nothing else
    payload = json.loads(lines[0])
    assert isinstance(payload, dict)
    return done.returncode, payload


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in folder.iterdir()}


def _digest(name: str) -> str:
    """How the report names a file without a key: 8 hex of SHA-256 of its name."""
    return hashlib.sha256(name.encode("utf-8")).hexdigest()[:8]


def _fixture_key(name: str) -> str:
    return contract_key(split_markdown(FIXTURES / name)[1].decode("utf-8"), PENDING[name])


def _assert_names_no_file(output: bytes, *, but: tuple[str, ...] = ()) -> None:
    """No fixture's name (``but`` these), nor the words of it that come from the memory,
    in ``output``."""
    text = output.decode("utf-8")
    for path in FIXTURES.glob("*.md"):
        if path.name in but:
            continue
        assert path.name not in text
        assert path.stem[11:] not in text, path.stem  # the slug: the memory's first words


@pytest.fixture
def legacy(settings: Settings) -> Path:
    """A copy of the fixtures as the markdown folder, where seed 000 left its files."""
    shutil.copytree(FIXTURES, settings.markdown_dir)
    return settings.markdown_dir


def test_replay_of_seed_000_files(settings: Settings, legacy: Path) -> None:
    original = _snapshot(legacy)
    done = run_cli(["replay", str(legacy), "--json"], cwd=settings.home.parent, env=_env(settings))
    assert done.returncode == 0, done.stderr
    _assert_names_no_file(done.stdout, but=MALFORMED)  # the skipped files' paths, only
    _assert_names_no_file(done.stderr)
    report = json.loads(done.stdout)
    assert report["refused"] is None and report["ok"] is True
    prefixes = {name: _fixture_key(name)[:12] for name in PENDING}
    assert sorted(report["imported"]) == sorted(prefixes.values())
    # The second file of a pair is named by the key it shares with the first.
    assert report["already_in_outbox"] == [prefixes["2026-03-19-duplicate-first.md"]]
    skipped = {entry["file_digest"]: entry for entry in report["skipped"]}
    assert sorted(skipped) == sorted(_digest(name) for name in MALFORMED)
    assert all(entry["key"] is None for entry in skipped.values())  # none could be read
    for name in MALFORMED:  # --json paths are absolute
        assert skipped[_digest(name)]["path"] == str(legacy / name)
    assert "closing" in skipped[_digest("2026-03-18-no-closing-fence.md")]["why"]
    assert "YAML" in skipped[_digest("2026-03-18-invalid-yaml.md")]["why"]
    assert "timestamp" in skipped[_digest("2026-03-18-no-timestamp.md")]["why"]
    defaulted = prefixes["2026-03-16-no-importance-no-tags.md"]
    assert sorted(report["warnings"]) == [
        f"record {defaulted}: no importance in front matter; imported default",
        f"record {defaulted}: no tags in front matter; imported default",
    ]

    # Nothing moved, deleted or added; the files not imported are untouched byte for byte.
    after = _snapshot(legacy)
    assert set(after) == set(original)
    for name in (*MALFORMED, *LEFT_ALONE, DUPLICATE):
        assert after[name] == original[name], name
    keys = {}
    for name, stamp in PENDING.items():
        before_matter, body = split_markdown(FIXTURES / name)
        matter, now_body = split_markdown(legacy / name)
        assert now_body == body  # the body byte for byte
        keys[name] = contract_key(body.decode("utf-8"), stamp)
        assert matter.pop("key") == keys[name]  # gained its key, kept everything else
        assert matter == before_matter

    with Outbox.open(settings) as ob:
        assert ob.storage.records.count_records() == len(PENDING)
        for name, key in keys.items():
            stored = ob.storage.records.get_record(key)
            assert stored is not None, name
            assert stored.markdown_name == name  # the file stays its record's mirror
            assert stored.record.content.encode("utf-8") == split_markdown(legacy / name)[1]
        defaults = ob.storage.records.get_record(keys["2026-03-16-no-importance-no-tags.md"])
        assert defaults is not None and (defaults.record.importance, defaults.record.tags) == (
            5,
            (),
        )
        quoted = ob.storage.records.get_record(keys["2026-03-14-quoted-timestamp.md"])
        assert quoted is not None
        assert (quoted.record.importance, quoted.record.tags) == (8, ("decision", "storage"))
    assert accepted_counts(settings.jsonl_path) == dict.fromkeys(keys.values(), 1)

    # Deliver with the FaultySink: each file shows its delivery in place.
    env = _env(settings, faulty_db=str(settings.home / "sink.db"))
    drained = run_cli(["drain"], cwd=settings.home.parent, env=env)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    for name, key in keys.items():
        matter, body = split_markdown(legacy / name)
        assert body == split_markdown(FIXTURES / name)[1]
        assert matter["sinks"] == {FAULTY: "delivered"}
        assert matter["sink_ids"] == {FAULTY: f"faulty-{key[:16]}"}
        assert matter["retry_attempted"] is True  # delivering it was the retry seed 000 records
        assert matter["chunk_id"] in (None, "")  # BrainLayer's id; the FaultySink has none
    assert set(_snapshot(legacy)) == set(original)

    # Twice adds nothing: the same report, in words this time, and no new line anywhere.
    jsonl = settings.jsonl_path.read_bytes()
    again = run_cli(["-v", "replay", str(legacy)], cwd=settings.home.parent, env=_env(settings))
    assert again.returncode == 0
    _assert_names_no_file(again.stdout, but=MALFORMED)
    _assert_names_no_file(again.stderr)  # the logs at INFO
    text = again.stdout.decode("utf-8")
    assert text.startswith(
        f"0 imported, {len(PENDING) + 1} already in the outbox, 3 skipped, 0 left for a later run"
    )
    for name in MALFORMED:  # relative to the markdown folder, which the owner can open
        assert f"\nskipped {name}: " in text
        assert (legacy / name).exists()
    assert "file #" not in text
    assert settings.jsonl_path.read_bytes() == jsonl
    with Outbox.open(settings) as ob:
        assert ob.storage.records.count_records() == len(PENDING)
    verified = run_cli(["verify"], cwd=settings.home.parent, env=_env(settings))
    assert verified.returncode == 0, verified.stdout


SEED_FILE = """---
intended_brain_store: true
importance: {importance}
tags: [bulk, legacy]
timestamp: '2026-02-{day:02d}T{hour:02d}:{minute:02d}:00Z'
reason: db_busy
retry_attempted: false
chunk_id:
---
Legacy memory number {number} from a long BrainLayer outage.
"""


def test_more_than_100_pending_files_need_a_budget(settings: Settings, tmp_path: Path) -> None:
    """101 pending files outside the markdown folder: refused, then 40, then the other 61."""
    folder = tmp_path / "old-session" / "decisions"
    folder.mkdir(parents=True)
    for number in range(101):
        text = SEED_FILE.format(
            importance=1 + number % 10,
            day=1 + number % 28,
            hour=number % 24,
            minute=number % 60,
            number=number,
        )
        (folder / f"2026-02-{1 + number % 28:02d}-legacy-{number:03d}.md").write_text(
            text, encoding="utf-8"
        )
    original = _snapshot(folder)
    cwd, env = settings.home.parent, _env(settings)

    refused = run_cli(["replay", str(folder)], cwd=cwd, env=env)
    assert refused.returncode == 1
    assert refused.stdout.decode("utf-8").startswith("refused: 101 pending files")
    assert "nothing imported" in refused.stdout.decode("utf-8")
    code, report = _replay_json(settings, str(folder))
    assert code == 1 and report["ok"] is False and report["imported"] == []
    assert "101" in str(report["refused"])
    assert _snapshot(folder) == original
    with Outbox.open(settings) as ob:
        assert ob.storage.records.count_records() == 0
    assert accepted_counts(settings.jsonl_path) == {}

    code, report = _replay_json(settings, str(folder), "--budget", "40")
    assert code == 0
    assert (len(report["imported"]), report["not_reached"]) == (40, 61)  # type: ignore[arg-type]
    code, report = _replay_json(settings, str(folder), "--budget", "100")
    assert code == 0
    assert (len(report["imported"]), len(report["already_in_outbox"])) == (61, 40)  # type: ignore[arg-type]
    assert report["not_reached"] == 0
    code, report = _replay_json(settings, str(folder))  # nothing left to refuse over
    assert code == 0 and report["imported"] == [] and len(report["already_in_outbox"]) == 101  # type: ignore[arg-type]

    with Outbox.open(settings) as ob:
        assert ob.storage.records.count_records() == 101
        assert ob.verify().ok
    counts = accepted_counts(settings.jsonl_path)
    assert len(counts) == 101 and set(counts.values()) == {1}
    assert sorted(p.name for p in markdown_files(folder)) == sorted(original)
    for name, data in original.items():
        matter, body = split_markdown(folder / name)
        assert body == data.split(b"---\n", 2)[2]
        assert len(matter["key"]) == 64
    assert not markdown_files(settings.markdown_dir)  # imported where they are, not copied
    verified = run_cli(["verify"], cwd=cwd, env=env)
    assert verified.returncode == 0, verified.stdout


def test_replay_shows_the_long_commands_progress_line(settings: Settings, tmp_path: Path) -> None:
    """Off a terminal, replay's bar is a plain line on stderr, as rebuild's and reindex's are
    (the shared progress line); stdout keeps only the report, and --json shows no bar."""
    folder = tmp_path / "old-session"
    folder.mkdir()
    for number in range(3):
        text = SEED_FILE.format(importance=5, day=1, hour=number, minute=0, number=number)
        (folder / f"2026-02-01-legacy-{number:03d}.md").write_text(text, encoding="utf-8")
    done = run_cli(["replay", str(folder)], cwd=settings.home.parent, env=_env(settings))
    assert done.returncode == 0, done.stderr
    assert done.stderr.decode("utf-8").splitlines() == [f"replay [{'#' * 30}] 3/3"]
    assert done.stdout.decode("utf-8").startswith("3 imported, 0 already in the outbox")


def test_a_fallback_file_the_open_cannot_import_is_logged_by_digest(settings: Settings) -> None:
    """The import every open makes logs a file it skips by its name's digest: the name itself
    holds the memory's first words."""
    Outbox.open(settings).close()  # the store exists; its queue then holds a broken file
    name = "2026-03-15-my-bank-password-is-hunter2.md"
    settings.markdown_dir.mkdir(mode=0o700, parents=True)
    (settings.markdown_dir / name).write_text(
        "---\noutbox_fallback: true\ntimestamp: [never closed\n---\nthe memory", encoding="utf-8"
    )
    (settings.markdown_dir / INDEX_NAME).write_text(name + "\n", encoding="utf-8")
    done = run_cli(["-v", "status"], cwd=settings.home.parent, env=_env(settings))
    assert done.returncode == 0, done.stderr
    stderr = done.stderr.decode("utf-8")
    assert f"fallback import skipped file #{_digest(name)}: " in stderr
    assert "hunter2" not in stderr + done.stdout.decode("utf-8")


def test_a_skipped_file_outside_the_markdown_folder_is_named_by_its_absolute_path(
    settings: Settings, tmp_path: Path
) -> None:
    """``outbox replay DIR`` on a folder elsewhere: the report names the file it skipped by
    a path the owner can open from anywhere; its log lines still name none."""
    folder = tmp_path / "old-session"
    folder.mkdir()
    name = "2026-03-18-no-timestamp.md"
    shutil.copyfile(FIXTURES / name, folder / name)
    done = run_cli(["-v", "replay", str(folder)], cwd=settings.home.parent, env=_env(settings))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode("utf-8").splitlines()
    assert lines[1] == f"skipped {folder / name}: front matter has no timestamp"
    _assert_names_no_file(done.stderr)
