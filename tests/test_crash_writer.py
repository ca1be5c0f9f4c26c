"""A real writer process killed with SIGKILL at random moments, many times over: every key
whose ``add`` returned survives, and reopening leaves both mirrors complete and exact."""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from outbox import Outbox, Settings
from tests.helpers.subproc import WRITER, child_env

ROUNDS = 25


def run_until_killed(env: dict[str, str], cwd: Path, seed: int, rng: random.Random) -> list[str]:
    """Start the writer, let it write for a random while, SIGKILL it; the keys it printed."""
    child = subprocess.Popen(
        [sys.executable, str(WRITER), "crash", str(seed)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None
    output = b""
    selector = selectors.DefaultSelector()
    selector.register(child.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + 30
    # Wait for the first returned write, so every round kills a writer that is writing.
    while b"\n" not in output and time.monotonic() < deadline and child.poll() is None:
        if selector.select(timeout=0.1):
            output += os.read(child.stdout.fileno(), 65536)
    selector.close()
    assert b"\n" in output, child.stderr.read() if child.stderr else b""
    time.sleep(rng.uniform(0.0, 0.25))
    child.send_signal(signal.SIGKILL)
    rest, _ = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGKILL
    output += rest
    complete = output[: output.rfind(b"\n") + 1]  # a key cut mid-print did not "return"
    return complete.decode("ascii").split()


@pytest.mark.slow
def test_sigkilled_writer_loses_nothing_and_mirrors_come_back(
    settings: Settings, tmp_path: Path
) -> None:
    rng = random.Random(20261129)
    env = child_env(
        home=settings.home, markdown_dir=str(settings.markdown_dir), sinks=",".join(settings.sinks)
    )
    returned: list[str] = []
    repaired_rounds = 0
    for round_number in range(ROUNDS):
        returned += run_until_killed(env, tmp_path, round_number, rng)
        with Outbox.open(settings) as ob:
            report = ob.last_repair
            assert report is not None
            if report.torn_bytes_cut or report.lines_appended or report.files_written:
                repaired_rounds += 1
            stored = ob.storage.records.get_records(returned)
            assert set(stored) == set(returned), f"round {round_number}: a returned key is lost"
            check = ob.verify()
            assert check.ok, (round_number, check.problems)
            assert check.records == check.markdown_files == ob.storage.records.count_records()
    assert len(set(returned)) == len(returned)
    with Outbox.open(settings) as ob:
        accepted = Counter(
            str(line.event["key"])
            for line in ob.mirrors.jsonl.lines()
            if line.event.get("event") == "accepted"
        )
        assert set(accepted.values()) == {1}
        assert set(accepted) >= set(returned)
        assert len(accepted) == ob.storage.records.count_records()
        assert len(list(settings.markdown_dir.glob("*.md"))) == len(accepted)
        assert ob.mirrors.jsonl.verify_chain() == []
    # Reported for the curious; not asserted, since where a kill lands is chance.
    print(f"{len(returned)} returned keys, repair had work in {repaired_rounds}/{ROUNDS} rounds")
