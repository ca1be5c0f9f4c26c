"""``outbox forget``: the record leaves the database, every sink and both mirrors, and the
audit trail still proves itself. Real files, real Chroma, real processes and SIGKILL."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from outbox import Outbox, load_settings
from outbox.core.record import Record
from outbox.memory_core import MemoryService
from outbox.mirror.forget import forgotten_event
from outbox.mirror.jsonl import line_hash
from outbox.testing.conformance import make_due
from outbox.testing.sinks import FaultySink
from tests.conftest import FAULTY
from tests.helpers.subproc import child_env, run_cli
from tests.sinks.chroma_support import stored_copies

SECRET = "The vault combination is marmalade-quokka-bilberry, told to nobody else."
WORDS = (b"marmalade", b"quokka", b"bilberry")  # none a key or timestamp can spell
OTHERS = [
    "The deploy pipeline waits for the database migration before web workers start.",
    "Alice prefers short answers with the code first and the explanation after.",
    "We chose SQLite in WAL mode with synchronous FULL for the outbox database.",
]
HELPER = Path(__file__).parent / "helpers" / "forgetter.py"


def outbox_files(*roots: Path, skip: tuple[Path, ...] = ()) -> list[Path]:
    """Every regular file under ``roots`` (the outbox's own: database, WAL, log, markdown,
    fallback); a socket (the shared Chroma server's) holds no bytes to search."""
    found = []
    for root in roots:
        for folder, _, names in os.walk(root):
            if any(Path(folder).is_relative_to(s) for s in skip):
                continue
            found.extend(path for name in names if (path := Path(folder) / name).is_file())
    return found


def holding(files: list[Path], words: tuple[bytes, ...]) -> list[str]:
    return [
        f"{path.name}: {word!r}" for path in files for word in words if word in path.read_bytes()
    ]


def _held(key: str) -> Record:
    """A record standing for ``key`` (the harness looks a document up by its key only)."""
    return Record(key, "", "", 5, (), {}, "")


def key_of(result: subprocess.CompletedProcess[bytes]) -> str:
    assert result.returncode == 0, result.stderr
    return str(json.loads(result.stdout)["key"])


def test_forget_through_the_cli_reaches_every_copy(tmp_path: Path) -> None:
    """Chroma and a second sink hold it, the search index and WAL held it: afterwards none
    of the outbox's files does, both sinks deleted it, and verify passes."""
    home, md = tmp_path / ".outbox", tmp_path / "docs.local" / "decisions"
    env = child_env(home, sinks=f"chroma,{FAULTY}", faulty_db=str(tmp_path / "sink" / "faulty.db"))
    secret = key_of(run_cli(["add", SECRET, "--tag", "vault", "--json"], cwd=tmp_path, env=env))
    kept = [key_of(run_cli(["add", text, "--json"], cwd=tmp_path, env=env)) for text in OTHERS]
    assert (
        run_cli(["drain", "--timeout", "300"], cwd=tmp_path, env=env, timeout=400).returncode == 0
    )
    files = outbox_files(home, md, skip=(home / "chroma",))
    assert holding(files, WORDS), "control: before the forget the files do hold the words"

    forgot = run_cli(["forget", secret[:10], "--json"], cwd=tmp_path, env=env)
    assert forgot.returncode == 0, forgot.stderr
    answer = json.loads(forgot.stdout)
    assert (answer["key"], answer["status"]) == (secret, "forgotten")
    assert answer["deletes_queued"] == sorted(["chroma", FAULTY])
    assert answer["database_purged"] is True
    assert holding(outbox_files(home, md, skip=(home / "chroma",)), WORDS) == []

    drained = run_cli(["drain", "--timeout", "300"], cwd=tmp_path, env=env, timeout=400)
    assert drained.returncode == 0 and drained.stdout.count(b"deleted 1") == 2, drained.stdout
    settings = load_settings(env=env, home=home)
    copies = {key: stored_copies(settings, _held(key)) for key in [secret, *kept]}
    assert copies == {secret: 0, **dict.fromkeys(kept, 1)}, "read with Chroma's own client"
    assert secret not in FaultySink(tmp_path / "sink" / "faulty.db").stored()
    assert run_cli(["verify"], cwd=tmp_path, env=env).returncode == 0
    shown = run_cli(["show", secret[:10]], cwd=tmp_path, env=env)
    assert b"forgotten" in shown.stdout and b"marmalade" not in shown.stdout
    exported = run_cli(["export"], cwd=tmp_path, env=env).stdout
    assert secret.encode() not in exported and b"marmalade" not in exported
    found = run_cli(["search", "marmalade quokka", "--json"], cwd=tmp_path, env=env)
    assert secret not in found.stdout.decode()
    log = [json.loads(line) for line in (home / "outbox.jsonl").read_text().splitlines()]
    events = [(e["event"], e.get("sink")) for e in log if e["key"] == secret]
    assert events[0] == ("accepted", None) and ("forgotten", None) in events
    assert {("deleted", "chroma"), ("deleted", FAULTY)} <= set(events)


def test_unknown_and_ambiguous_keys_are_one_line_errors(tmp_path: Path) -> None:
    env = child_env(tmp_path / ".outbox")
    keys = [  # 17 keys over 16 first digits: at least two share one
        key_of(run_cli(["add", f"{OTHERS[0]} {number}", "--json"], cwd=tmp_path, env=env))
        for number in range(17)
    ]
    shared = next(digit for digit in "0123456789abcdef" if sum(k[0] == digit for k in keys) > 1)
    ambiguous = run_cli(["forget", shared], cwd=tmp_path, env=env)
    assert ambiguous.returncode == 2 and b"matches several records" in ambiguous.stderr
    unknown = run_cli(["forget", "f" * 40], cwd=tmp_path, env=env)
    assert unknown.returncode == 1 and unknown.stderr.count(b"\n") == 1
    not_hex = run_cli(["forget", "xyz"], cwd=tmp_path, env=env)
    assert not_hex.returncode == 2 and b"key" in not_hex.stderr
    with Outbox.open(load_settings(env=env, home=tmp_path / ".outbox")) as ob:
        assert not any(item.forgotten for item in ob.storage.records.iter_records())


def test_a_failing_delete_is_retried_until_done(tmp_path: Path) -> None:
    home = tmp_path / ".outbox"
    sink_db = tmp_path / "sink.db"
    env = child_env(home, faulty_db=str(sink_db))
    key = key_of(run_cli(["add", SECRET, "--json"], cwd=tmp_path, env=env))
    assert run_cli(["drain"], cwd=tmp_path, env=env).returncode == 0
    assert run_cli(["forget", key], cwd=tmp_path, env=env).returncode == 0
    failing = {**env, "OUTBOX_FAULTY_FAIL_RATE": "1"}
    assert run_cli(["drain", "--timeout", "3"], cwd=tmp_path, env=failing).returncode == 1
    with Outbox.open(load_settings(env=env, home=home)) as ob:
        (row,) = ob.deliveries_of([key])[key]
        assert (row.op, row.state, row.attempts, row.error_class) == (
            "delete",
            "pending",
            1,
            "transport_closed",
        )
        assert key in FaultySink(sink_db).stored()
        make_due(ob)  # skip the backoff wait
    assert run_cli(["drain", "--timeout", "30"], cwd=tmp_path, env=env).returncode == 0
    with Outbox.open(load_settings(env=env, home=home)) as ob:
        assert ob.deliveries_of([key])[key][0].state == "forgotten"
    assert key not in FaultySink(sink_db).stored()
    assert run_cli(["verify"], cwd=tmp_path, env=env).returncode == 0


def test_a_running_dispatcher_deletes_within_one_poll(tmp_path: Path) -> None:
    home, sink_db = tmp_path / ".outbox", tmp_path / "sink.db"
    env = child_env(home, faulty_db=str(sink_db), poll_interval="1.0")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "outbox", "run"], cwd=tmp_path, env=env, stderr=subprocess.PIPE
    )
    try:
        key = key_of(run_cli(["add", SECRET, "--json"], cwd=tmp_path, env=env))
        deadline = time.monotonic() + 60
        while key not in FaultySink(sink_db).stored():
            assert time.monotonic() < deadline, "never delivered"
            time.sleep(0.05)
        assert run_cli(["forget", key[:12]], cwd=tmp_path, env=env).returncode == 0
        started = time.monotonic()
        while key in FaultySink(sink_db).stored():
            assert time.monotonic() - started < 30, "the delete never came"
            time.sleep(0.02)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
    assert daemon.returncode == 0
    assert run_cli(["verify"], cwd=tmp_path, env=env).returncode == 0


