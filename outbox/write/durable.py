"""A write's one decision: commit, or, when the database cannot take it in time, the
fallback file, which is then the durable copy.

Shared by the outbox (``api.py``) and ``outbox add``'s direct write (``write/direct.py``), and
free of SQLAlchemy like the rest of the SQLite write path. Only a validation error (raised
before this point) or StoreFailed (both paths failed) leaves a write; anything else the
database raises becomes a fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from outbox.core.errors import StoreFailed, about_record
from outbox.core.receipt import Receipt, store_failed_text
from outbox.core.record import Record
from outbox.core.states import ReceiptStatus
from outbox.write.fallback import FallbackQueue, failure_reason
from outbox.write.writer import Accepted, Writer

log = logging.getLogger(__name__)


def commit_or_fallback(
    writer: Writer,
    fallback: FallbackQueue,
    records: Sequence[Record],
    *,
    expected: tuple[type[BaseException], ...],
    before: Callable[[], object] | None = None,
) -> tuple[list[Receipt], str | None]:
    """The receipts, and the reason the database did not take the write (None: committed).

    ``expected`` are the errors of a database that is merely unavailable (logged as a
    warning; anything else as an error). ``before`` runs inside the same guard (a schema
    check that may find the database locked).
    """
    try:
        if before is not None:
            before()
        accepted: list[Accepted] = writer.commit(records)
    except Exception as exc:
        reason = failure_reason(exc)
        level = logging.WARNING if isinstance(exc, expected) else logging.ERROR
        log.log(
            level,
            "database did not take %d record(s) (%s: %s); using fallback files",
            len(records),
            reason,
            exc.__class__.__name__,
        )
        return [_fallback(fallback, record, reason, writer.sinks) for record in records], reason
    return [writer.receipt(item) for item in accepted], None


def _fallback(
    fallback: FallbackQueue, record: Record, reason: str, sinks: tuple[str, ...]
) -> Receipt:
    try:
        with about_record(record.key, "write"):  # its fallback file's name is its words
            path, existed = fallback.write(record, reason)
    except OSError as exc:
        log.warning("fallback write failed too (%s)", exc.strerror or exc.__class__.__name__)
        raise StoreFailed(store_failed_text(sinks)) from None
    return Receipt(
        key=record.key,
        status=ReceiptStatus.FALLBACK,
        duplicate=existed,
        markdown_path=path,
        timestamp=record.timestamp,
        sinks=sinks,
        reason=reason,
    )
