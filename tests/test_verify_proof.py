"""verify proves agreement without writing, sees every field the database knows, runs the
database's own check; verify --repair restores what the database can vouch for; a delivery
never seals a cut-off or edited body in. Driven through the CLI and the files it leaves."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest

from outbox import Outbox, load_settings
from tests.helpers.checks import front_matter
from tests.helpers.subproc import child_env, run_cli


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return child_env(tmp_path / ".outbox", faulty_db=str(tmp_path / "faulty.db"))


def log_path(tmp_path: Path) -> Path:
    return tmp_path / ".outbox" / "outbox.jsonl"


def delivered_store(tmp_path: Path, env: dict[str, str], count: int = 3) -> list[str]:
    keys = []
    for number in range(count):
        added = run_cli(
            ["add", f"memory {number} for the audit trail", "--json"], cwd=tmp_path, env=env
        )
        assert added.returncode == 0, added.stderr
        keys.append(json.loads(added.stdout)["key"])
    drained = run_cli(["drain", "--timeout", "60"], cwd=tmp_path, env=env)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert run_cli(["verify"], cwd=tmp_path, env=env).returncode == 0
    return keys


def verify(tmp_path: Path, env: dict[str, str], *extra: str) -> tuple[int, list[str]]:
    result = run_cli(["verify", "--json", *extra], cwd=tmp_path, env=env)
    return result.returncode, json.loads(result.stdout)["problems"]


def rewrite_last_line(path: Path, change: dict[str, object]) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    last = json.loads(lines[-1])
    last.update(change)
    lines[-1] = json.dumps(last).encode() + b"\n"
    path.write_bytes(b"".join(lines))


def test_an_edited_sink_id_in_the_last_line_is_found(tmp_path: Path, env: dict[str, str]) -> None:
    delivered_store(tmp_path, env)
    log = log_path(tmp_path)
    assert json.loads(log.read_bytes().splitlines()[-1])["event"] == "delivered"
    rewrite_last_line(log, {"sink_id": "forged-id"})
    code, problems = verify(tmp_path, env)
    assert code == 1
    assert any("no matching delivered line" in p for p in problems)


def test_an_edited_metadata_field_in_the_last_accepted_line_is_found(
    tmp_path: Path, env: dict[str, str]
) -> None:
    added = run_cli(["add", "the only memory", "--json"], cwd=tmp_path, env=env)
    assert added.returncode == 0
    rewrite_last_line(log_path(tmp_path), {"markdown": "elsewhere.md", "metadata": {"x": 1}})
    code, problems = verify(tmp_path, env)
    assert code == 1
    assert any("metadata, markdown" in p for p in problems)


def test_lost_delivered_lines_are_found_then_restored_by_repair(
    tmp_path: Path, env: dict[str, str]
) -> None:
    keys = delivered_store(tmp_path, env)
    log = log_path(tmp_path)
    lines = log.read_bytes().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["event"] != "delivered"]
    log.write_bytes(b"".join(kept))  # the tail of delivered lines is lost
    before = log.read_bytes()

    code, problems = verify(tmp_path, env)
    assert code == 1
    assert sum("no matching delivered line" in p for p in problems) == len(keys)
    assert log.read_bytes() == before, "a plain verify must not write"

    code, problems = verify(tmp_path, env, "--repair")
    assert (code, problems) == (0, [])
    events = [json.loads(line) for line in log.read_bytes().splitlines()]
    assert sorted(e["key"] for e in events if e["event"] == "delivered") == sorted(keys)


def test_an_edited_body_is_restored_by_repair(tmp_path: Path, env: dict[str, str]) -> None:
    added = run_cli(["add", "the body as it was written", "--json"], cwd=tmp_path, env=env)
    path = Path(json.loads(added.stdout)["markdown_path"])
    if not path.is_absolute():
        path = tmp_path / path
    path.write_bytes(path.read_bytes().replace(b"as it was written", b"as someone edited it"))
    code, problems = verify(tmp_path, env)
    assert code == 1 and any("body of its markdown file differs" in p for p in problems)
    code, problems = verify(tmp_path, env, "--repair")
    assert (code, problems) == (0, [])
    assert path.read_bytes().endswith(b"\n---\nthe body as it was written")


def test_a_body_cut_off_mid_file_is_restored_before_delivery_rewrites_it(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """As when a writer dies half-way through its file while a dispatcher is up: the
    delivery's front-matter update restores the body instead of sealing the cut in."""
    text = "a memory whose file was cut off in the middle of its body"
    added = run_cli(["add", text, "--json"], cwd=tmp_path, env=env)
    path = Path(json.loads(added.stdout)["markdown_path"])
    if not path.is_absolute():
        path = tmp_path / path
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) - 20])
    drained = run_cli(["drain", "--timeout", "60"], cwd=tmp_path, env=env)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    assert path.read_bytes().endswith(text.encode())
    assert b"delivered" in path.read_bytes()  # the delivery's front matter is there too
    code, problems = verify(tmp_path, env)
    assert (code, problems) == (0, [])


