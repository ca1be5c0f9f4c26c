"""Running the real ``outbox`` command and the writer script in child processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.conftest import FAULTY

REPO = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("writer.py")


def child_env(home: Path | None = None, **settings: str) -> dict[str, str]:
    """The current environment without OUTBOX_* settings, plus ``settings`` (names without
    the prefix) and the fault-injection sink, so no child ever loads a real sink."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env["OUTBOX_SINKS"] = FAULTY
    if home is not None:
        env["OUTBOX_HOME"] = str(home)
    for name, value in settings.items():
        env[f"OUTBOX_{name.upper()}"] = value
    return env


def run_cli(
    args: Sequence[str | bytes],
    *,
    cwd: Path,
    env: Mapping[str, str],
    stdin: bytes | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[bytes]:
    """``python -m outbox ARGS`` as a real process; output is kept as bytes."""
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        cwd=cwd,
        env=dict(env),
        input=stdin,
        capture_output=True,
        timeout=timeout,
        check=False,
    )
