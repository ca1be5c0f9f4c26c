"""Calls to a database server that may never answer, cut off at a deadline.

A PostgreSQL server that stops answering (a frozen process, a network that drops packets
without a reset) leaves the driver waiting for its reply forever: neither ``lock_timeout``
nor ``statement_timeout`` can fire on a server that does not run, and TCP keepalives take
hours. So such a call runs on a helper thread and the caller stops waiting at its deadline;
its write then goes to the fallback file. If the server answers later, the helper finishes
what it started, and the fallback import finds the record already there (same key).
SQLite needs none of this: its waits are bounded by ``busy_timeout``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from outbox.core.errors import DatabaseTimeout

T = TypeVar("T")


def call_within(seconds: float, function: Callable[[], T], what: str) -> T:
    """``function()``'s result, or DatabaseTimeout once ``seconds`` pass without one."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(function())
        except BaseException as exc:  # handed to the caller's thread below
            failure.append(exc)

    helper = threading.Thread(target=run, name=f"outbox-{what}", daemon=True)
    helper.start()
    helper.join(max(0.0, seconds))
    if helper.is_alive():
        raise DatabaseTimeout(f"the database server did not answer the {what} in time")
    if failure:
        raise failure[0]
    return outcome[0]
