"""What a recall query asks a memory to be: the filter both legs apply inside their own query.

A frozen value of the record model, so the store's queries, the Chroma leg's ``where`` and the
recall use case all read one definition, and the store needs nothing from the layers above it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from outbox.core.keys import canonical_timestamp, parse_instant

# How the Chroma sink names a tag in a memory's metadata (one boolean key per tag).
TAG_PREFIX = "tag:"


@dataclass(frozen=True)
class RecallFilter:
    """What a memory must be to be recalled; every field optional, all must hold.

    ``since`` is inclusive and ``until`` exclusive, both canonical timestamps.
    """

    session_id: str | None = None
    agent: str | None = None
    tags: tuple[str, ...] = ()
    min_importance: int | None = None
    since: str | None = None
    until: str | None = None

    @classmethod
    def of(
        cls,
        *,
        session_id: str | None = None,
        agent: str | None = None,
        tags: Iterable[str] | None = None,
        min_importance: int | None = None,
        since: str | datetime | date | None = None,
        until: str | datetime | date | None = None,
    ) -> RecallFilter:
        """A filter from a caller's loose values: times in any ISO 8601 form."""
        return cls(
            session_id=session_id or None,
            agent=agent or None,
            tags=tuple(dict.fromkeys(str(tag) for tag in _listed(tags))),
            min_importance=None if min_importance is None else int(min_importance),
            since=None if since is None else canonical_timestamp(since),
            until=None if until is None else canonical_timestamp(until),
        )

    @property
    def empty(self) -> bool:
        return self == RecallFilter()

    def admits(
        self, timestamp: str, importance: int, tags: Sequence[str], metadata: Mapping[str, Any]
    ) -> bool:
        """Whether a stored memory passes: the check both legs' own queries make."""
        checks = (
            self.session_id is None or str(metadata.get("session_id")) == self.session_id,
            self.agent is None or str(metadata.get("agent")) == self.agent,
            set(self.tags) <= set(tags),
            self.min_importance is None or importance >= self.min_importance,
            self.since is None or timestamp >= self.since,
            self.until is None or timestamp < self.until,
        )
        return all(checks)

    def chroma_where(self) -> dict[str, Any] | None:
        """The same filter as a Chroma ``where``, over the scalar keys the sink writes."""
        clauses: list[dict[str, Any]] = []
        if self.session_id is not None:
            clauses.append({"session_id": self.session_id})
        if self.agent is not None:
            clauses.append({"agent": self.agent})
        clauses += [{TAG_PREFIX + tag: True} for tag in self.tags]
        if self.min_importance is not None:
            clauses.append({"importance": {"$gte": self.min_importance}})
        if self.since is not None:
            clauses.append({"timestamp_epoch": {"$gte": _epoch(self.since)}})
        if self.until is not None:
            clauses.append({"timestamp_epoch": {"$lt": _epoch(self.until)}})
        if not clauses:
            return None
        return clauses[0] if len(clauses) == 1 else {"$and": clauses}


def _listed(tags: Iterable[str] | None) -> Iterable[str]:
    return [tags] if isinstance(tags, str) else tags or ()


def _epoch(timestamp: str) -> float:
    return parse_instant(timestamp).timestamp()