def test_sigkill_in_the_middle_of_forgets_loses_no_redaction(tmp_path: Path) -> None:
    """Killed at random moments while forgetting: the next open finishes every forget it
    had committed, no forgotten content is left in any outbox file, and verify passes."""
    home, md = tmp_path / ".outbox", tmp_path / "docs.local" / "decisions"
    env = child_env(home, faulty_db=str(tmp_path / "sink.db"))
    rng = random.Random(7)
    answered: list[str] = []
    words: dict[str, bytes] = {}
    for round_number in range(4):
        child = subprocess.Popen(
            [sys.executable, str(HELPER), "12", str(round_number)],
            cwd=tmp_path,
            env={**env, "PYTHONPATH": str(Path(__file__).parents[1])},
            stdout=subprocess.PIPE,
        )
        assert child.stdout is not None
        while (line := child.stdout.readline().split()) != [b"ready"]:
            words[line[0].decode()] = line[1]
        for _ in range(rng.randrange(0, 6)):
            answered.append(child.stdout.readline().decode().strip())
        time.sleep(rng.random() * 0.01)
        child.kill()
        child.wait()
    with Outbox.open(load_settings(env=env, home=home)) as ob:
        gone = {i.record.key for i in ob.storage.records.iter_records() if i.forgotten}
        report = ob.verify()
        assert report.ok, report.problems
    assert gone >= set(answered) and len(answered) > 0
    files = outbox_files(home, md)
    assert holding(files, tuple(words[key] for key in gone)) == []
    kept = tuple(word for key, word in words.items() if key not in gone)
    assert len(holding(files, kept)) >= len(kept), "control: live records keep their words"
    assert run_cli(["verify"], cwd=tmp_path, env=env).returncode == 0


