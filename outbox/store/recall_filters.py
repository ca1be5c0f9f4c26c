"""A recall filter as SQL, per database, so it applies inside the lexical leg's query (before
its LIMIT), never to the rows a LIMIT already cut."""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, cast, true
from sqlalchemy.dialects.postgresql import JSONB

from outbox.core.recall_filter import RecallFilter
from outbox.store.schema import records


def sqlite_clause(filters: RecallFilter, alias: str = "r") -> tuple[str, dict[str, Any]]:
    """(condition over ``records`` as ``alias``, its parameters) for SQLite's text SQL."""
    parts: list[str] = []
    params: dict[str, Any] = {}
    if filters.session_id is not None:
        parts.append(f"json_extract({alias}.meta, '$.session_id') = :f_session")
        params["f_session"] = filters.session_id
    if filters.agent is not None:
        parts.append(f"json_extract({alias}.meta, '$.agent') = :f_agent")
        params["f_agent"] = filters.agent
    for number, tag in enumerate(filters.tags):
        parts.append(f"EXISTS (SELECT 1 FROM json_each({alias}.tags) WHERE value = :f_tag{number})")
        params[f"f_tag{number}"] = tag
    if filters.min_importance is not None:
        parts.append(f"{alias}.importance >= :f_importance")
        params["f_importance"] = filters.min_importance
    if filters.since is not None:
        parts.append(f"{alias}.ts >= :f_since")
        params["f_since"] = filters.since
    if filters.until is not None:
        parts.append(f"{alias}.ts < :f_until")
        params["f_until"] = filters.until
    return (" AND ".join(parts) or "1"), params


def postgres_clause(filters: RecallFilter, table: Any = records) -> Any:
    """The same condition as a SQLAlchemy expression over ``table`` (``records`` or a
    subquery with its columns)."""
    conditions: list[Any] = []
    if filters.session_id is not None:
        conditions.append(table.c.meta["session_id"].as_string() == filters.session_id)
    if filters.agent is not None:
        conditions.append(table.c.meta["agent"].as_string() == filters.agent)
    if filters.tags:
        conditions.append(cast(table.c.tags, JSONB).contains(list(filters.tags)))
    if filters.min_importance is not None:
        conditions.append(table.c.importance >= filters.min_importance)
    if filters.since is not None:
        conditions.append(table.c.ts >= filters.since)
    if filters.until is not None:
        conditions.append(table.c.ts < filters.until)
    return and_(*conditions) if conditions else true()
