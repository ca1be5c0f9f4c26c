"""Dispatcher heartbeats: each ``outbox run`` rewrites its own row while it lives.

A reader (``outbox status``, the metrics, the dashboard) tells apart a dispatcher that is
alive, one that stopped cleanly, and one that died without stopping (its beat is older than
the ``gone_after`` it recorded: it decides how late is too late, since only it knows its
interval and how long a beat may wait for the database lock).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Engine, Table, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite

from outbox.store.schema import dispatcher_heartbeats

ALIVE, GONE, STOPPED = "alive", "gone", "stopped"


@dataclass(frozen=True)
class Heartbeat:
    """One dispatcher as its last beat left it. Times are Unix seconds (the beating host's
    clock); ``delivered`` and ``failed`` count since it started."""

    owner: str
    host: str
    pid: int
    sinks: tuple[str, ...]
    started_at: float
    beat_at: float
    gone_after: float
    last_batch_at: float | None
    delivered: int
    failed: int
    records_per_second: float
    stopped_at: float | None = None

    def state(self, now: float) -> str:
        """``stopped`` (said goodbye), ``gone`` (no beat for longer than ``gone_after``),
        else ``alive``."""
        if self.stopped_at is not None:
            return STOPPED
        return GONE if now - self.beat_at > self.gone_after else ALIVE


def _from_row(row: Any) -> Heartbeat:
    return Heartbeat(
        owner=row.owner,
        host=row.host,
        pid=int(row.pid),
        sinks=tuple(row.sinks),
        started_at=float(row.started_at),
        beat_at=float(row.beat_at),
        gone_after=float(row.gone_after),
        last_batch_at=None if row.last_batch_at is None else float(row.last_batch_at),
        delivered=int(row.delivered),
        failed=int(row.failed),
        records_per_second=float(row.records_per_second),
        stopped_at=None if row.stopped_at is None else float(row.stopped_at),
    )


class HeartbeatStore:
    """Writes a dispatcher's beats and reads everyone's."""

    def __init__(self, engine: Engine, reader: Engine) -> None:
        self.engine = engine
        self.reader = reader
        # Each dialect's INSERT with ON CONFLICT: the same call, from its own module.
        postgres = engine.dialect.name == "postgresql"
        self._insert: Callable[[Table], Any] = postgresql.insert if postgres else sqlite.insert

    def beat(self, heartbeat: Heartbeat) -> None:
        """Record ``heartbeat``, replacing the owner's previous one."""
        values = asdict(heartbeat)
        values["sinks"] = list(heartbeat.sinks)
        changed = {name: value for name, value in values.items() if name != "owner"}
        statement = self._insert(dispatcher_heartbeats).values(**values)
        statement = statement.on_conflict_do_update(index_elements=["owner"], set_=changed)
        with self.engine.begin() as conn:
            conn.execute(statement)

    def stop(self, owner: str, now: float) -> None:
        """The owner stopped cleanly: never shown as gone."""
        with self.engine.begin() as conn:
            conn.execute(
                update(dispatcher_heartbeats)
                .where(dispatcher_heartbeats.c.owner == owner)
                .values(stopped_at=now)
            )

    def all(self) -> list[Heartbeat]:
        """Every dispatcher on record, the most recently started first."""
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(dispatcher_heartbeats).order_by(
                    dispatcher_heartbeats.c.started_at.desc(), dispatcher_heartbeats.c.owner
                )
            ).all()
        return [_from_row(row) for row in rows]

    def prune(self, before: float) -> int:
        """Forget dispatchers whose last beat is older than ``before``; returns how many."""
        with self.engine.begin() as conn:
            result = conn.execute(
                delete(dispatcher_heartbeats).where(dispatcher_heartbeats.c.beat_at < before)
            )
        return int(result.rowcount or 0)
