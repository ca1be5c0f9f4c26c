"""Delivery outcomes put back from the audit log when a lost database is rebuilt.

``outbox rebuild`` inserts each recovered record through the write path's own insert (every
delivery pending), then, in the same transaction, gives back the outcomes the JSONL log
recorded: delivered with the sink's id, dead with its reason, discarded. They are marked
mirrored, since the log already holds their lines. One statement for the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, bindparam, update

from outbox.core.states import DeliveryState
from outbox.store.schema import deliveries


@dataclass(frozen=True)
class KnownOutcome:
    """What the log says one sink did with one record."""

    key: str
    sink: str
    state: DeliveryState
    sink_id: str | None
    error_class: str | None
    attempts: int


_RESTORE = (
    update(deliveries)
    .where(
        deliveries.c.record_key == bindparam("r_key"),
        deliveries.c.sink == bindparam("r_sink"),
        deliveries.c.state == DeliveryState.PENDING,
    )
    .values(
        state=bindparam("r_state"),
        sink_id=bindparam("r_sink_id"),
        error_class=bindparam("r_error_class"),
        attempts=bindparam("r_attempts"),
        delivered_at=bindparam("r_delivered_at"),
        available_at=bindparam("r_now"),
        updated_at=bindparam("r_now"),
        mirror_pending=0,
    )
)


class OutcomeRestore:
    """Writes outcomes recovered from the log onto freshly inserted delivery rows."""

    def restore(self, conn: Connection, outcomes: Sequence[KnownOutcome], now: float) -> None:
        """Settle each (record, sink) row as the log says, inside the caller's transaction;
        a row that is not pending (already settled by someone else) is left alone."""
        if not outcomes:
            return
        conn.execute(
            _RESTORE,
            [
                {
                    "r_key": outcome.key,
                    "r_sink": outcome.sink,
                    "r_state": outcome.state.value,
                    "r_sink_id": outcome.sink_id,
                    "r_error_class": outcome.error_class,
                    "r_attempts": outcome.attempts,
                    "r_delivered_at": now if outcome.state == DeliveryState.DELIVERED else None,
                    "r_now": now,
                }
                for outcome in outcomes
            ],
        )
