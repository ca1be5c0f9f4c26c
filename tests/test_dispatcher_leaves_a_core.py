"""A dispatcher leaves the writers their core: ``outbox run`` lowers its own CPU priority
(``OUTBOX_RUN_NICE``) and the embedder runs on every core but one (``OUTBOX_EMBED_THREADS``).

Both are read back from what the kernel and onnxruntime hold: the nice value of a real
``outbox run`` process and of each of its threads from ``/proc``, and the thread count in the
ONNX session's own options.
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


def run_and_read_nice(tmp_path: Path, **settings: str) -> list[int]:
    """Start ``outbox run``, wait until it serves, and return the nice value of each thread."""
    env = child_env(tmp_path / ".outbox", markdown_dir=str(tmp_path / "md"), **settings)
    log = tmp_path / "run.log"
    with log.open("wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "outbox", "-v", "run"], cwd=tmp_path, env=env, stderr=stderr
        )
    try:
        deadline = time.monotonic() + 60
        while b"running" not in log.read_bytes():
            assert child.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        tasks = [int(name) for name in os.listdir(f"/proc/{child.pid}/task")]
        values = [nice_of(child.pid, task) for task in tasks]
        assert nice_of(child.pid) in values
    finally:
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == 0, log.read_text()
    return values


def test_outbox_run_lowers_its_own_priority_by_default(tmp_path: Path) -> None:
    mine = os.nice(0)
    values = run_and_read_nice(tmp_path)
    assert set(values) == {min(19, mine + 10)}, values  # every thread, started after it


def test_the_nice_setting_reaches_the_process(tmp_path: Path) -> None:
    mine = os.nice(0)
    assert set(run_and_read_nice(tmp_path, run_nice="3")) == {min(19, mine + 3)}
    assert set(run_and_read_nice(tmp_path, run_nice="0")) == {mine}


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
