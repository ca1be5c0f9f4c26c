"""One meaning of "records" on every command-line surface: after forgetting one of seven,
``status`` (text and ``--json``), ``verify``, ``recent`` and ``export`` all say six, and the
forgotten one is counted on its own. Real ``outbox`` processes on a real store."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.helpers.subproc import child_env, run_cli

TOTAL = 7


def _ok(result: subprocess.CompletedProcess[bytes]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout.decode()


def test_after_a_forget_every_command_counts_the_live_records(tmp_path: Path) -> None:
    env = child_env(tmp_path / ".outbox", faulty_db=str(tmp_path / "sink.db"))
    keys = [
        json.loads(_ok(run_cli(["add", f"memory number {n}", "--json"], cwd=tmp_path, env=env)))[
            "key"
        ]
        for n in range(TOTAL)
    ]
    _ok(run_cli(["drain", "--timeout", "120"], cwd=tmp_path, env=env, timeout=180))
    _ok(run_cli(["forget", keys[3][:12]], cwd=tmp_path, env=env))

    status = json.loads(_ok(run_cli(["status", "--json"], cwd=tmp_path, env=env)))
    assert status["records"] == TOTAL - 1
    assert status["forgotten"] == 1
    text = _ok(run_cli(["status"], cwd=tmp_path, env=env))
    assert text.splitlines()[0] == f"records: {TOTAL - 1} (forgotten: 1)"
    verify = json.loads(_ok(run_cli(["verify", "--json"], cwd=tmp_path, env=env)))
    assert verify["records"] == TOTAL - 1
    assert verify["forgotten"] == 1
    said = _ok(run_cli(["verify"], cwd=tmp_path, env=env))
    assert said.startswith(f"OK: {TOTAL - 1} records (1 forgotten), ")
    recent = json.loads(_ok(run_cli(["recent", "--json"], cwd=tmp_path, env=env)))
    assert len(recent["turns"]) == TOTAL - 1
    exported = _ok(run_cli(["export"], cwd=tmp_path, env=env)).splitlines()
    assert len(exported) == TOTAL - 1
