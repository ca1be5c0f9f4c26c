"""Unix manners of the command line (issue 22, point 5): a closed pipe ends quietly, a summary
is printed once, and ``verify --repair`` says what it restored."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outbox.core.naming import key_prefix
from tests.conftest import FAULTY
from tests.helpers.subproc import child_env, run_cli


@pytest.fixture
def env() -> dict[str, str]:
    return child_env()


def add(cwd: Path, env: dict[str, str], text: str) -> dict[str, str]:
    done = run_cli(["add", "-", "--json"], cwd=cwd, env=env, stdin=text.encode())
    assert done.returncode == 0, done.stderr
    payload: dict[str, str] = json.loads(done.stdout)
    return payload


def test_export_into_a_closed_pipe_ends_quietly_with_the_sigpipe_status(
    tmp_path: Path, env: dict[str, str]
) -> None:
    # Far more than a pipe buffers (64 KiB) once `head` has gone: the writes must meet EPIPE.
    for number in range(6):
        add(tmp_path, env, f"memory {number} " + "many words " * 6000)
    err = tmp_path / "export.err"
    pipeline = f'"{sys.executable}" -m outbox export 2>"{err}" | head -1; echo "${{PIPESTATUS[0]}}"'
    done = subprocess.run(
        ["bash", "-c", pipeline], cwd=tmp_path, env=env, capture_output=True, timeout=120
    )
    first, status = done.stdout.decode().splitlines()
    assert json.loads(first)["event"] == "accepted"
    assert status == "141"  # as `yes | head -1`: the shell's status for SIGPIPE
    assert err.read_bytes() == b""


def test_drain_prints_its_summary_once_on_stdout(tmp_path: Path, env: dict[str, str]) -> None:
    for number in range(3):
        add(tmp_path, env, f"a memory to deliver, number {number}")
    summary = [f"{FAULTY}: delivered 3; now pending 0, leased 0, dead 0", "all delivered"]
    drained = run_cli(["drain", "-q"], cwd=tmp_path, env=env)
    assert drained.returncode == 0
    assert drained.stdout.decode().splitlines() == summary
    assert drained.stderr == b""

    add(tmp_path, env, "one more memory to deliver")
    again = run_cli(["drain"], cwd=tmp_path, env=env)  # not -q: still nothing on stderr
    assert again.returncode == 0
    assert again.stdout.decode().count("delivered 1;") == 1
    assert again.stderr == b""


def test_verify_repair_lists_what_it_restored_by_key_prefix(
    tmp_path: Path, env: dict[str, str]
) -> None:
    edited = add(tmp_path, env, "the quokka memory whose file gets edited")
    deleted = add(tmp_path, env, "the narwhal memory whose file gets deleted")
    add(tmp_path, env, "the memory nobody touches")
    edited_file = Path(edited["markdown_path"])
    edited_file.write_bytes(edited_file.read_bytes() + b"\nan axolotl added by hand")
    Path(deleted["markdown_path"]).unlink()

    done = run_cli(["verify", "--repair"], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().splitlines() == [
        f"restored edited markdown bodies: 1 ({key_prefix(edited['key'])})",
        f"restored missing markdown files: 1 ({key_prefix(deleted['key'])})",
        "OK: 3 records, 3 JSONL lines, 3 markdown files",
    ]
    for private in (
        b"quokka",
        b"narwhal",
        b"axolotl",
        Path(deleted["markdown_path"]).stem.encode(),
    ):
        assert private not in done.stdout + done.stderr
    assert (
        Path(deleted["markdown_path"])
        .read_bytes()
        .endswith(b"---\nthe narwhal memory whose file gets deleted")
    )

    again = run_cli(["verify", "--repair", "--json"], cwd=tmp_path, env=env)
    payload = json.loads(again.stdout)
    assert (payload["ok"], payload["restored"]) == (True, {})
    plain = run_cli(["verify"], cwd=tmp_path, env=env)
    assert plain.stdout.decode().splitlines() == ["OK: 3 records, 3 JSONL lines, 3 markdown files"]
