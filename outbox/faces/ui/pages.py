"""What each dashboard page shows, gathered from one open outbox as plain values for its
template. No HTML here and no request handling: ``app.py`` does those.

Everything goes through the ``Outbox`` façade except the two reads it does not offer yet
(paging memories by tag, the delivery activity chart), which ``_browse`` takes from the
store's ``browse`` part in this one place.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from outbox.core.states import DeliveryState
from outbox.faces.ui.charts import Chart, activity_chart
from outbox.mirror.log_lines import lines_naming

if TYPE_CHECKING:
    from outbox import RecallHit
    from outbox.api import Outbox
    from outbox.store.browse import BrowseQueries
    from outbox.store.delivery_reads import DeliveryRow
    from outbox.store.rows import RecentRow

PAGE = 50  # memories per page, and search results
SLICES, SLICE_SECONDS = 60, 60.0  # the chart: the last hour, by the minute
DEAD_SHOWN = 100
SNIPPET = 140


def _browse(ob: Outbox) -> BrowseQueries:
    """The store's dashboard reads, which the façade hands out as ``Outbox.browse``."""
    return ob.browse


# -- overview -----------------------------------------------------------------------------


@dataclass(frozen=True)
class SinkRow:
    name: str
    counts: dict[str, int]
    oldest_pending_age: float | None
    retrying: int
    last_failure: str | None
    chart: Chart


def overview(ob: Outbox, now: float | None = None) -> dict[str, Any]:
    """Counts per sink and state, the last hour's activity, dispatchers, fallback files.

    The status report and the chart each read about every delivery row's index entry;
    they run side by side (each on its own connection, SQLite letting go of the GIL).
    """
    ob.refuse_if_empty()  # an empty board would be untrue of a lost database
    now = time.time() if now is None else now
    since = now - SLICES * SLICE_SECONDS
    sink_names = list(dict.fromkeys(ob.settings.sinks))
    with ThreadPoolExecutor(max_workers=2) as pool:
        chart = pool.submit(
            _browse(ob).activity, sink_names, since=since, width=SLICE_SECONDS, slices=SLICES
        )
        status = ob.status()
        activity = chart.result()
    sinks: Mapping[str, Mapping[str, Any]] = status["sinks"]
    missing = [name for name in sinks if name not in activity]
    if missing:  # a sink no longer configured that still has rows
        activity.update(
            _browse(ob).activity(missing, since=since, width=SLICE_SECONDS, slices=SLICES)
        )
    states = [state.value for state in DeliveryState]
    rows = [
        SinkRow(
            name=name,
            counts={state: int(entry.get(state, 0)) for state in states},
            oldest_pending_age=entry.get("oldest_pending_age"),
            retrying=int(entry.get("retrying") or 0),
            last_failure=entry.get("last_failure"),
            chart=activity_chart(activity[name].delivered, activity[name].failed, SLICE_SECONDS),
        )
        for name, entry in sinks.items()
    ]
    return {
        "records": status["records"],
        "forgotten": status["forgotten"],
        "dead_letters": status["dead_letters"],
        "database": status["database"],
        "jsonl_path": status["jsonl_path"],
        "markdown_dir": status["markdown_dir"],
        "states": states,
        "sinks": rows,
        "dispatchers": status.get("dispatchers"),
        "fallback_waiting": ob.fallback.pending_count(),
    }


def age_text(seconds: float | None) -> str:
    """A duration for people: 42s, 7m 5s, 3h 2m, 2d 4h."""
    if seconds is None:
        return "-"
    whole = int(seconds)
    for size, unit, smaller, small_unit in ((86400, "d", 3600, "h"), (3600, "h", 60, "m")):
        if whole >= size:
            return f"{whole // size}{unit} {whole % size // smaller}{small_unit}"
    return f"{whole // 60}m {whole % 60}s" if whole >= 60 else f"{seconds:.1f}s"


# -- memories -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    """The memories page's query: a search, or newest first under filters, paged."""

    q: str | None = None
    session: str | None = None
    agent: str | None = None
    tag: str | None = None
    before: str | None = None

    @classmethod
    def of(cls, params: Mapping[str, str]) -> Filters:
        """From a query string: blank fields are no filter."""

        def field(name: str) -> str | None:
            value = params.get(name, "").strip()
            return value or None

        return cls(field("q"), field("session"), field("agent"), field("tag"), field("before"))

    def cursor(self) -> tuple[str, str] | None:
        """``before`` as (timestamp, key): the last row of the previous page."""
        if self.before is None:
            return None
        ts, _, key = self.before.partition("|")
        return ts, key or "\uffff"

    def query(self, **changes: str | None) -> dict[str, str]:
        """These filters with ``changes``, as query parameters (empty ones left out)."""
        values = {
            "q": self.q,
            "session": self.session,
            "agent": self.agent,
            "tag": self.tag,
            "before": self.before,
        }
        values.update(changes)
        return {name: value for name, value in values.items() if value}


@dataclass(frozen=True)
class MemoryRow:
    key: str
    timestamp: str
    session: str | None
    agent: str | None
    tags: list[str]
    importance: int
    snippet: str
    sinks: dict[str, str]  # sink -> state
    relevance: float | None = None
    legs: list[str] | None = None


