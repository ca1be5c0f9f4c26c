"""The one storage interface every backend passes the same conformance suite through.

All SQL is written once in SQLAlchemy Core, split by concern into parts that share the
engines: ``records`` (the write path and record reads), ``deliveries`` (the outbox proper),
``mirror_state`` (what the mirrors still owe) and ``recall`` (memory-core's reads). Each
part picks its dialect's few differences once, when it is built. No method holds a
transaction open while anything outside the database runs.
"""

from __future__ import annotations

from sqlalchemy import Engine

from outbox.core.config import Settings
from outbox.store import migrate
from outbox.store.bounded import call_within
from outbox.store.browse import BrowseQueries
from outbox.store.deliveries import DeliveryStore
from outbox.store.engine import make_engine
from outbox.store.forgetting import ForgetStore
from outbox.store.heartbeats import HeartbeatStore
from outbox.store.locations import LocationStore
from outbox.store.mirror_state import MirrorStateStore
from outbox.store.recall import RecallQueries
from outbox.store.records import RecordStore
from outbox.store.restore import OutcomeRestore


class Storage:
    """The storage parts over one writer engine and, optionally, a separate reader engine."""

    def __init__(self, engine: Engine, reader: Engine | None = None) -> None:
        self.engine = engine
        self.reader = reader or engine
        self.dialect = engine.dialect.name
        self.records = RecordStore(self.engine, self.reader)
        self.deliveries = DeliveryStore(self.engine, self.reader)
        self.mirror_state = MirrorStateStore(self.engine, self.reader)
        self.forgetting = ForgetStore(self.engine, self.reader)
        self.recall = RecallQueries(self.reader)
        self.browse = BrowseQueries(self.reader)  # the dashboard's reads
        self.locations = LocationStore(self.engine, self.reader)  # where the mirrors live
        self.restore = OutcomeRestore()  # outbox rebuild: outcomes the log recorded
        self.heartbeats = HeartbeatStore(self.engine, self.reader)  # which dispatchers live

    @classmethod
    def from_settings(cls, settings: Settings) -> Storage:
        """The store ``settings.db_url`` names, as every part of the outbox opens it: SQLite
        reads on an engine of their own (deferred BEGIN beside the writer's BEGIN IMMEDIATE),
        PostgreSQL shares one pool."""
        engine = make_engine(settings, writer=True)
        if engine.dialect.name != "sqlite":
            return cls(engine)
        return cls(engine, make_engine(settings, writer=False))

    def upgrade(self, bound: float) -> None:
        """Migrate to the current schema; on PostgreSQL cut off after ``bound`` seconds when
        the server does not answer, like a write (an upgrade that has started is left to
        finish). SQLite's waits are bounded by its busy timeout."""
        if self.dialect == "sqlite":
            migrate.upgrade(self.engine, self.reader)
        else:
            call_within(bound, lambda: migrate.upgrade(self.engine, self.reader), "schema check")

    def close(self) -> None:
        """Close the engines' pooled connections."""
        self.engine.dispose()
        if self.reader is not self.engine:
            self.reader.dispose()

    def integrity_problems(self) -> list[str]:
        """What the database's own check finds wrong (SQLite's ``quick_check``: pages,
        records and indexes); a server checks itself, so PostgreSQL reports nothing."""
        if self.dialect != "sqlite":
            return []
        with self.reader.connect() as conn:
            rows = [str(row[0]) for row in conn.exec_driver_sql("PRAGMA quick_check").all()]
        return [] if rows == ["ok"] else rows