def test_a_forget_cut_off_after_its_commit_is_finished_at_the_next_open(
    tmp_path: Path,
) -> None:
    """The two states a kill can leave (committed only; evidence line written, the line not
    yet redacted) are each finished by the next open, exactly once."""
    settings = load_settings(env={}, home=tmp_path / ".outbox", sinks=FAULTY)
    with Outbox.open(settings) as ob:
        first = ob.add(SECRET).key
        second = ob.add(OTHERS[0] + " marmalade").key
        assert ob.wait_mirrored(10)  # the files the mirror writer writes after the commit
        path = ob.markdown_path(first)
        assert path is not None and path.exists()
        ob.storage.forgetting.forget(first, settings.sinks)  # killed right after the commit
        # The second: its forgotten line is written, then the kill, before the overwrite.
        ob.storage.forgetting.forget(second, settings.sinks)
        log = ob.mirrors.jsonl
        (line,) = [ln for ln in log.lines() if ln.event.get("key") == second]
        log.append([forgotten_event(second, line.offset, line_hash(line.raw))])
    assert b"marmalade" in (tmp_path / ".outbox" / "outbox.jsonl").read_bytes()
    with Outbox.open(settings) as ob:
        assert not path.exists()
        assert ob.verify().ok, ob.verify().problems
        lines = [ln.event for ln in ob.mirrors.jsonl.lines()]
    assert b"marmalade" not in (tmp_path / ".outbox" / "outbox.jsonl").read_bytes()
    assert [e["event"] for e in lines if e["key"] == second].count("forgotten") == 1
    assert [e["event"] for e in lines if e["key"] == first].count("forgotten") == 1


def test_verify_catches_a_redacted_line_put_back_or_edited(tmp_path: Path) -> None:
    settings = load_settings(env={}, home=tmp_path / ".outbox", sinks=FAULTY)
    with Outbox.open(settings) as ob:
        key = ob.add(SECRET).key
        ob.add(OTHERS[1])
        ob.forget(key)
        assert ob.verify().ok
    path = tmp_path / ".outbox" / "outbox.jsonl"
    data = path.read_bytes()
    start = data.index(b'"content":""')
    # Same length: the importance digit changed inside the redacted line.
    edited = data.replace(b'"importance":5', b'"importance":6', 1)
    assert edited != data and edited.index(b'"importance":6') < data.index(b"\n", start)
    path.write_bytes(edited)
    with Outbox.open(settings, repair=False) as ob:
        problems = ob.verify().problems
    assert any("importance" in p or "chain" in p for p in problems), problems


class _LegacySink:
    """A custom sink from before forget existed: it can deliver, not delete."""

    name = "tests.test_forget:_LegacySink"
    semantic = False

    def __init__(self, _settings: Any = None) -> None:
        pass

    def deliver(self, batch: list[Any]) -> list[Any]:
        from outbox.sinks.base import Delivered

        return [Delivered(record.key) for record in batch]

    def close(self) -> None:
        pass


def test_a_sink_without_delete_turns_the_forget_into_a_dead_letter_that_says_so(
    tmp_path: Path,
) -> None:
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", sinks="tests.test_forget:_LegacySink"
    )
    with Outbox.open(settings) as ob:
        key = ob.add(SECRET).key
        assert ob.drain(timeout=30).ok
        ob.forget(key)
        assert not ob.drain(timeout=30).ok
        (row,) = ob.deliveries_of([key])[key]
        assert (row.op, row.state, row.error_class) == ("delete", "dead", "rejected")
        assert row.last_error is not None and "has no delete" in row.last_error
        assert ob.verify().ok


