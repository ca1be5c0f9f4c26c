"""Hybrid recall: the lexical leg over every record, filters inside each leg's own query,
relevance and its floor, the fusion's pure rules, the migration that refills the index, and
``outbox search`` showing what found each hit."""

from __future__ import annotations

import concurrent.futures
import json
import os
from dataclasses import FrozenInstanceError
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from sqlalchemy import text

from outbox import Outbox, Settings, ValidationError, load_settings
from outbox.core.recall_filter import TAG_PREFIX, RecallFilter
from outbox.core.record import build_record
from outbox.faces.demo import TURNS
from outbox.faces.ui import pages
from outbox.memory_core import MemoryService, recall_view
from outbox.recall.dates import DateWindow, named_dates
from outbox.recall.fusion import (
    CONTEXT_REACH,
    KEEP_SHARE,
    WORDS_ALONE,
    Candidate,
    Fusion,
    TermWeights,
    candidates,
    fuse,
    relevant,
    stem,
    vector_relevance,
    with_context,
    with_dates,
)
from outbox.recall.service import RecallAnswer, RecallHit
from outbox.sinks.chroma_documents import chroma_metadata
from outbox.store import migrate
from outbox.store.lexical import QUERY_STOP_WORDS, match_terms
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
    behind=st.one_of(st.none(), st.floats(0.0, 2.0)),
    lead=st.floats(0.0, 1.0),
)


@given(st.lists(candidate, unique_by=lambda c: c.key), st.floats(0.0, 1.0), st.integers(1, 20))
def test_fusion_orders_deterministically_and_keeps_the_floor(
    items: list[Candidate], floor: float, limit: int
) -> None:
    scored = fuse(items, Fusion())
    assert [s for _, s in scored] == sorted((s for _, s in scored), reverse=True)
    assert fuse(list(reversed(items)), Fusion()) == scored
    kept = relevant(scored, floor, limit)
    meaning = [
        vector_relevance(i.distance, i.behind) * (1.0 - i.coverage)
        for i in items
        if i.behind is not None
    ]
    # Words alone must hold half the query when the vector leg found nothing near it
    # beyond the words it shares.
    need = max(floor, WORDS_ALONE) if meaning and max(meaning) < floor else floor
    answered = any(item.relevance >= need for item in items)
    assert (
        kept
        == ([p for p in scored if p[0].relevance >= floor * KEEP_SHARE] if answered else [])[:limit]
    )
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
    assert meta[TAG_PREFIX + "x"] is True
    where = filters.chroma_where()
    assert where is not None
    for clause in where["$and"]:
        ((key, test),) = clause.items()
        value = meta[key]
        ok = value == test if not isinstance(test, dict) else value >= next(iter(test.values()))
        assert ok, key
    assert filters.admits(record.timestamp, 7, ["x"], record.metadata)
    assert not filters.admits(record.timestamp, 5, ["x"], record.metadata)


@given(st.lists(candidate, min_size=1, unique_by=lambda c: c.key), st.data())
def test_dates_lift_exactly_the_dated_hits(items: list[Candidate], data: st.DataObject) -> None:
    scored = fuse(items, Fusion())
    dated = data.draw(st.sets(st.sampled_from([item.key for item in items])))
    lifted = with_dates(scored, dated, Fusion())
    before, after = dict((i.key, s) for i, s in scored), dict((i.key, s) for i, s in lifted)
    assert after == {
        key: score + (Fusion().date_bonus if key in dated else 0.0) for key, score in before.items()
    }
    assert [s for _, s in lifted] == sorted((s for _, s in lifted), reverse=True)
    assert {item.key for item, _ in lifted if "date" in item.legs} == dated


def test_a_neighbour_joins_at_what_its_own_words_are_worth() -> None:
    """A turn only context found still counts its share of the query's words, so of two
    neighbours lent the same score the one that shares the query's words comes first."""
    source = Candidate(key="s", lexical_rank=1, coverage=1.0)
    scored = fuse([source], Fusion())
    near = [Candidate(key="a", coverage=0.0), Candidate(key="b", coverage=0.5)]
    lifted = with_context(scored, {"s": near}, Fusion())
    assert [item.key for item, _ in lifted] == ["s", "b", "a"]


