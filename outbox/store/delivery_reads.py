"""Reads of the outbox's ``deliveries`` rows: what a dispatcher waits for and what
``status`` and the operator commands report. All run on the reader engine, and none differs
by database.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Engine, and_, func, select

from outbox.core.states import UNDELIVERED, DeliveryState
from outbox.store.rows import DeliveryRow as DeliveryRow  # its readers import it from here
from outbox.store.schema import deliveries

# How far pending_summary counts: beyond this a backlog is reported as "at least this many".
PENDING_DEPTH_CAP = 1000

# Ids or keys per ``IN (...)`` list: well below every driver's limit on bound parameters.
CHUNK = 500


def row_to_delivery(row: Any) -> DeliveryRow:
    """A ``deliveries`` row as a DeliveryRow (shared with the mirror-state queries)."""
    return DeliveryRow(
        delivery_id=row.id,
        key=row.record_key,
        sink=row.sink,
        state=row.state,
        attempts=row.attempts,
        available_at=row.available_at,
        last_error=row.last_error,
        error_class=row.error_class,
        sink_id=row.sink_id,
        mirror_pending=bool(row.mirror_pending),
        created_at=row.created_at,
        delivered_at=row.delivered_at,
        op=row.op,
    )


class DeliveryReads:
    """The read-only queries of ``deliveries``, on ``reader``."""

    def __init__(self, reader: Engine) -> None:
        self.reader = reader

    def deliveries_for(self, keys: Iterable[str]) -> dict[str, list[DeliveryRow]]:
        """Every delivery of these records, per record key, in id order."""
        wanted = list(keys)
        found: dict[str, list[DeliveryRow]] = {}
        with self.reader.connect() as conn:
            for start in range(0, len(wanted), CHUNK):
                chunk = wanted[start : start + CHUNK]
                query = select(deliveries).where(deliveries.c.record_key.in_(chunk))
                for row in conn.execute(query.order_by(deliveries.c.id)):
                    found.setdefault(row.record_key, []).append(row_to_delivery(row))
        return found

    def next_due_at(self, sinks: Sequence[str]) -> float | None:
        """The earliest time any row of these sinks becomes claimable."""
        with self.reader.connect() as conn:
            value = conn.execute(
                select(func.min(deliveries.c.available_at)).where(
                    deliveries.c.sink.in_(list(sinks)), deliveries.c.state.in_(UNDELIVERED)
                )
            ).scalar()
        return float(value) if value is not None else None

    def leases_held(self, sink: str, by_others_than: str) -> dict[str, float]:
        """Per owner other than ``by_others_than``, when its first lease on a row of
        ``sink`` runs out: what a drain with time to spare waits for."""
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(deliveries.c.lease_owner, func.min(deliveries.c.lease_expires_at))
                .where(
                    deliveries.c.sink == sink,
                    deliveries.c.state == DeliveryState.LEASED,
                    deliveries.c.lease_owner != by_others_than,
                )
                .group_by(deliveries.c.lease_owner)
            ).all()
        return {str(owner): float(expires) for owner, expires in rows}

    def counts(self) -> dict[str, dict[str, int]]:
        """Rows per sink and state; every state present, zero where there are none."""
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(deliveries.c.sink, deliveries.c.state, func.count()).group_by(
                    deliveries.c.sink, deliveries.c.state
                )
            ).all()
        table: dict[str, dict[str, int]] = {}
        for sink, state, count in rows:
            table.setdefault(sink, {member.value: 0 for member in DeliveryState})[state] = int(
                count
            )
        return table

    def oldest_pending(self) -> dict[str, float]:
        """Per sink, when its oldest undelivered row was created."""
        with self.reader.connect() as conn:
            rows = conn.execute(
                select(deliveries.c.sink, func.min(deliveries.c.created_at))
                .where(deliveries.c.state.in_(UNDELIVERED))
                .group_by(deliveries.c.sink)
            ).all()
        return {sink: float(created) for sink, created in rows}

    def pending_summary(self, sink: str, cap: int = PENDING_DEPTH_CAP) -> tuple[int, float | None]:
        """(rows of ``sink`` not delivered yet, counted up to ``cap``; the oldest one's
        creation time). ``add_memory`` reports both on every write, so neither may grow with
        the backlog: the count stops at ``cap`` and the oldest is one index step per state."""
        depth = (
            select(deliveries.c.id)
            .where(deliveries.c.sink == sink, deliveries.c.state.in_(UNDELIVERED))
            .limit(cap)
            .subquery()
        )
        oldest = [
            select(func.min(deliveries.c.created_at))
            .where(deliveries.c.sink == sink, deliveries.c.state == state)
            .scalar_subquery()
            for state in UNDELIVERED
        ]
        with self.reader.connect() as conn:
            count, *firsts = conn.execute(
                select(select(func.count()).select_from(depth).scalar_subquery(), *oldest)
            ).one()
        known = [float(value) for value in firsts if value is not None]
        return int(count), (min(known) if known else None)

    def retrying(self) -> dict[str, tuple[int, str | None]]:
        """Per sink: pending rows that already failed at least once, and the most recent
        failure's class (the readiness signal: the sink is in trouble right now)."""
        failed = and_(
            deliveries.c.state == DeliveryState.PENDING, deliveries.c.error_class.is_not(None)
        )
        found: dict[str, tuple[int, str | None]] = {}
        with self.reader.connect() as conn:
            for sink, count in conn.execute(
                select(deliveries.c.sink, func.count()).where(failed).group_by(deliveries.c.sink)
            ).all():
                latest = conn.execute(
                    select(deliveries.c.error_class)
                    .where(failed, deliveries.c.sink == sink)
                    .order_by(deliveries.c.updated_at.desc())
                    .limit(1)
                ).scalar()
                found[sink] = (int(count), latest)
        return found

    def list_deliveries(
        self, state: str, sink: str | None = None, limit: int = 100
    ) -> list[DeliveryRow]:
        """Rows in ``state`` (of ``sink`` only, when given), oldest first."""
        query = select(deliveries).where(deliveries.c.state == state)
        if sink:
            query = query.where(deliveries.c.sink == sink)
        with self.reader.connect() as conn:
            rows = conn.execute(query.order_by(deliveries.c.id).limit(limit)).all()
        return [row_to_delivery(row) for row in rows]

    def latest_failure(self, sink: str) -> DeliveryRow | None:
        """The pending row of ``sink`` that failed most recently: its error is what
        ``status`` shows as the sink's trouble right now."""
        query = (
            select(deliveries)
            .where(
                deliveries.c.sink == sink,
                deliveries.c.state == DeliveryState.PENDING,
                deliveries.c.error_class.is_not(None),
            )
            .order_by(deliveries.c.updated_at.desc())
            .limit(1)
        )
        with self.reader.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else row_to_delivery(row)
