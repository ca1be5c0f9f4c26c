"""Waking dispatchers in other processes when a write commits (PostgreSQL LISTEN/NOTIFY).

On SQLite a dispatcher in another process polls every ``OUTBOX_POLL_INTERVAL``; one in the
writer's own process is woken directly. On PostgreSQL every write's transaction sends a
``NOTIFY`` that is delivered at commit, and each dispatcher keeps one listening connection,
so a new record is picked up in milliseconds without polling faster.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy import Connection, Engine, text

log = logging.getLogger(__name__)

CHANNEL = "outbox_records"


def notify(conn: Connection) -> None:
    """Queue a wake-up inside the write's transaction (sent by PostgreSQL at commit)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text(f"NOTIFY {CHANNEL}"))


class Listener:
    """A background thread that calls ``wake`` for every NOTIFY on the channel."""

    def __init__(self, engine: Engine, wake: Callable[[], object], stop: threading.Event) -> None:
        self.engine = engine
        self.wake = wake
        self.stop = stop
        self.thread = threading.Thread(target=self._run, name="outbox-listen", daemon=True)

    def start(self) -> None:
        if self.engine.dialect.name == "postgresql":
            self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                raw = self.engine.raw_connection()
                try:
                    driver = raw.driver_connection
                    driver.autocommit = True  # type: ignore[union-attr]
                    driver.execute(f"LISTEN {CHANNEL}")  # type: ignore[union-attr]
                    while not self.stop.is_set():
                        for _note in driver.notifies(timeout=1.0):  # type: ignore[union-attr]
                            self.wake()
                finally:
                    raw.invalidate()
            except Exception as exc:  # a dropped connection: listen again after a pause
                log.warning("LISTEN connection lost (%s); retrying", exc.__class__.__name__)
                self.stop.wait(1.0)
