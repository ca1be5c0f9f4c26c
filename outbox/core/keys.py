"""Record identity: the canonical timestamp and the idempotency key.

Pure functions only, so that property tests can pin the formula down exactly.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, date, datetime, time

from outbox.core.errors import ValidationError


def parse_instant(value: str | datetime | date, field: str = "timestamp") -> datetime:
    """Turn an ISO 8601 string, a datetime or a date into an aware UTC datetime.

    A value without an offset is taken as UTC; a bare date is midnight UTC (YAML gives dates
    for legacy fallback files whose timestamp has no time part).
    """
    if isinstance(value, datetime):
        parsed = value
    elif isinstance(value, date):
        parsed = datetime.combine(value, time(0, 0))
    elif isinstance(value, str):
        text = value.strip()
        if not text:
            raise ValidationError(field, "is empty")
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError:
            raise ValidationError(field, f"is not an ISO 8601 timestamp: {value[:40]!r}") from None
    else:
        raise ValidationError(
            field, f"must be an ISO 8601 string or datetime, not {type(value).__name__}"
        )
    if parsed.tzinfo is None or parsed.utcoffset() is None:
        parsed = parsed.replace(tzinfo=UTC)
    try:
        return parsed.astimezone(UTC)
    except (OverflowError, ValueError):
        raise ValidationError(field, "is outside the representable range") from None


def format_instant(instant: datetime) -> str:
    """The canonical notation: UTC, six fractional digits, a trailing ``Z``.

    Built with isoformat, not strftime: glibc's ``%Y`` drops the zero padding of years < 1000.
    """
    utc = instant.astimezone(UTC).replace(tzinfo=None)
    return utc.isoformat(timespec="microseconds") + "Z"


def canonical_timestamp(value: str | datetime | date | None = None) -> str:
    """Canonical form of a caller's timestamp, or of now when none is given."""
    instant = datetime.now(UTC) if value is None else parse_instant(value)
    return format_instant(instant)


def idempotency_key(content: str, canonical_ts: str) -> str:
    """sha256(content + "\\n" + canonical timestamp): the same memory at the same instant."""
    digest = hashlib.sha256(content.encode("utf-8") + b"\n" + canonical_ts.encode("ascii"))
    return digest.hexdigest()


def content_hash_prefix(content: str) -> str:
    """First 8 hex digits of sha256(content): the tail of a derived slug."""
    return hashlib.sha256(content.encode("utf-8")).hexdigest()[:8]