def test_recall_stops_finding_it_before_the_sink_delete_lands(tmp_path: Path) -> None:
    settings = load_settings(env={}, home=tmp_path / ".outbox", sinks=FAULTY)
    service = MemoryService(Outbox.open(settings))
    try:
        receipt = service.outbox.add(SECRET, metadata={"session_id": "s"})
        service.outbox.add(OTHERS[2], metadata={"session_id": "s"})
        found = service.query_raw_memories("marmalade quokka", min_relevance=0.0)
        assert [r["id"] for r in found["results"]][:1] == [receipt.key]
        answer = service.forget(receipt.key[:8])
        assert answer["status"] == "forgotten"
        again = service.query_raw_memories("marmalade quokka", min_relevance=0.0)
        assert receipt.key not in [r["id"] for r in again["results"]]
        recent = service.query_recent_turns(session_id="s")
        assert receipt.key not in json.dumps(recent)
    finally:
        service.close()


async def _forget_over_mcp(tmp_path: Path) -> tuple[Any, Any, Any]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "outbox", "mcp"],
        env={
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(tmp_path),
            "OUTBOX_HOME": str(tmp_path / ".outbox"),
            "OUTBOX_SINKS": FAULTY,
        },
        cwd=str(tmp_path),
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await asyncio.wait_for(session.initialize(), 30)
        added = await session.call_tool(
            "add_memory", {"prompt": "What is the vault code?", "thought": "-", "response": SECRET}
        )
        key = added.structured_content["id"]
        forgot = await session.call_tool("forget_memory", {"id": key[:12]})
        bad = await session.call_tool("forget_memory", {"id": key[:12], "key": "x"})
        return key, forgot, bad


def test_forget_memory_over_mcp(tmp_path: Path) -> None:
    key, forgot, bad = asyncio.run(_forget_over_mcp(tmp_path))
    assert not forgot.is_error and forgot.structured_content["key"] == key
    assert forgot.structured_content["status"] == "forgotten"
    assert bad.is_error and "key" in bad.content[0].text
    settings = load_settings(env={}, home=tmp_path / ".outbox", sinks=FAULTY)
    with Outbox.open(settings) as ob:
        item = ob.storage.records.get_record(key)
        assert item is not None and item.forgotten
        assert ob.verify().ok
    assert b"marmalade" not in (tmp_path / ".outbox" / "outbox.jsonl").read_bytes()


@pytest.mark.postgres
def test_forget_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    settings = load_settings(env={}, home=tmp_path / ".outbox", sinks=FAULTY, db_url=pg_url)
    with Outbox.open(settings) as ob:
        key = ob.add(SECRET).key
        assert ob.drain(timeout=30).ok
        receipt = ob.forget(key)
        assert receipt.sinks == [FAULTY]
        assert ob.forgetter.purge().complete
        assert ob.drain(timeout=30).ok
        assert ob.deliveries_of([key])[key][0].state == "forgotten"
        assert ob.verify().ok
        found = ob.lexical_matches("marmalade", limit=5)
        assert key not in [hit for hit, _ in found.hits]


def test_forgets_find_their_line_anywhere_in_a_long_log(tmp_path: Path) -> None:
    """The accepted line is found by halving the log on seq, and by a full search when a
    repair appended it out of order (its line lost, then restored at the end)."""
    settings = load_settings(env={}, home=tmp_path / ".outbox", sinks=FAULTY)
    texts = [f"{OTHERS[number % 3]} entry {number} " + "padding " * 40 for number in range(600)]
    with Outbox.open(settings) as ob:
        keys = [receipt.key for receipt in ob.add_many(texts)]
        assert ob.wait_mirrored(30)
    log = tmp_path / ".outbox" / "outbox.jsonl"
    assert log.stat().st_size > 4 * 65_536
    # The line of one record near the start is lost; the next open appends it at the end.
    moved = keys[3]
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b"".join(line for line in lines if moved.encode() not in line))
    chosen = [keys[0], keys[299], keys[300], keys[-1], moved, *random.Random(3).sample(keys, 8)]
    with Outbox.open(settings) as ob:
        for key in dict.fromkeys(chosen):
            ob.forget(key)
    events = [json.loads(line) for line in log.read_bytes().splitlines()]
    for key in dict.fromkeys(chosen):
        (accepted,) = [e for e in events if e["key"] == key and e["event"] == "accepted"]
        assert accepted["content"] == "" and accepted["markdown"] == ""
    with Outbox.open(settings, repair=False) as ob:
        report = ob.verify()
    assert not any("does not match its key" in p or "differ" in p for p in report.problems)
