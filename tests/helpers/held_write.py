"""Rewrite a file through ``markdown.write_atomic`` and stop between its temp file and the
rename, for a test to SIGKILL the writer there or let it finish.

``held_write.py PATH``: reads PATH, then writes the same bytes back with ``write_atomic``,
whose temp file is filled (and fsynced) as usual; then the process prints ``held`` (flushed)
and waits on standard input. Killed there, it leaves the temp file a dead writer leaves;
with standard input closed, the write goes on to its rename and the process prints
``written``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from outbox.mirror import markdown

_fill = markdown._fill


def _held_fill(fd: int, data: bytes, path: Path | str, *, fsync: bool) -> None:
    _fill(fd, data, path, fsync=fsync)
    sys.stdout.write("held\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the test closes it, or its SIGKILL


def main() -> None:
    path = Path(sys.argv[1])
    data = path.read_bytes()
    markdown._fill = _held_fill
    markdown.write_atomic(path, data)
    sys.stdout.write("written\n")


if __name__ == "__main__":
    main()