@given(
    st.dates(date(1990, 1, 1), date(2099, 12, 31)),
    st.sampled_from(
        [
            "on {d:%B} {d.day}, {d.year}",
            "on {d.day} {d:%B}, {d.year}",
            "on the {d.day}th of {d:%B} {d.year}",
            "on {d:%b} {d.day} {d.year}",
            "on {d:%Y-%m-%d}",
        ]
    ),
)
def test_a_named_day_is_that_day_whatever_its_wording(day: date, wording: str) -> None:
    (window,) = named_dates("What did we decide " + wording.format(d=day) + "?")
    noon = datetime(day.year, day.month, day.day, 12, tzinfo=UTC)
    assert window.holds(noon) and window.holds(noon.replace(hour=0))
    assert not window.holds(noon + timedelta(days=1)) and not window.holds(noon - timedelta(days=1))


def test_months_years_and_what_is_not_a_date() -> None:
    (month,) = named_dates("What setback came in October 2023?")
    assert month == DateWindow(date(2023, 10, 1), date(2023, 11, 1))
    (december,) = named_dates("the plan for December 2023")
    assert december.end == date(2024, 1, 1)
    (year,) = named_dates("How often did we go to the beach in 2023?")
    assert year == DateWindow(date(2023, 1, 1), date(2024, 1, 1))
    (bare,) = named_dates("Where did we camp in July?")
    assert bare.holds(datetime(2019, 7, 31, tzinfo=UTC)) and not bare.holds(
        datetime(2019, 8, 1, tzinfo=UTC)
    )
    assert named_dates("May I ask what the port is? 2023 records, 31 February 2024") == []


def test_query_stop_words_are_dropped_unless_nothing_else_is_left() -> None:
    assert match_terms("What did Melanie do to destress?") == ["destress", "melanie"]
    assert match_terms("What was it?") == ["what", "was", "it"]
    assert {"what", "when", "did", "the"} <= QUERY_STOP_WORDS


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
    """Migration 0005 run again over a purged index refills it, and a third run adds
    nothing; later migrations (not idempotent) are left out of the replay."""
    from alembic import command

    with Outbox.open(settings) as ob:
        key = _write(ob, "a wren sings at dawn")
        engine = ob.storage.engine
        with engine.begin() as conn:
            head = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            conn.execute(text("DELETE FROM records_fts"))
        assert ob.lexical_matches("wren", limit=5).hits == []
        for _ in range(2):  # idempotent: a second run adds nothing
            with engine.begin() as conn:
                conn.execute(text("UPDATE alembic_version SET version_num = '0004'"))
                config = migrate.alembic_config()
                config.attributes["connection"] = conn
                command.upgrade(config, "0005")
        with engine.begin() as conn:
            assert conn.execute(text("SELECT count(*) FROM records_fts")).scalar() == 1
            conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": head})
        assert [k for k, _ in ob.lexical_matches("wren", limit=5).hits] == [key]


def test_stop_words_do_not_outrank_what_the_question_asks_about(outbox: Outbox) -> None:
    """Short chit-chat that shares only a question's wording must not push the memory that
    answers it out of the first places."""
    for number in range(30):
        _write(outbox, f"What did you do? What did you do there? {number}")
    wanted = _write(outbox, "We picked the heron logo for the new signage")
    hits = outbox.lexical_matches("What did we pick for the logo?", limit=3).hits
    assert hits[0][0] == wanted


