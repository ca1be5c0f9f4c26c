"""One-shot exclusive locks on a store's files (one rebuild, one reindex, one Chroma start at a
time), taken with the ``filelock`` package instead of ``flock`` calls of our own.

filelock takes an ``flock`` on a file it creates with the mode asked for (0600 here) and leaves
in place, so a holder that dies lets go at once and the next one locks the same file. It opens
the file without following a symlink, but says so only as ``ELOOP``, and it locks a file that
another user owns; so the folder and the file are first checked as every store file is
(``safe_files``), which names the path in one line. The folder is owner-only, so nobody else
can plant a file between the check and the open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from outbox.core.folders import ensure_private_dir
from outbox.core.safe_files import check_file, check_folder


@contextlib.contextmanager
def exclusive(
    path: Path, what: str, busy: Callable[[], Exception], wait: float = 0.0
) -> Iterator[None]:
    """Hold ``path`` exclusively for the block; ``busy()`` is raised when another process (or
    another holder in this one) still has it after ``wait`` seconds (0: one try)."""
    ensure_private_dir(path.parent)
    check_folder(path.parent, f"folder of the {what}")
    check_file(path, what)
    lock = FileLock(path, mode=0o600, timeout=wait)
    try:
        lock.acquire()
    except Timeout:
        raise busy() from None
    try:
        yield
    finally:
        lock.release()
