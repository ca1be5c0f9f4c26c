"""Bad input and bad settings: one clear error, exit code 2 on the command line, and nothing
written anywhere (no database, no JSONL line, no markdown file)."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox import ConfigError, Outbox, Settings, ValidationError, load_settings
from tests.conftest import FAULTY
from tests.helpers.subproc import child_env, run_cli

MIN_LENGTH = 10
MAX_BYTES = 1000
GOOD = "a perfectly ordinary memory"


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a digest of its bytes; SQLite files by row counts, since
    their pages may legitimately be rewritten without any change of content."""
    state: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.name.endswith(("-wal", "-shm")):
            continue
        if path.suffix == ".db":
            with sqlite3.connect(path) as conn:
                query = "SELECT name FROM sqlite_master WHERE type = 'table'"
                tables = [row[0] for row in conn.execute(query)]
                counts = {
                    table: conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
                    for table in tables
                }
            state[str(path)] = repr(sorted(counts.items()))
        else:
            state[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


@pytest.fixture
def strict(tmp_path: Path) -> Iterator[Outbox]:
    """An outbox with one record already written, a minimum length and a small size cap."""
    settings = load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "docs.local" / "decisions",
        sinks=FAULTY,
        min_content_length=MIN_LENGTH,
        max_content_bytes=MAX_BYTES,
    )
    ob = Outbox.open(settings)
    ob.add("the one record that was here before")
    assert ob.wait_mirrored(10)  # its files follow the commit; the snapshots must see them
    yield ob
    ob.close()


class Unserialisable:
    pass


