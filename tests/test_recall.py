"""The lexical overlay of recall (``recall.pending_matches``) on SQLite and PostgreSQL.

Memory-core runs it on every recall, so its cost must stay flat however large the backlog:
the rarest words are ranked over all their matches, words too common for the budget only
among the newest records. These tests pin what callers get (best first, pending records
only, the session filter, never more than the limit) and, on SQLite, that the work done per
lookup does not grow with the backlog.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest
from sqlalchemy import event, text

from outbox import Outbox
from outbox.core.record import build_record
from outbox.store import lexical
from tests.pg import NOOP_SINK

SINK = NOOP_SINK


@pytest.fixture
def outbox(either_backend: Outbox) -> Outbox:
    return either_backend


def _seed(ob: Outbox, contents: list[str], session_id: str | None = None) -> list[str]:
    """Write records straight through storage (no mirrors: fast enough for a backlog)."""
    keys = []
    metadata = {"session_id": session_id} if session_id else None
    with ob.storage.engine.begin() as conn:
        for content in contents:
            record = build_record(content, metadata=metadata)
            seq = ob.storage.records.insert_record(
                conn,
                record,
                sinks=(SINK,),
                markdown_name=f"{record.key}.md",
                origin="test",
                now=1.0,
            )
            assert seq is not None
            keys.append(record.key)
    return keys


def _filler(number: int) -> str:
    return f"entry {number}: " + " ".join(f"w{(number * 7 + step) % 97}" for step in range(12))


def _lookup(ob: Outbox, query: str, **options: Any) -> list[str]:
    hits = ob.storage.recall.pending_matches(query, vector_sink=SINK, **{"limit": 10, **options})
    return [key for key, _score in hits]


def test_telling_terms_are_the_rarest_that_fit_the_budget_together() -> None:
    counts = {"common": 11, "rare": 2, "absent": 0, "middling": 6, "also": 3}
    assert lexical.telling_terms(counts, 10) == ["rare", "also"]
    assert lexical.telling_terms(counts, 11) == ["rare", "also", "middling"]
    assert lexical.telling_terms({"common": 11, "absent": 0}, 10) == []


def test_matches_are_pending_best_first_and_filtered_by_session(outbox: Outbox) -> None:
    (delivered,) = _seed(outbox, ["heron heron lighthouse keeper"])
    claims = outbox.storage.deliveries.claim(SINK, "t", 10, 60.0)
    assert [claim.key for claim in claims] == [delivered]
    outbox.storage.deliveries.settle("t", [(claims[0].delivery_id, "done")], [])
    once, twice, neither = _seed(
        outbox, ["the heron by the quay", "heron heron lighthouse", "nothing to see"]
    )
    (elsewhere,) = _seed(outbox, ["a heron elsewhere"], session_id="other")

    found = _lookup(outbox, "heron lighthouse")
    assert found[0] == twice and sorted(found) == sorted([twice, once, elsewhere])
    assert neither not in found and delivered not in found
    assert _lookup(outbox, "heron", session_id="other") == [elsewhere]
    assert _lookup(outbox, "heron lighthouse", limit=2) == found[:2]
    assert _lookup(outbox, "? !") == []


def test_a_rare_word_is_found_however_deep_in_the_backlog(outbox: Outbox) -> None:
    (oldest,) = _seed(outbox, ["zanzibar staging credentials w1"])
    _seed(outbox, [_filler(number) for number in range(60)])
    assert _lookup(outbox, "where are the zanzibar w1 credentials", budget=10)[0] == oldest


def test_common_words_only_rank_the_newest_records(outbox: Outbox) -> None:
    # The old records are the better textual matches (short, the word thrice): an unbounded
    # ranking over every match returns them first. Bounded, only the newest 10 compete.
    _seed(outbox, [f"common common common {n}" for n in range(40)])
    newest = _seed(outbox, [f"{_filler(n)} common" for n in range(10)])
    found = _lookup(outbox, "common", budget=10, limit=25)
    assert found and set(found) <= set(newest)
    assert len(_lookup(outbox, "common", budget=10, limit=3)) == 3
    if outbox.storage.dialect == "postgresql":
        # Once ANALYZE has counted the word, PostgreSQL knows it is common without a probe.
        with outbox.engine.begin() as conn:
            conn.execute(text("ANALYZE records"))
        assert _lookup(outbox, "common", budget=10, limit=25) == found


def _steps(ob: Outbox, query: str, budget: int) -> int:
    """SQLite VM instructions one lookup executes (in hundreds): the work, without a clock."""
    counted = [0]

    def count() -> int:
        counted[0] += 1
        return 0

    def on_checkout(dbapi: sqlite3.Connection, _record: Any, _proxy: Any) -> None:
        dbapi.set_progress_handler(count, 100)

    def on_checkin(dbapi: sqlite3.Connection, _record: Any) -> None:
        dbapi.set_progress_handler(None, 0)

    event.listen(ob.reader, "checkout", on_checkout)
    event.listen(ob.reader, "checkin", on_checkin)
    try:
        assert _lookup(ob, query, budget=budget)
    finally:
        event.remove(ob.reader, "checkout", on_checkout)
        event.remove(ob.reader, "checkin", on_checkin)
    return counted[0]


@pytest.mark.parametrize("either_backend", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    "query", ["w3 w5 w8 w13 entry", "heron w3", "every w3 heron", "heron entry 17"]
)
def test_the_work_per_lookup_does_not_grow_with_the_backlog(outbox: Outbox, query: str) -> None:
    def backlog(start: int, count: int) -> list[str]:
        return [
            _filler(number) + (" heron" if number % 40 == 0 else "")
            for number in range(start, start + count)
        ]

    _seed(outbox, backlog(0, 300))
    small = _steps(outbox, query, budget=30)
    _seed(outbox, backlog(300, 3000))
    large = _steps(outbox, query, budget=30)
    assert large < 1.5 * small, (small, large)
