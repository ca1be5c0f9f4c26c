"""A dispatcher leaves the writers their core: ``outbox run`` and ``outbox drain`` lower their
own CPU priority (``OUTBOX_RUN_NICE``) and the embedder runs on every core but one
(``OUTBOX_EMBED_THREADS``).

Both are read back from what the kernel and onnxruntime hold: the nice value of a real
``outbox run`` or ``outbox drain`` process and of each of its threads from ``/proc``, and the
thread count in the ONNX session's own options.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outbox.sinks.embedding import MiniLMEmbedding, onnx_threads
from tests.helpers.subproc import child_env


def nice_of(pid: int, task: int | None = None) -> int:
    """Field 19 of ``/proc/<pid>[/task/<tid>]/stat``: the nice value the kernel holds."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    with open(path, encoding="ascii") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[16])  # fields after the name start at field 3


def read_nice_while(
    tmp_path: Path, command: str, ready: bytes, env: dict[str, str], threads: int = 1
) -> list[int]:
    """Start ``outbox -v COMMAND``, wait for ``ready`` in its log and for ``threads`` threads,
    and return the nice value of each thread; the process is stopped after."""
    log = tmp_path / f"{command}.log"
    with log.open("wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "outbox", "-v", command], cwd=tmp_path, env=env, stderr=stderr
        )
    try:
        deadline = time.monotonic() + 60
        while ready not in log.read_bytes() or len(os.listdir(f"/proc/{child.pid}/task")) < threads:
            assert child.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        tasks = [int(name) for name in os.listdir(f"/proc/{child.pid}/task")]
        values = [nice_of(child.pid, task) for task in tasks]
        assert nice_of(child.pid) in values
    finally:
        child.send_signal(signal.SIGTERM)
        code = child.wait(30)
    assert code in (0, -signal.SIGTERM), log.read_text()  # drain has no handler: SIGTERM ends it
    return values


def run_and_read_nice(tmp_path: Path, **settings: str) -> list[int]:
    """Start ``outbox run``, wait until it serves, and return the nice value of each thread."""
    env = child_env(tmp_path / ".outbox", markdown_dir=str(tmp_path / "md"), **settings)
    return read_nice_while(tmp_path, "run", b"running", env)


def drain_and_read_nice(tmp_path: Path, **settings: str) -> list[int]:
    """Start ``outbox drain`` on one record the sink takes 60 s to accept, and return the nice
    value of each of its threads while it delivers (its sink thread among them)."""
    tmp_path.mkdir(exist_ok=True)
    env = child_env(tmp_path / ".outbox", markdown_dir=str(tmp_path / "md"), **settings)
    added = subprocess.run(
        [sys.executable, "-m", "outbox", "add", "one record to deliver"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        check=False,
    )
    assert added.returncode == 0, added.stderr
    env["OUTBOX_FAULTY_HANG"] = "60"
    return read_nice_while(tmp_path, "drain", b"draining", env, threads=2)


def test_outbox_run_lowers_its_own_priority_by_default(tmp_path: Path) -> None:
    mine = os.nice(0)
    values = run_and_read_nice(tmp_path)
    assert set(values) == {min(19, mine + 10)}, values  # every thread, started after it


def test_the_nice_setting_reaches_the_process(tmp_path: Path) -> None:
    mine = os.nice(0)
    assert set(run_and_read_nice(tmp_path, run_nice="3")) == {min(19, mine + 3)}
    assert set(run_and_read_nice(tmp_path, run_nice="0")) == {mine}


def test_outbox_drain_lowers_its_own_priority_like_run(tmp_path: Path) -> None:
    """A one-off drain of a backlog embeds as hard as the daemon: without it, 300 writes beside
    a 3,000-record ``outbox drain`` had 5x their idle p99 (issue 24)."""
    mine = os.nice(0)
    assert set(drain_and_read_nice(tmp_path)) == {min(19, mine + 10)}


def test_the_nice_setting_reaches_a_drain(tmp_path: Path) -> None:
    mine = os.nice(0)
    assert set(drain_and_read_nice(tmp_path / "a", run_nice="4")) == {min(19, mine + 4)}
    assert set(drain_and_read_nice(tmp_path / "b", run_nice="0")) == {mine}


def test_a_bad_nice_setting_is_refused_by_name(tmp_path: Path) -> None:
    env = child_env(tmp_path / ".outbox", run_nice="-5")
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "run"], cwd=tmp_path, env=env, capture_output=True
    )
    assert done.returncode == 2
    assert b"OUTBOX_RUN_NICE" in done.stderr and b"0..19" in done.stderr


def session_threads(embedder: MiniLMEmbedding) -> int:
    options = embedder._session.get_session_options()
    return int(options.intra_op_num_threads)


@pytest.fixture
def no_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings resolve in an empty folder, from the environment only."""
    for name in [name for name in os.environ if name.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


@pytest.mark.usefixtures("no_store")
def test_the_embedder_uses_every_core_but_one_by_default() -> None:
    cores = len(os.sched_getaffinity(0))
    expected = max(1, min(4, cores - 1))
    assert onnx_threads() == expected
    assert session_threads(MiniLMEmbedding()) == expected
    assert MiniLMEmbedding()(["still embeds"])[0].shape == (384,)


@pytest.mark.usefixtures("no_store")
def test_the_thread_setting_reaches_the_onnx_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_EMBED_THREADS", "3")
    assert session_threads(MiniLMEmbedding()) == 3
    assert onnx_threads(2) == 2
    assert session_threads(MiniLMEmbedding(threads=1)) == 1  # an explicit count wins
