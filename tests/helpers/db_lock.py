"""Hold SQLite's write lock from another process, as a long transaction elsewhere would.

``db_lock.py DB SECONDS``: open DB, ``BEGIN EXCLUSIVE``, print ``locked`` (flushed), then hold
the lock until SECONDS pass or standard input closes, whichever comes first, and roll back.
Closing standard input is how a test releases it at a moment of its choosing.
"""

from __future__ import annotations

import select
import sqlite3
import sys
import time


def hold(db_path: str, seconds: float) -> None:
    conn = sqlite3.connect(db_path, timeout=30, isolation_level=None)
    conn.execute("BEGIN EXCLUSIVE")
    sys.stdout.write("locked\n")
    sys.stdout.flush()
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sys.stdin], [], [], left)
        if readable and not sys.stdin.buffer.read1(4096):
            break
    conn.execute("ROLLBACK")
    conn.close()


if __name__ == "__main__":
    hold(sys.argv[1], float(sys.argv[2]))