def test_context_reaches_two_turns_each_way_within_the_session(outbox: Outbox) -> None:
    start = datetime(2024, 3, 1, 9, tzinfo=UTC)
    keys = [
        _write(
            outbox,
            f"turn {number} of the chat about {'the kayak trip' if number == 4 else 'weather'}",
            timestamp=start + timedelta(minutes=number),
            metadata={"session_id": "trip"},
        )
        for number in range(9)
    ]
    _write(outbox, "another session's kayak note", timestamp=start, metadata={"session_id": "x"})
    near = outbox.session_neighbours([keys[4]])[keys[4]]
    assert CONTEXT_REACH == 2
    assert near == [keys[3], keys[2], keys[5], keys[6]]
    service = MemoryService(outbox)
    answer = service.query_raw_memories("kayak trip", n_results=10, session_id="trip")
    found = {row["id"]: row["legs"] for row in answer["results"]}
    assert "lexical" in found[keys[4]]
    assert all("context" in found[keys[n]] for n in (2, 3, 5, 6))
    assert keys[1] not in found and keys[7] not in found


def test_a_named_day_brings_that_days_memory_first(outbox: Outbox) -> None:
    service = MemoryService(outbox)
    said = {
        day: service.remember(
            "We talked about the garden shed roof.",
            session_id="home",
            timestamp=datetime(2023, 7, day, 18, tzinfo=UTC),
        ).key
        for day in (3, 7, 12)
    }
    for day, key in said.items():
        answer = service.query_raw_memories(
            f"What did we say about the shed on {day} July, 2023?", session_id="home"
        )
        first = answer["results"][0]
        assert first["id"] == key and "date" in first["legs"]
    plain = service.query_raw_memories("What did we say about the shed?", session_id="home")
    assert all("date" not in row["legs"] for row in plain["results"])


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
    from outbox.faces.cli import main

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


# -- Outbox.recall: the library call memory-core, the CLI, MCP and the dashboard shape ----


def test_recall_returns_typed_hits_filtered_and_held_to_the_floor(outbox: Outbox) -> None:
    wanted = _write(
        outbox,
        "the heron nests by the old quarry",
        importance=8,
        tags=["birds"],
        metadata={"session_id": "s", "agent": "ana"},
    )
    other = _write(outbox, "a heron by the quarry elsewhere", metadata={"session_id": "t"})
    answer = outbox.recall(
        "heron quarry", session_id="s", agent="ana", tags=["birds"], min_importance=8
    )
    assert isinstance(answer, RecallAnswer) and answer.degraded is None
    assert answer.query == "heron quarry" and answer.min_relevance == 0.30
    (hit,) = answer.hits
    assert isinstance(hit, RecallHit)
    assert (hit.key, hit.content, hit.session_id, hit.agent) == (
        wanted,
        "the heron nests by the old quarry",
        "s",
        "ana",
    )
    assert (hit.tags, hit.importance, hit.metadata["session_id"]) == (("birds",), 8, "s")
    assert (hit.legs, hit.source, hit.lexical_rank) == (("lexical",), "lexical", 1)
    assert hit.bm25 is not None and hit.vector_rank is None and hit.distance is None
    assert hit.relevance == 1.0 and hit.score > 0 and hit.timestamp
    with pytest.raises(FrozenInstanceError):
        hit.key = other  # type: ignore[misc]
    # Filters hold inside the query: another session, a later window, a higher importance.
    assert [h.key for h in outbox.recall("heron quarry", session_id="t").hits] == [other]
    assert outbox.recall("heron quarry", since=date(2999, 1, 1)).hits == ()
    assert outbox.recall("heron quarry", min_importance=9).hits == ()
    # The floor: a query whose rarest word nothing holds is not answered, unless asked to.
    assert outbox.recall("heron marmot").hits == ()
    loose = outbox.recall("heron marmot", min_relevance=0.0)
    assert {h.key for h in loose.hits} == {wanted, other}
    assert all(0.0 < h.relevance < 0.30 for h in loose.hits)
    assert len(outbox.recall("heron", limit=1).hits) == 1
    with pytest.raises(ValidationError):
        outbox.recall("   ")


