"""Run a Python snippet as another local user: the attacker of the privacy tests.

``as_other_user(code, *args)`` runs ``code`` with ``/usr/bin/python3 -I`` (stdlib only: the
project's venv may sit where that user cannot read) as user ``nobody`` (uid 65534), with no
supplementary groups, through ``setpriv``; ``sys.argv[1:]`` are ``args``. It returns the
finished process (stdout, stderr, returncode as text). ``needs_other_user`` is a pytest mark
that skips, with the reason shown, when this process cannot switch users (not root, or no
setpriv or python3), except under ``OUTBOX_REQUIRE_OTHER_USER=1`` (CI), where it fails.

Paths handed to the snippet must be traversable by that user for the attack to reach the
file it tries: ``reachable()`` makes a new folder below /tmp whose own bits let anyone
through, so a refusal comes from the store's files and not from the test's private
temporary folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

OTHER_UID = 65534
PYTHON = "/usr/bin/python3"


def why_not() -> str | None:
    """Why another user cannot be used here, or None when it can."""
    if os.geteuid() != 0:
        return "switching to another user needs root (CI runs the tests as root)"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    if not os.access(PYTHON, os.X_OK):
        return f"{PYTHON} is missing"
    return None


# CI (.ci/run) sets OUTBOX_REQUIRE_OTHER_USER=1: there the test runs and fails instead.
needs_other_user = pytest.mark.skipif(
    why_not() is not None and os.environ.get("OUTBOX_REQUIRE_OTHER_USER") != "1",
    reason=f"no second local user: {why_not()}",
)


def as_other_user(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as uid/gid 65534 and wait for it."""
    problem = why_not()
    if problem is not None:
        raise RuntimeError(f"cannot run as another user: {problem}")
    command = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
    command += ["--", PYTHON, "-I", "-c", code, *args]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
    )


def reachable() -> Path:
    """A new folder below the system's temporary folder that other users may traverse (0711),
    for a store an attack must be able to reach up to the store's own files."""
    folder = Path(tempfile.mkdtemp(prefix="outbox-privacy-", dir="/tmp"))
    folder.chmod(0o711)
    return folder
