"""The dashboard's store reads (``outbox/store/browse.py``) on SQLite and PostgreSQL: pages
of memories newest first under session, agent and tag filters, paged without gaps or
repeats, a rare tag found past the probe, and the last hour's deliveries and failures."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import event

from outbox import Outbox
from outbox.store import browse
from outbox.store.browse import BrowseQueries


def _fill(ob: Outbox, count: int) -> list[str]:
    """``count`` memories a second apart; every 7th tagged rare, sessions and agents in
    turn. Returns their keys, oldest first."""
    return [
        ob.add(
            f"memory number {number}",
            tags=["common", *(["rare"] if number % 7 == 0 else [])],
            metadata={"session_id": f"s{number % 3}", "agent": f"a{number % 2}"},
            timestamp=f"2026-11-29T08:{number // 60:02d}:{number % 60:02d}Z",
        ).key
        for number in range(count)
    ]


def _reads(ob: Outbox) -> BrowseQueries:
    return ob.storage.browse


def test_pages_run_newest_first_without_gaps_or_repeats(either_backend: Outbox) -> None:
    keys = _fill(either_backend, 23)
    seen: list[str] = []
    before = None
    while True:
        page = _reads(either_backend).memories(limit=5, before=before)
        seen += [row.key for row in page]
        if len(page) < 5:
            break
        before = (page[-1].timestamp, page[-1].key)
    assert seen == keys[::-1]


@pytest.mark.parametrize("probe", [1000, 2])  # found near the top, and past the probe
def test_filters_agree_with_the_records(
    either_backend: Outbox, monkeypatch: pytest.MonkeyPatch, probe: int
) -> None:
    monkeypatch.setattr(browse, "TAG_PROBE", probe)
    keys = _fill(either_backend, 30)
    reads = _reads(either_backend)
    rare = [key for number, key in enumerate(keys) if number % 7 == 0][::-1]
    assert [row.key for row in reads.memories(limit=50, tag="rare")] == rare
    assert [row.key for row in reads.memories(limit=2, tag="rare")] == rare[:2]
    cursor = reads.memories(limit=2, tag="rare")[-1]
    after = reads.memories(limit=50, tag="rare", before=(cursor.timestamp, cursor.key))
    assert [row.key for row in after] == rare[2:]
    both = reads.memories(limit=50, tag="rare", session_id="s0", agent="a0")
    assert [row.key for row in both] == [
        key for number, key in enumerate(keys) if number % 42 == 0
    ][::-1]
    assert all(row.session_id == "s0" and row.agent == "a0" for row in both)
    assert reads.memories(limit=50, tag="nobody-has-this") == []
    session = reads.memories(limit=50, session_id="s1")
    assert [row.key for row in session] == [k for n, k in enumerate(keys) if n % 3 == 1][::-1]
    assert session[0].content == "memory number 28" and session[0].tags == ["common", "rare"]


def test_activity_counts_deliveries_and_failures_by_minute(either_backend: Outbox) -> None:
    keys = _fill(either_backend, 6)
    either_backend.drain(timeout=20)
    now = time.time()
    sink = either_backend.settings.sinks[0]
    found = _reads(either_backend).activity([sink], since=now - 3600, width=60, slices=60)
    assert sum(found[sink].delivered) == len(keys)
    assert found[sink].delivered[-1] == len(keys)  # all in the last minute
    assert sum(found[sink].failed) == 0
    earlier = _reads(either_backend).activity([sink], since=now + 60, width=60, slices=60)
    assert sum(earlier[sink].delivered) == 0


def test_activity_counts_a_dead_letter_and_a_retry_as_failures(
    outbox: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_FAULTY_REJECT", "poison")
    outbox.add("a poison memory")
    outbox.add("a good memory")
    outbox.drain(timeout=20)
    monkeypatch.setenv("OUTBOX_FAULTY_FAIL_RATE", "1")
    outbox.add("a memory whose first try fails")
    outbox.drain(timeout=2)
    sink = outbox.settings.sinks[0]
    now = time.time()
    found = _reads(outbox).activity([sink], since=now - 600, width=60, slices=10)
    assert sum(found[sink].delivered) == 1
    assert sum(found[sink].failed) == 2  # one dead, one pending after a failure


def test_the_queries_use_indexes(outbox: Outbox) -> None:
    """EXPLAIN QUERY PLAN of the statements really run: a page walks an index of the
    graph (recency, or session when the planner prefers it) and scans no table, and the
    chart's delivered and dead counts come from one index range with no table read."""
    _fill(outbox, 5)
    reads = _reads(outbox)
    ran: list[tuple[str, Any]] = []

    def grab(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        ran.append((statement, parameters))

    def plans(call: Callable[[], object]) -> list[str]:
        ran.clear()
        event.listen(outbox.reader, "before_cursor_execute", grab)
        try:
            call()
        finally:
            event.remove(outbox.reader, "before_cursor_execute", grab)
        with outbox.reader.connect() as conn:
            return [
                " | ".join(
                    row[3] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)
                )
                for sql, params in ran
            ]

    (page,) = plans(lambda: reads.memories(limit=50))
    assert "ix_graph_nodes_label_ts" in page and "SCAN records" not in page, page
    for query in ({"session_id": "s1"}, {"agent": "a1"}):
        (walk,) = plans(lambda query=query: reads.memories(limit=50, **query))
        assert "SEARCH graph_nodes USING INDEX ix_graph_nodes_" in walk, walk
        assert "SCAN records" not in walk and "SCAN graph_nodes" not in walk, walk
    delivered, dead, retrying = plans(
        lambda: reads.activity([outbox.settings.sinks[0]], since=0, width=60, slices=60)
    )
    assert "COVERING INDEX ix_deliveries_due" in delivered, delivered
    assert "COVERING INDEX ix_deliveries_due" in dead, dead
    assert "INDEX ix_deliveries_due" in retrying, retrying


def test_tags_with_quotes_and_accents_are_found_past_the_probe(
    either_backend: Outbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tag scan's cheap text test must never drop a row the exact test admits."""
    monkeypatch.setattr(browse, "TAG_PROBE", 1)
    odd = ["café", 'say "hi"', "back\\slash", "雪", "a,b"]
    keys = {tag: either_backend.add(f"tagged {tag}", tags=[tag, "x"]).key for tag in odd}
    either_backend.add("the newest, tagged otherwise", tags=["other"])
    for tag, key in keys.items():
        assert [row.key for row in _reads(either_backend).memories(limit=5, tag=tag)] == [key]
    assert _reads(either_backend).memories(limit=5, tag="caf") == []
