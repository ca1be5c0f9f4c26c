"""What a record's markdown front matter says: the one place that builds it.

A new file (written by the write, the fallback queue or repair) and a file after delivery
both get their front matter here, so the keys, their order and their meaning cannot drift
apart between the places that write files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from outbox.core.record import Record
from outbox.core.states import (
    REASON_DELIVERED,
    REASON_PENDING,
    SETTLED,
    BuiltinSink,
    DeliveryState,
)

if TYPE_CHECKING:
    from outbox.store.deliveries import DeliveryRow


def _matter(
    record: Record,
    *,
    intended_brain_store: bool,
    reason: str,
    retry_attempted: bool = False,
    chunk_id: str | None = None,
    sink_states: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The published keys in their published order, then per-sink state. Plain ``str``
    values only: the fast renderer and the safe YAML dumper both refuse enum members."""
    matter: dict[str, Any] = {
        "intended_brain_store": intended_brain_store,
        "importance": record.importance,
        "tags": list(record.tags),
        "timestamp": record.timestamp,
        "reason": str(reason),
        "retry_attempted": retry_attempted,
        "chunk_id": chunk_id,
        "key": record.key,
    }
    if sink_states:
        matter["sinks"] = {str(sink): str(state) for sink, state in sink_states.items()}
    return matter


def initial(record: Record, sinks: Iterable[str], reason: str = REASON_PENDING) -> dict[str, Any]:
    """A record nothing has delivered yet: every sink pending; ``reason`` is a fallback's."""
    names = list(sinks)
    return _matter(
        record,
        intended_brain_store=BuiltinSink.BRAINLAYER in names,
        reason=reason,
        sink_states=dict.fromkeys(names, DeliveryState.PENDING.value),
    )


def reason_of(rows: Sequence[DeliveryRow]) -> str:
    """The front matter's ``reason``: the last failure's class once anything failed (it
    says why the record was, or is, waiting); otherwise ``delivered`` when every sink has
    it, else ``pending``. No rows (pruned, say) is no evidence of delivery: ``pending``."""
    failures = sorted(
        (row for row in rows if row.error_class),
        key=lambda row: row.delivered_at or row.available_at,
    )
    if failures:
        return failures[-1].error_class or REASON_PENDING
    if rows and all(row.state == DeliveryState.DELIVERED for row in rows):
        return REASON_DELIVERED
    return REASON_PENDING


def delivered(record: Record, rows: Sequence[DeliveryRow]) -> dict[str, Any]:
    """What the deliveries say now: BrainLayer's chunk id, retries, the reason."""
    chunk_id = next(
        (
            row.sink_id
            for row in rows
            if row.sink == BuiltinSink.BRAINLAYER and row.state == DeliveryState.DELIVERED
        ),
        None,
    )
    matter = _matter(
        record,
        intended_brain_store=any(row.sink == BuiltinSink.BRAINLAYER for row in rows),
        reason=reason_of(rows),
        retry_attempted=any(row.attempts > 1 or row.error_class for row in rows),
        chunk_id=chunk_id,
        sink_states={row.sink: row.state for row in rows},
    )
    ids = {row.sink: row.sink_id for row in rows if row.sink_id}
    if ids:
        matter["sink_ids"] = ids
    return matter


def judged_by(current: Mapping[str, object], rows: Sequence[DeliveryRow]) -> bool:
    """Whether ``rows`` hold all that a file's delivery keys follow: every delivery is
    settled and written out (a claim moves a row's state and attempts without a word to the
    files, which follow only settled outcomes), and every sink the file names still has its
    row (retention prunes delivered rows; the file keeps their history)."""
    sinks = current.get("sinks")
    return (
        isinstance(sinks, dict)
        and bool(rows)
        and set(sinks) == {row.sink for row in rows}
        and all(row.state in SETTLED and not row.mirror_pending for row in rows)
    )


def up_to_date(
    current: Mapping[str, Any], record: Record, rows: Sequence[DeliveryRow]
) -> dict[str, Any]:
    """A file's front matter as the deliveries say it should read now (its other keys kept)."""
    return {**current, **delivery_updates(current, delivered(record, rows), rows)}


def delivery_updates(
    current: Mapping[str, object], state: Mapping[str, object], rows: Sequence[DeliveryRow]
) -> dict[str, object]:
    """The keys a delivery changes in an existing file; the rest (a legacy or fallback
    file's own reason, which says why it was queued, timestamp notation, tags) stays as the
    file has it. A ``pending`` reason, ours, follows the deliveries."""
    updates = {name: state[name] for name in ("chunk_id", "sinks", "key") if name in state}
    if "sink_ids" in state:
        updates["sink_ids"] = state["sink_ids"]
    # A legacy file (no per-sink state yet, not one of our own fallback files) was written
    # because its store failed: delivering it from the queue is the retry it records.
    legacy = "sinks" not in current and not current.get("outbox_fallback")
    updates["retry_attempted"] = (
        bool(current.get("retry_attempted"))
        or bool(state["retry_attempted"])
        or (legacy and any(row.attempts > 0 for row in rows))
    )
    if any(row.error_class for row in rows) or current.get("reason") in (
        REASON_PENDING,
        REASON_DELIVERED,
    ):
        updates["reason"] = state["reason"]
    return updates