def snippet(text: str, width: int = SNIPPET) -> str:
    """The start of a memory on one line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def memories(ob: Outbox, filters: Filters) -> dict[str, Any]:
    """A page of memories: recall's answer to ``q``, else the newest under the filters."""
    ob.refuse_if_empty()
    if filters.q:
        answer = ob.recall(
            filters.q,
            limit=PAGE,
            session_id=filters.session,
            agent=filters.agent,
            tags=[filters.tag] if filters.tag else None,
        )
        rows = [_search_row(hit) for hit in answer.hits]
        states = _sink_states(ob, [row.key for row in rows])
        rows = [_with_states(row, states) for row in rows]
        return {
            "rows": rows,
            "next": None,
            "degraded": answer.degraded,
            "min_relevance": answer.min_relevance,
        }
    found = _browse(ob).memories(
        limit=PAGE,
        session_id=filters.session,
        agent=filters.agent,
        tag=filters.tag,
        before=filters.cursor(),
    )
    states = _sink_states(ob, [row.key for row in found])
    rows = [_with_states(_recent_row(row), states) for row in found]
    last = found[-1] if len(found) == PAGE else None
    return {
        "rows": rows,
        "next": filters.query(before=f"{last.timestamp}|{last.key}") if last else None,
        "degraded": None,
        "min_relevance": None,
    }


def _recent_row(row: RecentRow) -> MemoryRow:
    return MemoryRow(
        key=row.key,
        timestamp=row.timestamp,
        session=row.session_id,
        agent=row.agent,
        tags=row.tags,
        importance=row.importance,
        snippet=snippet(row.content),
        sinks={},
    )


def _search_row(hit: RecallHit) -> MemoryRow:
    """One of recall's hits; a turn shows its prompt and response, as memory-core splits it."""
    from outbox.memory_core import record_view

    view = record_view(hit.content, hit.metadata)
    text = view.get("content") or f"{view.get('prompt', '')} → {view.get('response', '')}"
    return MemoryRow(
        key=hit.key,
        timestamp=hit.timestamp,
        session=hit.session_id,
        agent=hit.agent,
        tags=list(hit.tags),
        importance=hit.importance,
        snippet=snippet(text),
        sinks={},
        relevance=round(hit.relevance, 4),
        legs=list(hit.legs),
    )


def _sink_states(ob: Outbox, keys: list[str]) -> dict[str, dict[str, str]]:
    return {
        key: {row.sink: row.state for row in rows} for key, rows in ob.deliveries_of(keys).items()
    }


def _with_states(row: MemoryRow, states: Mapping[str, dict[str, str]]) -> MemoryRow:
    return MemoryRow(**{**row.__dict__, "sinks": states.get(row.key, {})})


# -- one memory ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPage:
    key: str
    timestamp: str
    importance: int
    tags: list[str]
    metadata_json: str
    content: str
    forgotten_at: float | None
    deliveries: list[DeliveryRow]
    markdown_path: str | None
    markdown_exists: bool
    log_lines: list[tuple[int, str, str]]  # (line number, event, the line's JSON)


def memory(ob: Outbox, prefix: str) -> MemoryPage:
    """One record whole (raises ``NoSuchRecord`` or ``ValidationError`` for a bad prefix).

    Built like ``Catalog.show`` from the façade's reads, with the log lines found by
    ``log_lines`` rather than by parsing the whole log.
    """
    ob.refuse_if_empty()
    from outbox.operations.catalog import NoSuchRecord

    key = ob.catalog.resolve(prefix)
    stored = ob.get_records([key]).get(key)
    if stored is None:  # forgotten and purged between the two reads
        raise NoSuchRecord(f"no record with a key starting {prefix}")
    record = stored.record
    markdown = None if stored.forgotten else ob.markdown_path(key)
    lines = lines_naming(ob.settings.jsonl_path, key)
    return MemoryPage(
        key=key,
        timestamp=record.timestamp,
        importance=record.importance,
        tags=list(record.tags),
        metadata_json=json.dumps(record.metadata, indent=2, ensure_ascii=False, sort_keys=True),
        content=record.content,
        forgotten_at=stored.forgotten_at,
        deliveries=ob.deliveries_of([key]).get(key, []),
        markdown_path=None if markdown is None else str(markdown.absolute()),
        markdown_exists=markdown is not None and markdown.is_file(),
        log_lines=[
            (
                line.number,
                str(line.event.get("event", "?")),
                json.dumps(line.event, ensure_ascii=False),
            )
            for line in lines
        ],
    )


# -- dead letters -------------------------------------------------------------------------


@dataclass(frozen=True)
class DeadRow:
    key: str
    sink: str
    reason: str | None
    attempts: int
    last_error: str | None
    since: float
    snippet: str


def dead_letters(ob: Outbox, sink: str | None = None) -> dict[str, Any]:
    """The dead letters, oldest first, each with the start of its memory."""
    ob.refuse_if_empty()
    found = ob.dead.list(sink=sink, limit=DEAD_SHOWN)
    records = ob.get_records({row.key for row in found})
    rows = [
        DeadRow(
            key=row.key,
            sink=row.sink,
            reason=row.error_class,
            attempts=row.attempts,
            last_error=row.last_error,
            since=row.available_at,
            snippet=snippet(records[row.key].record.content, 100) if row.key in records else "",
        )
        for row in found
    ]
    total = _browse(ob).count(DeliveryState.DEAD, sink)
    return {"rows": rows, "total": total, "shown": len(rows), "sink": sink}
