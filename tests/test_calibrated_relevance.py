"""Relevance calibrated against the query's background: a clear nearest paraphrase is kept,
a query nothing answers still gets nothing (pure rules, then real Chroma and MiniLM), and
the paraphrase benchmark's set is what it claims to be."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.paraphrase_set import PAIRS, UNRELATED
from outbox import Outbox, load_settings
from outbox.recall.fusion import (
    BACKGROUND_MIN,
    BACKGROUND_RANK,
    DISTANCE_FULL,
    MIN_RELEVANCE,
    WORDS_ALONE,
    Candidate,
    Fusion,
    answering,
    background,
    candidates,
    fuse,
    relevant,
    stem,
    vector_relevance,
)
from outbox.store.lexical import match_terms

distances = st.lists(st.floats(0.0, 2.0), max_size=40).map(sorted)


@given(distances)
def test_the_background_is_the_median_of_the_second_to_twentieth(
    found: list[float],
) -> None:
    behind = background(found)
    if len(found) < BACKGROUND_MIN:
        assert behind is None
    else:
        assert behind == statistics.median(found[1:BACKGROUND_RANK])


@given(st.floats(0.0, 2.0), st.floats(0.0, 2.0), st.floats(0.0, 2.0))
def test_calibrated_relevance_never_reads_lower_than_distance_alone(
    near: float, far: float, behind: float
) -> None:
    near, far = sorted((near, far))
    alone, calibrated = vector_relevance(near), vector_relevance(near, behind)
    assert 0.0 <= alone <= calibrated <= 1.0
    assert vector_relevance(far, behind) <= calibrated  # nearer never reads less sure
    if behind > DISTANCE_FULL:
        assert vector_relevance(behind, behind) == vector_relevance(behind)  # as far as the rest


def test_a_clear_nearest_reads_relevant_where_its_distance_alone_does_not() -> None:
    # The case: the cat memory at 0.635, every other memory at 0.85 or more.
    assert vector_relevance(0.635) < MIN_RELEVANCE
    assert vector_relevance(0.635, behind=0.95) >= MIN_RELEVANCE
    # As far as a query's twentieth-nearest memory: nothing stands out, nothing answers.
    assert vector_relevance(0.82, behind=0.86) < MIN_RELEVANCE


def test_only_the_vector_leg_s_nearest_has_a_lead() -> None:
    vector = [("a", 0.50), ("b", 0.62), ("c", 0.70), ("d", 0.80), ("e", 0.90)]
    behind = background([d for _, d in vector])
    found = {item.key: item for item in candidates([], vector, {}, behind)}
    assert behind == pytest.approx(0.75)  # the median of 0.62, 0.70, 0.80 and 0.90
    assert found["a"].lead == pytest.approx((0.62 - 0.50) / (0.75 - DISTANCE_FULL))
    assert all(found[key].lead == 0.0 for key in "bcde")
    assert all(item.behind == behind for item in found.values())
    no_background = candidates([], vector[:2], {}, background([0.50, 0.62]))
    assert all(item.lead == 0.0 for item in no_background)


def test_a_clear_nearest_meaning_outranks_one_shared_word_only_when_words_say_little() -> None:
    nearest = Candidate(key="n", vector_rank=1, distance=0.55, behind=0.9, lead=0.3)
    one_word = Candidate(key="w", lexical_rank=1, coverage=0.2, vector_rank=12, distance=0.85)
    assert next(item.key for item, _ in fuse([nearest, one_word], Fusion())) == "n"
    assert next(item.key for item, _ in fuse([nearest, one_word], Fusion(lead_weight=0.0))) == "w"
    every_word = Candidate(key="w", lexical_rank=1, coverage=1.0, vector_rank=12, distance=0.85)
    assert next(item.key for item, _ in fuse([nearest, every_word], Fusion())) == "w"


def test_words_alone_answer_only_with_half_the_query_when_meaning_finds_nothing() -> None:
    far = Candidate(key="v", vector_rank=1, distance=0.85, behind=0.9)
    partial = Candidate(key="p", lexical_rank=1, coverage=0.44)
    held = Candidate(key="h", lexical_rank=1, coverage=0.6)
    assert answering([(far, 0.1), (partial, 0.2)], MIN_RELEVANCE) == WORDS_ALONE
    assert relevant([(partial, 0.2), (far, 0.1)], MIN_RELEVANCE, 10) == []
    assert [c.key for c, _ in relevant([(held, 0.2), (far, 0.1)], MIN_RELEVANCE, 10)] == ["h"]
    # Before the embed (no background) the floor is the floor; with a near meaning too.
    assert answering([(partial, 0.2)], MIN_RELEVANCE) == MIN_RELEVANCE
    near = Candidate(key="v", vector_rank=1, distance=0.5, behind=0.9)
    assert answering([(near, 0.1), (partial, 0.2)], MIN_RELEVANCE) == MIN_RELEVANCE
    assert answering([(far, 0.1), (partial, 0.2)], 0.0) == 0.0  # min_relevance 0: every hit


def test_meaning_that_rests_on_shared_words_does_not_vouch_for_them() -> None:
    # "what do pandas eat" beside "Kai is vegetarian but eats fish": near enough by distance
    # (0.357 against its background), but it shares "eat", which is what brought it near.
    eats = Candidate(key="k", lexical_rank=1, coverage=0.435, vector_rank=1, distance=0.697)
    eats = replace(eats, behind=0.917)
    assert vector_relevance(eats.distance, eats.behind) >= MIN_RELEVANCE
    assert eats.meaning < MIN_RELEVANCE
    assert answering([(eats, 0.3)], MIN_RELEVANCE) == WORDS_ALONE
    assert relevant([(eats, 0.3)], MIN_RELEVANCE, 10) == []
    # The same distance with no shared word is meaning alone, and answers.
    apart = replace(eats, lexical_rank=None, coverage=0.0)
    assert apart.meaning == vector_relevance(apart.distance, apart.behind)
    assert [c.key for c, _ in relevant([(apart, 0.3)], MIN_RELEVANCE, 10)] == ["k"]


# -- real Chroma and the offline MiniLM --------------------------------------------------

MEMORIES = (
    "The cat sleeps on the warm windowsill every afternoon.",
    "We decided to move the billing service from MySQL to PostgreSQL next quarter.",
    "Priya prefers tea without sugar in the mornings.",
    "Standup meeting is at 9:30 every weekday in room B.",
    "The production database ran out of disk space on Tuesday night and writes failed.",
    "Elena is the best person to ask about tax rules in Spain.",
    "Backups run nightly at 2 am and are kept for thirty days.",
    "Dentist appointment on Thursday at 3 pm.",
    "The laptop battery swelled and the machine was sent back for repair.",
    "Ravi speaks Hindi, Tamil and English.",
    "Kai is vegetarian but eats fish.",
)


@pytest.fixture
def drained(tmp_path: Path) -> Outbox:
    settings = load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "md", sinks="chroma"
    )
    outbox = Outbox.open(settings)
    for memory in MEMORIES:
        outbox.add(memory)
    assert outbox.drain(timeout=120).ok
    return outbox


def test_a_paraphrase_is_answered_and_unrelated_questions_are_not(drained: Outbox) -> None:
    try:
        (first, *_rest) = drained.recall("where does the pet nap").hits
        assert first.content == MEMORIES[0] and "vector" in first.legs
        assert first.distance is not None and vector_relevance(first.distance) < MIN_RELEVANCE
        assert first.relevance >= MIN_RELEVANCE  # kept by its margin over the background
        for question in ("How many moons does Jupiter have?", "history of the Roman empire"):
            assert drained.recall(question).hits == ()
            assert drained.recall(question, min_relevance=0.0).hits  # there were hits to drop
        # "rules" is one of two words, and no memory is near the question's meaning.
        loose = drained.recall("rules of cricket", min_relevance=0.0).hits
        assert max(hit.relevance for hit in loose) >= MIN_RELEVANCE
        assert drained.recall("rules of cricket").hits == ()
        # Near by distance because it shares "eat": that nearness does not vouch for it.
        (kai, *_rest) = drained.recall("what do pandas eat", min_relevance=0.0).hits
        assert kai.content == MEMORIES[-1] and {"lexical", "vector"} <= set(kai.legs)
        assert kai.distance is not None and kai.relevance >= MIN_RELEVANCE
        assert drained.recall("what do pandas eat").hits == ()
    finally:
        drained.close()


# -- the paraphrase benchmark's set --------------------------------------------------------


def _content(text: str) -> set[str]:
    """The stems of the words the lexical leg would search for."""
    return {stem(word) for word in match_terms(text)}


def test_the_paraphrase_set_shares_no_content_word_and_is_large_enough() -> None:
    assert len(PAIRS) >= 50 and len(UNRELATED) >= 20
    assert len({memory for memory, _ in PAIRS}) == len(PAIRS)
    for memory, question in PAIRS:
        assert not _content(memory) & _content(question), question
