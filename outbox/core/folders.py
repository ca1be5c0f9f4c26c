"""Folders the library creates: owner-only (0700), every missing parent included.

``Path.mkdir(parents=True, mode=0o700)`` gives the parents the umask's mode, not the one
asked for, so a JSONL log or database placed in a new folder tree outside ``OUTBOX_HOME``
would sit under world-readable folders.
"""

from __future__ import annotations

import contextlib
from pathlib import Path


def ensure_private_dir(folder: Path) -> None:
    """Create ``folder`` and every missing parent with mode 0700; existing ones keep theirs."""
    if folder.is_dir():
        return
    missing = [folder]
    while not missing[-1].parent.exists() and missing[-1].parent != missing[-1]:
        missing.append(missing[-1].parent)
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