def test_a_damaged_database_page_fails_verify(tmp_path: Path, env: dict[str, str]) -> None:
    delivered_store(tmp_path, env, count=40)
    database = tmp_path / ".outbox" / "outbox.db"
    with sqlite3.connect(database) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'records'").fetchone()[
            0
        ]
    data = bytearray(database.read_bytes())
    start = (root - 1) * page
    data[start : start + 8] = b"\xff" * 8  # the page header of the records table
    database.write_bytes(bytes(data))
    result = run_cli(["verify", "--json"], cwd=tmp_path, env=env)
    assert result.returncode == 1
    problems = json.loads(result.stdout)["problems"]
    assert problems and all(p.startswith("database") for p in problems[:1])


def test_a_line_lost_in_the_middle_is_reanchored_never_rewritten(
    tmp_path: Path, env: dict[str, str]
) -> None:
    keys = delivered_store(tmp_path, env)
    path = log_path(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    # The first record's delivered line, between other lines: lost (a bad sector, an edit).
    lost = next(
        number
        for number, line in enumerate(lines)
        if json.loads(line)["event"] == "delivered" and json.loads(line)["key"] == keys[0]
    )
    assert 0 < lost < len(lines) - 1
    path.write_bytes(b"".join(lines[:lost] + lines[lost + 1 :]))
    code, problems = verify(tmp_path, env)
    assert code == 1
    assert any("does not chain" in p for p in problems)
    assert any(keys[0][:12] in p and "delivered" in p for p in problems)
    before = path.read_bytes()
    code, problems = verify(tmp_path, env, "--repair")
    assert (code, problems) == (0, [])
    after = path.read_bytes()
    assert after.startswith(before), "repair only appends: the history stays as it was"
    added = [json.loads(line) for line in after[len(before) :].splitlines()]
    events = [json.loads(line) for line in after.splitlines()]
    restored = [e for e in events[len(lines) - 1 :] if e["event"] == "delivered"]
    assert [e["key"] for e in restored] == [keys[0]], "the lost line came back, appended"
    (anchor,) = [e for e in added if e["event"] == "reanchored"]
    assert anchor["line"] == sum(len(line) for line in lines[:lost])
    assert anchor["found"] != anchor["expected"]
    assert verify(tmp_path, env) == (0, [])


def test_an_edited_middle_line_stays_visible_after_repair(
    tmp_path: Path, env: dict[str, str]
) -> None:
    keys = delivered_store(tmp_path, env)
    path = log_path(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    first = json.loads(lines[0])
    assert first["key"] == keys[0]
    first["importance"] = 9
    lines[0] = json.dumps(first, separators=(",", ":")).encode() + b"\n"
    path.write_bytes(b"".join(lines))
    code, problems = verify(tmp_path, env, "--repair")
    assert code == 1, "a repair never makes an edit look like history"
    assert any(keys[0][:12] in p and "importance" in p for p in problems)
    assert not any("does not chain" in p for p in problems), "the break itself is recorded"
    assert b'"event":"reanchored"' in path.read_bytes()


def test_front_matter_behind_its_deliveries_is_found_then_rewritten(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """As a power cut can leave a file whose front matter a delivery rewrote in place: the
    front matter from before the delivery, over the same body. A key added by hand stays."""
    added = run_cli(
        ["add", "a memory delivered before the power cut", "--json"], cwd=tmp_path, env=env
    )
    key = json.loads(added.stdout)["key"]
    path = Path(json.loads(added.stdout)["markdown_path"])
    if not path.is_absolute():
        path = tmp_path / path
    pending = path.read_bytes()
    drained = run_cli(["drain", "--timeout", "60"], cwd=tmp_path, env=env)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    delivered = front_matter(path)
    assert delivered["reason"] == "delivered" and delivered["sink_ids"]
    path.write_bytes(pending.replace(b"---\n", b"---\nnote: kept by hand\n", 1))

    code, problems = verify(tmp_path, env)
    assert code == 1
    (problem,) = problems
    assert problem.startswith(f"record {key[:12]}: its front matter's ")
    assert all(name in problem for name in ("reason", "sinks", "sink_ids"))

    code, problems = verify(tmp_path, env, "--repair")
    assert (code, problems) == (0, [])
    assert front_matter(path) == {"note": "kept by hand", **delivered}
    assert path.read_bytes().endswith(b"\n---\na memory delivered before the power cut")


def test_front_matter_is_not_judged_by_deliveries_retention_pruned(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """Retention deletes delivered rows and leaves the files their history: a file saying
    ``delivered`` with no row behind it is no disagreement."""
    keys = delivered_store(tmp_path, env)
    settings = load_settings(env=env)
    with Outbox.open(settings) as ob:
        assert ob.storage.deliveries.prune_delivered(settings.sinks, time.time() + 60) == len(keys)
    assert verify(tmp_path, env) == (0, [])