def test_the_faces_only_shape_what_recall_returns(outbox: Outbox) -> None:
    """memory-core's answer and the dashboard's rows are ``Outbox.recall``'s hits, shaped."""
    service = MemoryService(outbox)
    key = service.add_memory("where is the heron?", "look it up", "by the quarry")["id"]
    query = "heron quarry"
    assert service.query_raw_memories(query) == recall_view(outbox.recall(query))
    (row,) = pages.memories(outbox, pages.Filters(q=query))["rows"]
    (hit,) = outbox.recall(query, limit=pages.PAGE).hits
    assert (row.key, row.legs, row.relevance) == (key, list(hit.legs), round(hit.relevance, 4))
    assert row.snippet == "where is the heron? → by the quarry"


def test_recall_finds_by_both_legs_after_a_drain(chroma_service: MemoryService) -> None:
    ob = chroma_service.outbox
    try:
        for turn in TURNS:
            chroma_service.add_memory(*turn, session_id="a")
        wanted = ob.add(
            "The nightly backfill moved to the spare host.",
            tags=["ops"],
            metadata={"session_id": "b"},
        ).key
        (before,) = ob.recall("nightly backfill spare host", session_id="b").hits
        assert (before.key, before.legs) == (wanted, ("lexical",))
        assert ob.drain(timeout=120).ok
        question = "when does the nightly backfill run?"
        for options in ({"session_id": "b"}, {"tags": ["ops"]}):
            (hit,) = ob.recall(question, limit=1, min_relevance=0.0, **options).hits
            assert hit.key == wanted and {"lexical", "vector"} <= set(hit.legs)
            assert hit.source == "vector" and hit.vector_rank == 1
            assert hit.distance is not None and hit.bm25 is not None
        assert ob.recall("banana smoothie recipe").hits == ()
        assert ob.recaller.vector_index() is ob.recaller.vector_index()  # opened once
    finally:
        chroma_service.close()


def test_a_vector_index_that_cannot_be_reached_leaves_the_lexical_leg(tmp_path: Path) -> None:
    """When the vector leg fails (no server at the URL), the answer is the lexical leg's
    and says why."""
    from tests.chroma_server import free_port

    settings = load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks="chroma",
        chroma_url=f"http://127.0.0.1:{free_port()}",
    )
    with Outbox.open(settings) as ob:
        wanted = ob.add("The heron nests by the quarry.", metadata={"session_id": "a"}).key
        ob.add("The nightly backfill moved to the spare host.", metadata={"session_id": "a"})
        for _ in range(2):  # the first recall opens the index, the second reuses it
            answer = ob.recall("where does the heron nest?", session_id="a")
            assert answer.degraded == "vector index unavailable (ConnectError)"
            assert (answer.hits[0].key, answer.hits[0].legs) == (wanted, ("lexical",))
            assert not any("vector" in hit.legs for hit in answer.hits)


def test_recalls_from_many_threads_answer_as_one_at_a_time(
    chroma_service: MemoryService,
) -> None:
    """Concurrent recalls of one outbox share its store's pool and its Chroma connection:
    each gets its own answer, the one it gets alone."""
    ob = chroma_service.outbox
    questions = [prompt for prompt, _thought, _response in TURNS] + [
        "when does the nightly backfill run?",
        "banana smoothie recipe",
    ]
    try:
        for turn in TURNS:
            chroma_service.add_memory(*turn, session_id="a")
        ob.add("The nightly backfill moved to the spare host.", metadata={"session_id": "a"})
        assert ob.drain(timeout=120).ok
        alone = {q: ob.recall(q, session_id="a", min_relevance=0.0) for q in questions}
        assert all(answer.degraded is None for answer in alone.values())
        assert sum("vector" in hit.legs for a in alone.values() for hit in a.hits) >= len(TURNS)
        with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
            asked = [q for q in questions for _ in range(4)]
            together = list(
                pool.map(lambda q: ob.recall(q, session_id="a", min_relevance=0.0), asked)
            )
        for question, answer in zip(asked, together, strict=True):
            assert answer == alone[question], question
    finally:
        chroma_service.close()
