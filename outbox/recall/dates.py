"""The calendar dates a recall query names ("on 7 July, 2023", "in August 2023", "in 2023",
"in June"), as windows of time a memory's timestamp can fall in.

A question that names a day asks about what was said that day, so recall favours memories
written then; how much is the fusion's business (``outbox/recall/fusion.py``). English only, pure:
no clock is read, so a bare month (no year) is that month of any year, never "the last one".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta

_MONTHS = {
    name: number
    for number, names in enumerate(
        (
            ("january", "jan"),
            ("february", "feb"),
            ("march", "mar"),
            ("april", "apr"),
            ("may",),
            ("june", "jun"),
            ("july", "jul"),
            ("august", "aug"),
            ("september", "sep", "sept"),
            ("october", "oct"),
            ("november", "nov"),
            ("december", "dec"),
        ),
        start=1,
    )
    for name in names
}
_MONTH = r"(?P<month>" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"
_DAY = r"(?P<day>[0-3]?\d)(?:st|nd|rd|th)?"
_YEAR = r"(?P<year>(?:19|20)\d\d)"
# Most specific first: a day, then a month of a year, then a year or a month alone. A bare
# month needs a word before it that makes it a time ("in May", not "May I ask").
_PATTERNS = (
    re.compile(r"\b(?P<iso>(?:19|20)\d\d)-(?P<m>[01]\d)-(?P<d>[0-3]\d)\b"),
    re.compile(rf"\b{_MONTH}\s+{_DAY},?\s+{_YEAR}\b", re.IGNORECASE),
    re.compile(rf"\b{_DAY}\s+(?:of\s+)?{_MONTH},?\s+{_YEAR}\b", re.IGNORECASE),
    re.compile(rf"\b{_MONTH}\s+(?:of\s+)?{_YEAR}\b", re.IGNORECASE),
    re.compile(rf"\b(?:in|during|since|by|of|from|before|after)\s+{_YEAR}\b", re.IGNORECASE),
    re.compile(
        rf"\b(?:in|during|since|by|of|from|before|after|early|late|mid|last|this|next)\s+"
        rf"{_MONTH}(?!\s*\d)\b",
        re.IGNORECASE,
    ),
)


@dataclass(frozen=True)
class DateWindow:
    """A span of days ``[start, end)``; with ``month`` set and no year, that month of any
    year instead."""

    start: date | None = None
    end: date | None = None
    month: int | None = None
    # The query's words that named it: a memory written then holds them, in a sense.
    wording: str = field(default="", compare=False)

    def holds(self, moment: datetime) -> bool:
        """Whether a memory written at ``moment`` (aware, any zone) falls in the window."""
        day = moment.astimezone(UTC).date()
        if self.month is not None:
            return day.month == self.month
        return self.start is not None and self.end is not None and self.start <= day < self.end


def named_dates(query: str) -> list[DateWindow]:
    """Each date the query names, as a window, in the order found; the words of one date
    are not read again as a second, vaguer one (pure)."""
    windows: list[DateWindow] = []
    taken: list[tuple[int, int]] = []
    for pattern in _PATTERNS:
        for found in pattern.finditer(query):
            span = found.span()
            if any(span[0] < end and start < span[1] for start, end in taken):
                continue
            window = _window(found.groupdict())
            taken.append(span)  # an impossible day (31 February) names no vaguer date either
            if window is not None:
                windows.append(replace(window, wording=found.group(0)))
    return windows


def _window(found: dict[str, str | None]) -> DateWindow | None:
    """The window of one match's parts; None for an impossible date (31 February)."""
    parts = {name: value for name, value in found.items() if value}
    if "iso" in parts:
        return _day(int(parts["iso"]), int(parts["m"]), int(parts["d"]))
    month = _MONTHS[parts["month"].lower()] if "month" in parts else None
    year = int(parts["year"]) if "year" in parts else None
    if "day" in parts and month and year:
        return _day(year, month, int(parts["day"]))
    if month and year:
        following = date(year + month // 12, month % 12 + 1, 1)
        return DateWindow(date(year, month, 1), following)
    if year:
        return DateWindow(date(year, 1, 1), date(year + 1, 1, 1))
    return DateWindow(month=month) if month else None


def _day(year: int, month: int, day: int) -> DateWindow | None:
    try:
        start = date(year, month, day)
    except ValueError:
        return None
    return DateWindow(start, start + timedelta(days=1))
