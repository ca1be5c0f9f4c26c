"""The outbox proper: one ``deliveries`` row per (record, sink), leased, settled and retried.

The writes: a dispatcher's (claim, renew, settle, release) and the operator's (dead letters,
pruning), on top of the reads in ``delivery_reads``. Each runs in its own short transaction;
none holds one open while a sink is called. A batch's claim and settle, run once per batch
and on every record, are a ``_BatchStatements`` chosen once in the constructor: on SQLite the
bare driver's (``sqlite_dispatch.py``), on PostgreSQL Core statements with row locks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Connection,
    Engine,
    and_,
    bindparam,
    select,
    update,
)

from outbox.core.states import UNDELIVERED, DeliveryOp, DeliveryState
from outbox.store.delivery_reads import CHUNK, PENDING_DEPTH_CAP, DeliveryReads, DeliveryRow
from outbox.store.engine import driver_of
from outbox.store.schema import deliveries
from outbox.store.sqlite_dispatch import SqliteDispatch

__all__ = ["PENDING_DEPTH_CAP", "Claim", "DeliveryRow", "DeliveryStore"]


@dataclass(frozen=True)
class Claim:
    """A delivery row leased to one dispatcher."""

    delivery_id: int
    key: str
    sink: str
    attempts: int
    op: str = DeliveryOp.DELIVER  # DeliveryOp: hold the record, or delete it (a forget)


def _leased_by(owner: str | BindParameter[str]) -> ColumnElement[bool]:
    """Rows still leased to ``owner``: what every write of a lease holder is guarded by."""
    return and_(deliveries.c.lease_owner == owner, deliveries.c.state == DeliveryState.LEASED)


# Settling a delivered row; one statement for the whole batch (executemany).
_DELIVER = (
    update(deliveries)
    .where(deliveries.c.id == bindparam("b_id"), _leased_by(bindparam("b_owner")))
    .values(
        state=DeliveryState.DELIVERED,
        sink_id=bindparam("b_sink_id"),
        delivered_at=bindparam("b_now"),
        available_at=bindparam("b_now"),
        lease_owner=None,
        lease_expires_at=None,
        last_error=None,
        mirror_pending=1,
        updated_at=bindparam("b_now"),
    )
)


def _deleted(delivery_id: int, owner: str, now: float) -> Any:
    """Settle one delete row the sink carried out; its ``deleted`` line is still to write."""
    return (
        update(deliveries)
        .where(deliveries.c.id == delivery_id, _leased_by(owner))
        .values(
            state=DeliveryState.FORGOTTEN,
            lease_owner=None,
            lease_expires_at=None,
            last_error=None,
            available_at=now,
            mirror_pending=1,
            updated_at=now,
        )
    )


class _BatchStatements(Protocol):
    """A batch's claim and settle, per database (what ``DeliveryStore`` documents)."""

    def claim(
        self, sink: str, owner: str, limit: int, expires: float, now: float
    ) -> list[tuple[int, str, int, str]]:
        """Lease up to ``limit`` due rows: (id, key, attempts, op) of each."""
        ...

    def settle(
        self,
        owner: str,
        delivered: Sequence[tuple[int, str]],
        failed: Sequence[tuple[int, str, str, float | None]],
        deleted: Sequence[int],
        now: float,
    ) -> tuple[list[int], list[int]]:
        """One transaction for a batch's outcomes, guarded by the lease."""
        ...


