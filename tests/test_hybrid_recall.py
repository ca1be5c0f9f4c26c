"""Hybrid recall: the lexical leg over every record, filters inside each leg's own query,
relevance and its floor, the fusion's pure rules, the migration that refills the index, and
``outbox search`` showing what found each hit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from sqlalchemy import text

from outbox import Outbox, Settings, load_settings
from outbox.demo import TURNS
from outbox.memory_core import MemoryService
from outbox.recall import (
    Candidate,
    Fusion,
    RecallFilter,
    TermWeights,
    candidates,
    fuse,
    relevant,
    stem,
    with_context,
)
from outbox.record import build_record
from outbox.sinks.chroma_documents import TAG_KEY_PREFIX, chroma_metadata
from outbox.store import migrate
from tests.conftest import FAULTY

keys_ = st.text("abcdef", min_size=1, max_size=4)
distance = st.one_of(st.none(), st.floats(0.0, 2.0))
candidate = st.builds(
    Candidate,
    key=keys_,
    coverage=st.floats(0.0, 1.0),
    lexical_rank=st.one_of(st.none(), st.integers(1, 50)),
    vector_rank=st.one_of(st.none(), st.integers(1, 50)),
    distance=distance,
)


@given(st.lists(candidate, unique_by=lambda c: c.key), st.floats(0.0, 1.0), st.integers(1, 20))
def test_fusion_orders_deterministically_and_keeps_the_floor(
    items: list[Candidate], floor: float, limit: int
) -> None:
    scored = fuse(items, Fusion())
    assert [s for _, s in scored] == sorted((s for _, s in scored), reverse=True)
    assert fuse(list(reversed(items)), Fusion()) == scored
    kept = relevant(scored, floor, limit)
    assert len(kept) <= limit and all(item.relevance >= floor for item, _ in kept)
    assert all(0.0 <= item.relevance <= 1.0 for item in items)


@given(st.lists(candidate, min_size=1, unique_by=lambda c: c.key), keys_)
def test_context_lifts_neighbours_and_never_lowers_a_score(
    items: list[Candidate], near: str
) -> None:
    scored = fuse(items, Fusion())
    top = scored[0][0]
    assume(scored[0][1] > 0 and near != top.key)  # a hit some leg ranked; not itself
    lifted = with_context(scored, {top.key: [Candidate(key=near)]}, Fusion())
    before, after = dict((i.key, s) for i, s in scored), dict((i.key, s) for i, s in lifted)
    assert len(after) == len(lifted) and set(before) <= set(after)
    assert all(after[key] >= score for key, score in before.items())
    found = next(item for item, _ in lifted if item.key == near)
    assert "context" in found.legs and found.relevance >= top.relevance


@given(st.lists(st.tuples(keys_, st.floats(0, 50)), max_size=8))
def test_candidates_rank_from_one_per_leg(hits: list[tuple[str, float]]) -> None:
    found = {item.key: item for item in candidates(hits, [], {})}
    first = {}
    for rank, (key, _score) in enumerate(hits, start=1):
        first[key] = rank  # a repeated key keeps its last rank, as a dict update does
    assert {key: item.lexical_rank for key, item in found.items()} == first


@given(st.text("abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=12))
def test_stem_is_stable(word: str) -> None:
    assert stem(stem(word)) == stem(stem(stem(word))) or len(stem(word)) <= len(word)


def test_coverage_weighs_rare_words_and_ignores_the_too_common() -> None:
    weights = TermWeights.of({"heron": 2, "the": 600, "banana": 0}, total=1000, cap=501)
    assert "the" not in weights.weights
    assert weights.coverage("The herons nested") == pytest.approx(
        weights.weights["heron"] / sum(weights.weights.values())
    )
    assert weights.coverage("nothing here") == 0.0


def test_filter_and_chroma_where_say_the_same_thing() -> None:
    filters = RecallFilter.of(
        session_id="s", agent="a", tags="x", min_importance=6, since="2026-01-01"
    )
    record = build_record(
        "a memory", tags=["x"], importance=7, metadata={"session_id": "s", "agent": "a"}
    )
    meta = chroma_metadata(record)
    assert meta[TAG_KEY_PREFIX + "x"] is True
    where = filters.chroma_where()
    assert where is not None
    for clause in where["$and"]:
        ((key, test),) = clause.items()
        value = meta[key]
        ok = value == test if not isinstance(test, dict) else value >= next(iter(test.values()))
        assert ok, key
    assert filters.admits(record.timestamp, 7, ["x"], record.metadata)
    assert not filters.admits(record.timestamp, 5, ["x"], record.metadata)


# -- the lexical leg, on either database ---------------------------------------------------


def _write(ob: Outbox, content: str, **fields: object) -> str:
    receipt = ob.add(content, **fields)  # type: ignore[arg-type]
    return receipt.key


@pytest.fixture
def outbox(either_backend: Outbox) -> Outbox:
    return either_backend


def test_filters_apply_inside_the_lexical_query(outbox: Outbox) -> None:
    """Twenty better matches elsewhere would fill a LIMIT of 3 before a post-filter ran."""
    for number in range(20):
        _write(outbox, f"heron heron heron quarry {number}", metadata={"session_id": "a"})
    wanted = _write(
        outbox,
        "one heron by the lake",
        importance=9,
        tags=["birds"],
        metadata={"session_id": "b", "agent": "ana"},
    )
    for filters in (
        RecallFilter(session_id="b"),
        RecallFilter(agent="ana"),
        RecallFilter(tags=("birds",)),
        RecallFilter(min_importance=9),
    ):
        hits = outbox.lexical_matches("heron", limit=3, filters=filters).hits
        assert [key for key, _ in hits] == [wanted], filters
    later = RecallFilter.of(since="2999-01-01")
    assert outbox.lexical_matches("heron", limit=3, filters=later).hits == []


def test_the_lexical_leg_finds_delivered_records(outbox: Outbox) -> None:
    key = _write(outbox, "the kestrel hovers over the quarry")
    assert outbox.drain(timeout=30).ok
    assert outbox.deliveries_of([key])[key][0].state == "delivered"
    assert [k for k, _ in outbox.lexical_matches("kestrel", limit=5).hits] == [key]


def test_the_migration_refills_purged_rows_once(settings: Settings) -> None:
    with Outbox.open(settings) as ob:
        key = _write(ob, "a wren sings at dawn")
        with ob.storage.engine.begin() as conn:
            conn.execute(text("DELETE FROM records_fts"))
            conn.execute(text("UPDATE alembic_version SET version_num = '0004'"))
        assert ob.lexical_matches("wren", limit=5).hits == []
        engine = ob.storage.engine
        assert migrate.upgrade(engine) is True
        with engine.connect() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '0004'"))
            conn.commit()
        assert migrate.upgrade(engine) is True  # idempotent: a second run adds nothing
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM records_fts")).scalar() == 1
        assert [k for k, _ in ob.lexical_matches("wren", limit=5).hits] == [key]


# -- both legs, with the embedded Chroma ---------------------------------------------------


@pytest.fixture
def chroma_service(tmp_path: Path) -> MemoryService:
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "md", sinks="chroma"
    )
    return MemoryService(Outbox.open(settings))


def test_both_legs_filter_inside_and_unrelated_queries_return_nothing(
    chroma_service: MemoryService,
) -> None:
    service = chroma_service
    try:
        for turn in TURNS:
            service.add_memory(*turn, session_id="a")
        wanted = service.remember(
            "The nightly backfill moved to the spare host.", tags=["ops"], session_id="b"
        ).key
        assert service.outbox.drain(timeout=120).ok
        for options in ({"session_id": "b"}, {"tags": ["ops"]}):
            answer = service.query_raw_memories(
                "when does the nightly backfill run?", n_results=1, min_relevance=0.0, **options
            )
            (hit,) = answer["results"]
            assert hit["id"] == wanted and {"lexical", "vector"} <= set(hit["legs"])
            assert hit["distance"] is not None and hit["bm25"] is not None
        nothing = service.query_raw_memories("banana smoothie recipe")
        assert nothing["count"] == 0
    finally:
        service.close()


def test_search_on_the_command_line_shows_legs_and_relevance(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from outbox.cli import main

    with Outbox.open(settings) as ob:
        _write(ob, "the otter dives in the quarry", tags=["river"])
    for name in [name for name in os.environ if name.startswith("OUTBOX_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OUTBOX_HOME", str(settings.home))
    monkeypatch.setenv("OUTBOX_MARKDOWN_DIR", str(settings.markdown_dir))
    monkeypatch.setenv("OUTBOX_SINKS", FAULTY)
    assert main(["search", "otter quarry", "--tag", "river"]) == 0
    table = capsys.readouterr().out
    assert "legs" in table and "relevance" in table and "lexical" in table
    assert main(["search", "otter", "--tag", "lake", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 0
