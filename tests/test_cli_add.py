"""``outbox add``, ``status``, ``verify``, ``drain`` and ``dead`` as real processes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from outbox import Outbox
from tests.conftest import FAULTY
from tests.helpers.subproc import child_env, run_cli

TS = "2026-11-29T08:00:00.000000Z"


@pytest.fixture
def env() -> dict[str, str]:
    return child_env()


def add_json(cwd: Path, env: dict[str, str], *args: str, stdin: bytes | None = None) -> dict:
    result = run_cli(["add", *args, "--json"], cwd=cwd, env=env, stdin=stdin)
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""
    (line,) = result.stdout.decode("utf-8").splitlines()
    payload = json.loads(line)
    assert isinstance(payload, dict)
    return payload


def test_add_prints_one_json_object_and_writes_both_mirrors(
    tmp_path: Path, env: dict[str, str]
) -> None:
    payload = add_json(
        tmp_path,
        env,
        "Use SQLite WAL for the outbox.",
        "--importance",
        "7",
        "--tag",
        "decision",
        "--tag",
        "storage",
        "--timestamp",
        "2026-11-29T09:00:00+01:00",
        "--slug",
        "WAL Decision",
    )
    expected_key = hashlib.sha256(b"Use SQLite WAL for the outbox.\n" + TS.encode()).hexdigest()
    assert {"key", "status", "duplicate", "markdown_path"} <= payload.keys()
    assert payload["key"] == expected_key
    assert payload["status"] == "queued"
    assert payload["duplicate"] is False
    assert payload["markdown_path"] == str(
        tmp_path / "docs.local/decisions/2026-11-29-wal-decision.md"
    )
    markdown = (tmp_path / payload["markdown_path"]).read_bytes()
    assert markdown.endswith(b"\n---\nUse SQLite WAL for the outbox.")
    assert b"tags: [decision, storage]\n" in markdown
    (line,) = (tmp_path / ".outbox" / "outbox.jsonl").read_text("utf-8").splitlines()
    event = json.loads(line)
    assert (event["event"], event["key"], event["importance"]) == ("accepted", expected_key, 7)


def test_add_reads_standard_input_byte_for_byte(tmp_path: Path, env: dict[str, str]) -> None:
    body = "line one\r\ntrailing spaces   \n\n🙂 no final newline".encode()
    payload = add_json(tmp_path, env, "-", "--timestamp", TS, stdin=body)
    assert (tmp_path / payload["markdown_path"]).read_bytes().endswith(b"---\n" + body)
    assert payload["key"] == hashlib.sha256(body + b"\n" + TS.encode()).hexdigest()


def test_repeated_add_is_a_duplicate_with_the_same_key_and_path(
    tmp_path: Path, env: dict[str, str]
) -> None:
    first = add_json(tmp_path, env, "said twice", "--timestamp", TS)
    second = add_json(tmp_path, env, "said twice", "--timestamp", "2026-11-29T03:00:00-05:00")
    assert second["duplicate"] is True
    assert (second["key"], second["markdown_path"]) == (first["key"], first["markdown_path"])
    assert len(list((tmp_path / "docs.local" / "decisions").iterdir())) == 1
    log = (tmp_path / ".outbox" / "outbox.jsonl").read_text("utf-8").splitlines()
    assert len(log) == 1


def test_plain_output_is_the_honest_status_line(tmp_path: Path, env: dict[str, str]) -> None:
    result = run_cli(["add", "a plain memory", "--timestamp", TS], cwd=tmp_path, env=env)
    assert result.returncode == 0
    key = hashlib.sha256(b"a plain memory\n" + TS.encode()).hexdigest()
    assert result.stdout.decode() == f"Queued {key} for FaultySink\n"
    assert b"stored" not in result.stdout.lower()


def test_the_console_script_is_installed(tmp_path: Path, env: dict[str, str]) -> None:
    script = Path(sys.executable).with_name("outbox")
    result = subprocess.run(
        [str(script), "add", "via the console script", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["status"] == "queued"


def test_status_counts_what_is_pending(tmp_path: Path, env: dict[str, str]) -> None:
    for text in ("first pending memory", "second pending memory"):
        add_json(tmp_path, env, text)
    result = run_cli(["status", "--json"], cwd=tmp_path, env=env)
    assert result.returncode == 0
    status = json.loads(result.stdout)
    assert status["records"] == 2
    assert status["sinks"][FAULTY]["pending"] == 2
    assert status["sinks"][FAULTY]["delivered"] == 0
    assert status["sinks"][FAULTY]["oldest_pending_age"] >= 0
    assert status["dead_letters"] == 0
    text = run_cli(["status"], cwd=tmp_path, env=env)
    assert text.returncode == 0
    assert b"records: 2" in text.stdout


@pytest.mark.parametrize("which", ["last", "first"])
def test_verify_detects_an_edited_jsonl_line(
    tmp_path: Path, env: dict[str, str], which: str
) -> None:
    add_json(tmp_path, env, "the first memory", "--timestamp", TS)
    add_json(tmp_path, env, "the second memory", "--timestamp", TS)
    ok = run_cli(["verify"], cwd=tmp_path, env=env)
    assert ok.returncode == 0
    assert ok.stdout.startswith(b"OK: 2 records, 2 JSONL lines, 2 markdown files")

    log = tmp_path / ".outbox" / "outbox.jsonl"
    target = b"the first memory" if which == "first" else b"the second memory"
    log.write_bytes(log.read_bytes().replace(target, target.upper()))
    bad = run_cli(["verify"], cwd=tmp_path, env=env)
    assert bad.returncode == 1
    lines = bad.stdout.decode().splitlines()
    assert lines[0].startswith("MISMATCH")
    assert len(lines) >= 2
    assert any("line" in line and "outbox.jsonl" in line for line in lines[1:])
    assert bad.stderr == b""

    as_json = run_cli(["verify", "--json"], cwd=tmp_path, env=env)
    assert as_json.returncode == 1
    payload = json.loads(as_json.stdout)
    assert payload["ok"] is False
    assert payload["problems"]


def test_verify_detects_an_edited_markdown_body(tmp_path: Path, env: dict[str, str]) -> None:
    payload = add_json(tmp_path, env, "words in the markdown file", "--timestamp", TS)
    path = tmp_path / payload["markdown_path"]
    path.write_bytes(path.read_bytes().replace(b"words in", b"WORDS IN"))
    result = run_cli(["verify"], cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert b"differs from the stored content" in result.stdout


def test_drain_and_dead_letters_on_the_command_line(tmp_path: Path) -> None:
    env = child_env(faulty_reject="POISON")
    good = add_json(tmp_path, env, "a good memory for the command line")
    bad = add_json(tmp_path, env, "a POISON memory the sink refuses")
    drained = run_cli(["drain"], cwd=tmp_path, env=env)
    assert drained.returncode == 1
    assert drained.stdout.decode().splitlines() == [
        f"{FAULTY}: delivered 1; now pending 0, leased 0, dead 1",
        "some records are still pending or dead",
    ]

    (line,) = run_cli(["dead", "list"], cwd=tmp_path, env=env).stdout.decode().splitlines()
    assert line.startswith(f"{bad['key']}  {FAULTY}  attempts=1  reason=rejected")
    shown = run_cli(["dead", "show", bad["key"], "--json"], cwd=tmp_path, env=env)
    (row,) = json.loads(shown.stdout)["deliveries"]
    assert (row["key"], row["state"], row["reason"]) == (bad["key"], "dead", "rejected")
    assert row["markdown"] == bad["markdown_path"]

    # As for outbox show: no such record is exit 1, named by the prefix it was given.
    missing = run_cli(["dead", "show", "0" * 64], cwd=tmp_path, env=env)
    assert (missing.returncode, missing.stdout) == (1, b"")
    assert missing.stderr == f"outbox: no record with a key starting {'0' * 64}\n".encode()
    unnamed = run_cli(["dead", "retry"], cwd=tmp_path, env=env)
    assert unnamed.returncode == 2 and b"name the keys" in unnamed.stderr

    not_dead = run_cli(["dead", "discard", good["key"], "--json"], cwd=tmp_path, env=env)
    assert json.loads(not_dead.stdout) == {"discarded": 0}
    retried = run_cli(["dead", "retry", bad["key"]], cwd=tmp_path, env=env)
    assert retried.stdout == b"requeued 1 dead letter(s)\n"
    status = json.loads(run_cli(["status", "--json"], cwd=tmp_path, env=env).stdout)
    assert status["sinks"][FAULTY]["pending"] == 1 and status["dead_letters"] == 0
    assert run_cli(["dead", "list"], cwd=tmp_path, env=env).stdout == b"no dead letters\n"


def test_an_empty_key_list_changes_no_dead_letter(
    outbox: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store reads "no keys" as "every key"; the façade must not pass that on."""
    monkeypatch.setenv("OUTBOX_FAULTY_REJECT", "POISON")
    receipt = outbox.add("a POISON memory the sink refuses")
    outbox.drain(timeout=30)
    assert [row.key for row in outbox.dead.list()] == [receipt.key]
    assert outbox.dead.retry([]) == 0 and outbox.dead.discard([]) == 0
    assert outbox.dead.list(sink="another-sink") == []
    assert outbox.dead.discard(sink="another-sink") == 0
    assert outbox.dead.discard() == 1
    (row,) = outbox.deliveries_of([receipt.key])[receipt.key]
    assert row.state == "discarded"
    assert outbox.markdown_path(receipt.key) == receipt.markdown_path
    assert outbox.markdown_path("0" * 64) is None