class _PostgresBatch:
    """Core statements with row locks: a claim skips rows another claim holds instead of
    waiting for them, and a settle locks the rows it reads as still its own."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def claim(
        self, sink: str, owner: str, limit: int, expires: float, now: float
    ) -> list[tuple[int, str, int, str]]:
        due = (
            select(deliveries.c.id)
            .where(
                deliveries.c.sink == sink,
                deliveries.c.state.in_(UNDELIVERED),
                deliveries.c.available_at <= now,
            )
            .order_by(deliveries.c.available_at)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        statement = (
            update(deliveries)
            .where(deliveries.c.id.in_(due.scalar_subquery()))
            .values(
                state=DeliveryState.LEASED,
                lease_owner=owner,
                lease_expires_at=expires,
                available_at=expires,
                attempts=deliveries.c.attempts + 1,
                updated_at=now,
            )
            .returning(
                deliveries.c.id, deliveries.c.record_key, deliveries.c.attempts, deliveries.c.op
            )
        )
        with self.engine.begin() as conn:
            rows = conn.execute(statement).all()
        return [(row.id, row.record_key, row.attempts, row.op) for row in rows]

    def settle(
        self,
        owner: str,
        delivered: Sequence[tuple[int, str]],
        failed: Sequence[tuple[int, str, str, float | None]],
        deleted: Sequence[int],
        now: float,
    ) -> tuple[list[int], list[int]]:
        done: list[int] = []
        with self.engine.begin() as conn:
            if delivered:
                done = self._settle_delivered(conn, owner, delivered, now)
            for delivery_id in deleted:
                if conn.execute(_deleted(delivery_id, owner, now)).rowcount:
                    done.append(delivery_id)
            dead_or_retry = [
                delivery_id
                for delivery_id, error, error_class, next_at in failed
                if self._settle_failed(conn, owner, delivery_id, error, error_class, next_at, now)
            ]
        return done, dead_or_retry

    def _settle_delivered(
        self, conn: Connection, owner: str, delivered: Sequence[tuple[int, str]], now: float
    ) -> list[int]:
        """Mark the owner's leased rows delivered: one ownership read, one batched update.

        An UPDATE built per row was most of a batch's settle. Reading first which rows are
        still ours, locked FOR UPDATE, keeps the per-row answer exact.
        """
        wanted = [delivery_id for delivery_id, _ in delivered]
        owned: set[int] = set()
        for start in range(0, len(wanted), CHUNK):
            query = select(deliveries.c.id).where(
                deliveries.c.id.in_(wanted[start : start + CHUNK]), _leased_by(owner)
            )
            owned.update(conn.execute(query.with_for_update()).scalars())
        done: list[int] = []
        params: list[dict[str, Any]] = []
        for delivery_id, sink_id in delivered:
            if delivery_id in owned:
                owned.discard(delivery_id)  # a repeated id settles once
                done.append(delivery_id)
                params.append(
                    {"b_id": delivery_id, "b_owner": owner, "b_sink_id": sink_id, "b_now": now}
                )
        if params:
            conn.execute(_DELIVER, params)
        return done

    @staticmethod
    def _settle_failed(
        conn: Connection,
        owner: str,
        delivery_id: int,
        error: str,
        error_class: str,
        next_at: float | None,
        now: float,
    ) -> bool:
        """Put one failed row back to pending until ``next_at``, or dead without one."""
        retry = next_at is not None
        result = conn.execute(
            update(deliveries)
            .where(deliveries.c.id == delivery_id, _leased_by(owner))
            .values(
                state=DeliveryState.PENDING if retry else DeliveryState.DEAD,
                available_at=next_at if retry else now,
                mirror_pending=1,
                last_error=error[:2000],
                error_class=error_class,
                lease_owner=None,
                lease_expires_at=None,
                updated_at=now,
            )
        )
        return bool(result.rowcount)


class DeliveryStore(DeliveryReads):
    """Reads and writes of ``deliveries``: writes on ``engine``, reads on ``reader``."""

    def __init__(self, engine: Engine, reader: Engine) -> None:
        super().__init__(reader)
        self.engine = engine
        self._batch: _BatchStatements = (
            _PostgresBatch(engine)
            if engine.dialect.name == "postgresql"
            else SqliteDispatch(lambda: driver_of(engine), lambda: driver_of(reader))
        )

    def claim(
        self, sink: str, owner: str, limit: int, lease_seconds: float, now: float | None = None
    ) -> list[Claim]:
        """Lease up to ``limit`` due rows of ``sink`` in one short transaction.

        Due means pending and past its retry time, or leased with an expired lease (its
        dispatcher died). The attempt is counted at claim time, so a record that kills its
        dispatcher still reaches the dead-letter cap.
        """
        now = time.time() if now is None else now
        rows = self._batch.claim(sink, owner, limit, now + lease_seconds, now)
        claims = [
            Claim(delivery_id, key, sink, attempts, op) for delivery_id, key, attempts, op in rows
        ]
        claims.sort(key=lambda claim: claim.delivery_id)
        return claims

    def renew(self, owner: str, delivery_ids: Sequence[int], lease_seconds: float) -> int:
        """Extend the owner's leases on these rows; rows it lost keep their new owner's."""
        if not delivery_ids:
            return 0
        now = time.time()
        expires = now + lease_seconds
        with self.engine.begin() as conn:
            result = conn.execute(
                update(deliveries)
                .where(deliveries.c.id.in_(list(delivery_ids)), _leased_by(owner))
                .values(lease_expires_at=expires, available_at=expires, updated_at=now)
            )
        return result.rowcount

    def take_back(self, sink: str, owners: Sequence[str]) -> int:
        """End now the leases on ``sink`` of dispatchers known gone (their heartbeat stopped),
        so the next claim takes their rows at once instead of when the leases run out. The
        attempt they counted stays counted: a record that killed its dispatcher still nears
        the dead-letter cap."""
        if not owners:
            return 0
        now = time.time()
        with self.engine.begin() as conn:
            result = conn.execute(
                update(deliveries)
                .where(
                    deliveries.c.sink == sink,
                    deliveries.c.state == DeliveryState.LEASED,
                    deliveries.c.lease_owner.in_(list(owners)),
                )
                .values(lease_expires_at=now, available_at=now, updated_at=now)
            )
        return result.rowcount

    def settle(
        self,
        owner: str,
        delivered: Sequence[tuple[int, str]],
        failed: Sequence[tuple[int, str, str, float | None]],
        now: float | None = None,
        *,
        purge_search_index: bool = False,
        deleted: Sequence[int] = (),
    ) -> tuple[list[int], list[int]]:
        """Record outcomes of one batch in one transaction, guarded by lease ownership.

        ``delivered`` holds (delivery id, sink id); ``failed`` holds (delivery id, error text,
        error class, next attempt time or None for a dead letter). Returns the ids actually
        updated (a row whose lease was taken over is left to its new owner).
        ``purge_search_index`` is accepted and ignored: the lexical leg of recall searches
        every record, delivered or not, so delivery leaves the search index alone.
        ``deleted`` holds the delete rows (a forget's) the sink has carried out.
        """
        now = time.time() if now is None else now
        return self._batch.settle(owner, delivered, failed, deleted, now)

    def release(self, owner: str, delivery_ids: Sequence[int] | None = None) -> int:
        """Hand leased rows back untried (clean shutdown): the attempt is not counted."""
        now = time.time()
        condition = _leased_by(owner)
        if delivery_ids is not None:
            condition = and_(condition, deliveries.c.id.in_(list(delivery_ids)))
        with self.engine.begin() as conn:
            result = conn.execute(
                update(deliveries)
                .where(condition)
                .values(
                    state=DeliveryState.PENDING,
                    available_at=now,
                    attempts=deliveries.c.attempts - 1,
                    lease_owner=None,
                    lease_expires_at=None,
                    updated_at=now,
                )
            )
        return result.rowcount

    def requeue_dead(self, keys: Sequence[str] | None, sink: str | None = None) -> int:
        """Give dead letters a fresh set of attempts."""
        now = time.time()
        return self._update_dead(
            keys, sink, state=DeliveryState.PENDING, attempts=0, available_at=now, updated_at=now
        )

    def discard_dead(self, keys: Sequence[str] | None, sink: str | None = None) -> int:
        """Mark dead letters discarded: kept for audit, never retried."""
        return self._update_dead(keys, sink, state=DeliveryState.DISCARDED, updated_at=time.time())

    def _update_dead(self, keys: Sequence[str] | None, sink: str | None, **values: Any) -> int:
        """Change dead letters (all, or those of ``keys`` / ``sink``) and flag their mirrors."""
        condition = deliveries.c.state == DeliveryState.DEAD
        if keys:
            condition = and_(condition, deliveries.c.record_key.in_(list(keys)))
        if sink:
            condition = and_(condition, deliveries.c.sink == sink)
        with self.engine.begin() as conn:
            result = conn.execute(
                update(deliveries).where(condition).values(mirror_pending=1, **values)
            )
        return result.rowcount

    def prune_delivered(self, sinks: Sequence[str], older_than: float, limit: int = 5000) -> int:
        """Delete delivered rows past retention (the mirrors keep the history)."""
        total = 0
        for sink in sinks:
            ids = (
                select(deliveries.c.id)
                .where(
                    deliveries.c.sink == sink,
                    deliveries.c.state == DeliveryState.DELIVERED,
                    deliveries.c.available_at < older_than,
                    deliveries.c.mirror_pending == 0,
                )
                .limit(limit)
            )
            with self.engine.begin() as conn:
                result = conn.execute(
                    deliveries.delete().where(deliveries.c.id.in_(ids.scalar_subquery()))
                )
            total += result.rowcount
        return total
