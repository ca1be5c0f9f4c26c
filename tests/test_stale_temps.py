"""A writer killed between ``write_atomic``'s temp file and its rename leaves a whole copy of
the file, 0600, beside it. ``forget`` removes the record's, ``verify`` names it by key prefix
(never by its name, which carries the memory's words) and ``verify --repair`` removes it; a
live writer's temp file is left alone. Real writers (``write_atomic`` itself, held between
its temp file and the rename), real SIGKILL, the real command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.mirror import markdown
from tests.test_forget import OTHERS, WORDS
from tests.test_forget_privacy import Store

HELPER = Path(__file__).parent / "helpers" / "held_write.py"
REPO = Path(__file__).parents[1]

# File names: any text without a separator or NUL (what a folder can hold).
names = st.text(st.characters(blacklist_characters="/\x00"), min_size=1)


@given(names, st.integers(min_value=0), st.integers(min_value=0))
def test_a_temp_name_gives_back_its_target_and_writer(target: str, pid: int, tid: int) -> None:
    assert markdown.parse_temp_name(markdown.temp_name(target, pid, tid)) == (target, pid, tid)


@given(st.text(st.sampled_from(list(".-0123456789tmpd\n٣")), max_size=24) | names)
def test_only_a_name_write_atomic_gives_parses(name: str) -> None:
    """A name that parses is exactly the name its writer used (so forget and verify never
    take a look-alike file for a temp file)."""
    temp = markdown.parse_temp_name(name)
    if temp is not None:
        assert markdown.temp_name(*temp) == name


@pytest.mark.parametrize(
    "name",
    [
        "2026-05-04-vault-note.md",
        ".2026-05-04-vault-note.md",
        ".vault.md.12-34.tmp~",
        ".vault.md.012-34.tmp",
        ".vault.md.12-034.tmp",
        ".vault.md.12.tmp",
        ".vault.md.a-34.tmp",
        ".vault.md.٣-34.tmp",
        "vault.md.12-34.tmp",
        ".vault.md.12-34.TMP",
        "..12-34.tmp",
    ],
)
def test_look_alike_names_are_no_temp_names(name: str) -> None:
    assert markdown.parse_temp_name(name) is None


class HeldWriter:
    """A real process in ``write_atomic`` of ``path`` (its own bytes again), stopped after
    its temp file is filled and fsynced, before the rename."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.child = subprocess.Popen(
            [sys.executable, str(HELPER), str(path)],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.child.stdout is not None
        assert self.child.stdout.readline() == b"held\n"
        (self.temp,) = temps_of(path)

    def kill(self) -> None:
        self.child.send_signal(signal.SIGKILL)
        self.child.wait(30)
        assert self.child.returncode == -signal.SIGKILL

    def finish(self) -> bytes:
        out, _ = self.child.communicate(timeout=30)
        assert self.child.returncode == 0
        return out


def temps_of(path: Path) -> list[Path]:
    return [
        found
        for found in path.parent.iterdir()
        if (temp := markdown.parse_temp_name(found.name)) is not None and temp.target == path.name
    ]


def file_of(store: Store, key: str) -> Path:
    (path,) = [p for p in store.md.glob("*.md") if markdown.read(p)[0].get("key") == key]
    return path


def output(done: subprocess.CompletedProcess[bytes]) -> bytes:
    return done.stdout + done.stderr


@pytest.mark.parametrize("file_kept", [True, False], ids=["file-kept", "file-gone"])
def test_forget_removes_a_killed_writers_temp_copy(tmp_path: Path, file_kept: bool) -> None:
    """The temp file of the record's file goes with the forget, whether or not the file
    itself is still there; a file that only looks like one is not touched."""
    store = Store(tmp_path)
    key = store.seed()
    path = file_of(store, key)
    writer = HeldWriter(path)
    writer.kill()
    assert writer.temp.exists() and writer.temp.stat().st_mode & 0o777 == 0o600
    assert all(word in writer.temp.read_bytes() for word in WORDS), "a whole copy"
    look_alike = path.with_name(f".{path.name}.1-2.tmp.bak")
    look_alike.write_bytes(b"a file of the owner's own")
    if not file_kept:
        path.unlink()

    forgot = store.ok("forget", key[:12])
    assert b"already" not in forgot.stdout
    assert not writer.temp.exists()
    assert store.holding() == [], "no file in the store or the markdown folder holds the words"
    assert look_alike.read_bytes() == b"a file of the owner's own"
    assert store.cli("verify").returncode == 0


def test_verify_names_a_killed_writers_temp_by_key_and_repair_removes_it(
    tmp_path: Path,
) -> None:
    """One temp file of a record's file, one of a file no record has: verify counts them,
    names the record by its key prefix and neither file by its name; --repair removes
    both and leaves the files they were to replace as they were."""
    store = Store(tmp_path)
    key = store.seed()
    path = file_of(store, key)
    before = path.read_bytes()
    notes = store.md / "2026-05-04-quokka-notes.md"
    notes.write_bytes(b"the owner's quokka notes\n")
    killed = [HeldWriter(path), HeldWriter(notes)]
    for writer in killed:
        writer.kill()

    verified = store.cli("verify")
    assert verified.returncode == 1
    said = output(verified)
    assert f"record {key[:12]}: 1 stale temporary file(s) of its markdown file".encode() in said
    assert f"1 stale temporary file(s) of no record in {store.md}".encode() in said
    for shown in (path.name, notes.name, *(w.temp.name for w in killed)):
        assert shown.encode() not in said
    assert not any(word in said for word in (*WORDS, b"quokka")), said
    problems = json.loads(store.cli("verify", "--json").stdout)["problems"]
    assert sum("stale temporary" in problem for problem in problems) == 2

    repaired = store.cli("verify", "--repair")
    assert repaired.returncode == 0, output(repaired)
    assert repaired.stdout.startswith(b"removed stale temporary files: 2\nOK: ")
    assert not any(w.temp.exists() for w in killed)
    assert path.read_bytes() == before
    assert notes.read_bytes() == b"the owner's quokka notes\n"
    assert store.ok("verify").returncode == 0


def test_a_live_writers_temp_is_left_alone(tmp_path: Path) -> None:
    """A writer still between its temp file and the rename (a fallback write does so outside
    the mirror lock): verify reports nothing, --repair leaves it, and the writer then
    finishes its write."""
    store = Store(tmp_path)
    store.ok("add", OTHERS[0])
    notes = store.md / "2026-05-04-in-flight.md"
    notes.write_bytes(b"a write in flight\n")
    writer = HeldWriter(notes)
    try:
        assert store.cli("verify").returncode == 0
        repaired = json.loads(store.ok("verify", "--repair", "--json").stdout)
        assert repaired["temps_removed"] == 0 and repaired["problems"] == []
        assert writer.temp.exists()
    finally:
        assert writer.finish() == b"written\n"
    assert not writer.temp.exists()
    assert notes.read_bytes() == b"a write in flight\n"


def test_a_temp_older_than_an_hour_is_stale_though_its_pid_runs(tmp_path: Path) -> None:
    """Pids are reused: an hour-old temp file whose pid runs belongs to a writer long gone
    (no write holds its temp file for more than moments)."""
    temp = tmp_path / markdown.temp_name("2026-05-04-note.md", os.getpid(), 7)
    temp.write_bytes(b"copy")
    assert markdown.stale_temps(tmp_path) == []
    hour_ago = time.time() - markdown.STALE_TEMP_AGE - 60
    os.utime(temp, (hour_ago, hour_ago))
    assert markdown.stale_temps(tmp_path) == [("2026-05-04-note.md", os.getpid(), 7)]