BAD_PYTHON: list[tuple[str, dict[str, Any], str]] = [
    ("empty", {"content": ""}, "content"),
    ("whitespace", {"content": " \n\t  "}, "content"),
    ("too short", {"content": "tiny"}, "content"),
    ("too big", {"content": "x" * (MAX_BYTES + 1)}, "content"),
    ("too big in bytes", {"content": "é" * (MAX_BYTES // 2 + 1)}, "content"),
    ("not text", {"content": b"bytes are not text"}, "content"),
    ("none", {"content": None}, "content"),
    ("nul", {"content": "before\x00after the nul"}, "content"),
    ("lone surrogate", {"content": "broken \ud800 surrogate"}, "content"),
    ("importance 0", {"importance": 0}, "importance"),
    ("importance 11", {"importance": 11}, "importance"),
    ("importance x", {"importance": "x"}, "importance"),
    ("importance superscript two", {"importance": "²"}, "importance"),
    ("importance True", {"importance": True}, "importance"),
    ("importance float", {"importance": 2.5}, "importance"),
    ("bad timestamp", {"timestamp": "next tuesday"}, "timestamp"),
    ("timestamp type", {"timestamp": 1764403200}, "timestamp"),
    ("metadata object", {"metadata": {"thing": Unserialisable()}}, "metadata"),
    ("metadata nan", {"metadata": {"score": float("nan")}}, "metadata"),
    ("metadata nested inf", {"metadata": {"scores": [1.0, float("inf")]}}, "metadata"),
    ("metadata not a mapping", {"metadata": ["a", "b"]}, "metadata"),
    ("metadata surrogate", {"metadata": {"k": "\udc80"}}, "metadata"),
    ("tags int", {"tags": [1, 2]}, "tags"),
    ("tags one string", {"tags": "decision"}, "tags"),
    ("tags none item", {"tags": ["ok", None]}, "tags"),
    ("tags bytes item", {"tags": [b"raw"]}, "tags"),
    ("tag empty", {"tags": ["  "]}, "tags"),
    ("tag nul", {"tags": ["a\x00b"]}, "tags"),
    ("slug nul", {"slug": "a\x00b"}, "slug"),
    ("slug not text", {"slug": 42}, "slug"),
]


@pytest.mark.parametrize(
    ("fields", "field"), [case[1:] for case in BAD_PYTHON], ids=[case[0] for case in BAD_PYTHON]
)
def test_bad_input_through_python_writes_nothing(
    strict: Outbox, tmp_path: Path, fields: dict[str, Any], field: str
) -> None:
    before = snapshot(tmp_path)
    arguments = {"content": GOOD, **fields}
    content = arguments.pop("content")
    with pytest.raises(ValidationError) as info:
        strict.add(content, **arguments)
    assert info.value.field == field
    assert "\n" not in str(info.value)
    with pytest.raises(ValidationError):
        strict.add_many(
            [{"content": "a valid record in the same batch"}, {"content": GOOD, **fields}]
        )
    assert snapshot(tmp_path) == before
    assert strict.storage.records.count_records() == 1


def assert_one_clear_line(stderr: bytes, *words: str) -> None:
    text = stderr.decode("utf-8", errors="replace")
    assert text.endswith("\n")
    assert text.count("\n") == 1, text
    assert "Traceback" not in text
    assert text.startswith("outbox: ")
    for word in words:
        assert word in text, text


# (argv after "add", stdin, extra settings, words the one error line must contain)
BAD_CLI: list[tuple[str, list[str | bytes], bytes | None, dict[str, str], tuple[str, ...]]] = [
    ("empty", [""], None, {}, ("content", "empty")),
    ("whitespace", ["  \t "], None, {}, ("content", "whitespace")),
    ("empty stdin", ["-"], b"", {}, ("content",)),
    ("too short", ["tiny"], None, {}, ("content", "OUTBOX_MIN_CONTENT_LENGTH")),
    ("too big", ["-"], b"x" * (MAX_BYTES + 1), {}, ("content", str(MAX_BYTES))),
    ("nul on stdin", ["-"], b"before\x00after the nul byte", {}, ("content", "NUL")),
    ("surrogate in argv", [b"broken \xed\xa0\x80 surrogate memory"], None, {}, ("content",)),
    ("invalid utf-8 stdin", ["-"], b"not \xff\xfe utf-8 at all", {}, ("content", "UTF-8")),
    ("importance 0", [GOOD, "--importance", "0"], None, {}, ("importance",)),
    ("importance 11", [GOOD, "--importance", "11"], None, {}, ("importance",)),
    ("importance x", [GOOD, "--importance", "x"], None, {}, ("importance",)),
    ("importance superscript two", [GOOD, "--importance", "²"], None, {}, ("importance",)),
    ("importance True", [GOOD, "--importance", "True"], None, {}, ("importance",)),
    ("bad timestamp", [GOOD, "--timestamp", "next tuesday"], None, {}, ("timestamp",)),
    ("month 13", [GOOD, "--timestamp", "2026-13-01T00:00:00Z"], None, {}, ("timestamp",)),
    ("empty tag", [GOOD, "--tag", " "], None, {}, ("tags",)),
    ("surrogate tag", [GOOD, "--tag", b"\xed\xb2\x80"], None, {}, ("tags",)),
    ("surrogate slug", [GOOD, "--slug", b"a\xed\xb2\x80"], None, {}, ("slug",)),
    ("unknown option", [GOOD, "--importnce", "5"], None, {}, ()),
]


@pytest.mark.parametrize(
    ("argv", "stdin", "extra", "words"),
    [case[1:] for case in BAD_CLI],
    ids=[case[0] for case in BAD_CLI],
)
def test_bad_input_through_the_command_line_writes_nothing(
    tmp_path: Path,
    argv: list[str | bytes],
    stdin: bytes | None,
    extra: dict[str, str],
    words: tuple[str, ...],
) -> None:
    env = child_env(min_content_length=str(MIN_LENGTH), max_content_bytes=str(MAX_BYTES), **extra)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    result = run_cli(["add", *argv], cwd=fresh, env=env, stdin=stdin)
    assert result.returncode == 2, result.stderr
    assert result.stdout == b""
    if words:
        assert_one_clear_line(result.stderr, *words)
    else:  # argparse's own usage error: no traceback, still exit 2
        assert b"Traceback" not in result.stderr
    assert list(fresh.rglob("*")) == []

    # The same against an outbox that already holds a record: nothing changes.
    existing = tmp_path / "existing"
    existing.mkdir()
    assert run_cli(["add", "the record that was here first"], cwd=existing, env=env).returncode == 0
    before = snapshot(existing)
    result = run_cli(["add", *argv], cwd=existing, env=env, stdin=stdin)
    assert result.returncode == 2
    assert snapshot(existing) == before


# (environment settings, YAML file text or None, the setting the error must name)
BAD_SETTINGS: list[tuple[str, dict[str, str], str | None, str]] = [
    ("unknown sink", {"sinks": "nosuchsink"}, None, "OUTBOX_SINKS"),
    ("empty sink list", {"sinks": " , "}, None, "OUTBOX_SINKS"),
    ("batch size text", {"batch_size": "abc"}, None, "OUTBOX_BATCH_SIZE"),
    ("batch size zero", {"batch_size": "0"}, None, "OUTBOX_BATCH_SIZE"),
    ("max retries negative", {"max_retries": "-1"}, None, "OUTBOX_MAX_RETRIES"),
    ("poll interval text", {"poll_interval": "soon"}, None, "OUTBOX_POLL_INTERVAL"),
    ("busy timeout text", {"busy_timeout": "forever"}, None, "OUTBOX_BUSY_TIMEOUT"),
    ("retention bad unit", {"retention": "7 weeks"}, None, "OUTBOX_RETENTION"),
    ("min length text", {"min_content_length": "zero"}, None, "OUTBOX_MIN_CONTENT_LENGTH"),
    ("db url scheme", {"db_url": "mysql://host/db"}, None, "OUTBOX_DB_URL"),
    ("chroma url", {"chroma_url": "localhost:8000"}, None, "OUTBOX_CHROMA_URL"),
    ("chroma collection", {"chroma_collection": "a"}, None, "OUTBOX_CHROMA_COLLECTION"),
    ("synchronous", {"synchronous": "FAST"}, None, "OUTBOX_SYNCHRONOUS"),
    ("missing config file", {"config": "nowhere.yaml"}, None, "OUTBOX_CONFIG"),
    ("yaml bad value", {}, "batch_size: lots\n", "OUTBOX_BATCH_SIZE"),
    ("yaml unknown key", {}, "batch_sise: 10\n", "batch_sise"),
    ("yaml not yaml", {}, "sinks: [chroma\n", "OUTBOX_CONFIG"),
    ("yaml not a mapping", {}, "- chroma\n", "OUTBOX_CONFIG"),
]


@pytest.mark.parametrize(
    ("extra", "yaml_text", "setting"),
    [case[1:] for case in BAD_SETTINGS],
    ids=[case[0] for case in BAD_SETTINGS],
)
def test_bad_settings_on_the_command_line_write_nothing(
    tmp_path: Path, extra: dict[str, str], yaml_text: str | None, setting: str
) -> None:
    if yaml_text is not None:
        (tmp_path / "outbox.yaml").write_text(yaml_text)
    result = run_cli(["add", GOOD], cwd=tmp_path, env=child_env(**extra))
    assert result.returncode == 2, result.stderr
    assert_one_clear_line(result.stderr, setting)
    assert result.stdout == b""
    left = sorted(path.name for path in tmp_path.rglob("*"))
    assert left == (["outbox.yaml"] if yaml_text is not None else [])


def test_bad_setting_fails_status_too(tmp_path: Path) -> None:
    result = run_cli(["status"], cwd=tmp_path, env=child_env(batch_size="many"))
    assert result.returncode == 2
    assert_one_clear_line(result.stderr, "OUTBOX_BATCH_SIZE")
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        ({"batch_size": "abc"}, "batch_size"),
        ({"sinks": "nosuchsink"}, "OUTBOX_SINKS"),
        ({"busy_timeout": -1}, "busy_timeout"),
        ({"not_a_setting": 1}, "not_a_setting"),
    ],
)
def test_bad_settings_through_python_write_nothing(
    tmp_path: Path, overrides: dict[str, Any], setting: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Outbox.open(home=tmp_path / ".outbox", markdown_dir=tmp_path / "md", **overrides)
    assert setting in str(info.value)
    assert list(tmp_path.rglob("*")) == []


def test_the_gate_runs_before_a_transaction(settings: Settings, tmp_path: Path) -> None:
    """A batch with one bad item commits none of the good ones."""
    with Outbox.open(settings) as ob:
        with pytest.raises(ValidationError):
            ob.add_many(["first good memory", "second good memory", ""])
        assert ob.storage.records.count_records() == 0
        assert ob.mirrors.jsonl.size() == 0
        assert not list(settings.markdown_dir.glob("*.md"))
