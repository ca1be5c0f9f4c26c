"""Hybrid recall's pure parts: the filter a query carries into both legs, how sure each leg is
of a hit (``relevance`` in [0, 1]), and how the two rankings become one.

Pure functions and frozen values only: no database, no model, so each rule is pinned by
property tests and both legs read the same filter the same way.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

_WORD = re.compile(r"\w+", re.UNICODE)
# Longest first: the first suffix that leaves a stem of three letters or more is cut.
_SUFFIXES = ("ations", "ation", "ingly", "ings", "edly", "ing", "ies", "ied", "es", "ed", "ly", "s")

# Cosine distances of the offline MiniLM: at or below FULL a hit reads as a sure match; read
# by distance alone, at or above NONE as unrelated (docs/memory-core.md).
DISTANCE_FULL, DISTANCE_NONE = 0.30, 0.75
# The query's background in the vector leg: the median distance of the memories ranked 2nd
# to 20th, where memories that do not answer it sit (a median, so one far outlier in a small
# store does not move it). Fewer than BACKGROUND_MIN hits say too little to calibrate.
BACKGROUND_RANK, BACKGROUND_MIN = 20, 5
# The default ``min_relevance``, chosen on the development split (docs/memory-core.md), and
# the share of it the hits below a query's answering hit must still reach.
MIN_RELEVANCE, KEEP_SHARE = 0.30, 0.5
# When the vector leg finds nothing near a query's meaning, its words alone answer it only
# if one memory holds at least this share of them: one shared word of two is chance.
WORDS_ALONE = 0.5
# How many turns before and after a hit in its session recall looks at for context.
CONTEXT_REACH = 2


@lru_cache(maxsize=1 << 16)
def stem(word: str) -> str:
    """A crude English stem, enough to see that ``painted`` answers ``paint`` (pure, so
    memoised: recall stems the same words of every memory it weighs)."""
    word = word.lower().removesuffix("'s")
    for suffix in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)]
    return word


def stems(text: str) -> set[str]:
    return {stem(word) for word in _WORD.findall(text)}


@dataclass(frozen=True)
class TermWeights:
    """Each telling query word's stem and weight (rarity): what lexical relevance counts."""

    weights: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, counts: Mapping[str, int], total: int, cap: int) -> TermWeights:
        """IDF of each word from its match count; a word counted up to ``cap`` is too common
        to tell memories apart and weighs nothing, an unknown word weighs the most."""
        weights: dict[str, float] = {}
        total = max(total, 1)
        for term, count in counts.items():
            if count >= cap:
                continue
            idf = math.log(1.0 + (total - count + 0.5) / (count + 0.5))
            key = stem(term)
            weights[key] = max(weights.get(key, 0.0), idf)
        return cls(weights)

    def coverage(self, text: str) -> float:
        """The share of the query's weight whose words ``text`` holds, in [0, 1]."""
        whole = sum(self.weights.values())
        if whole <= 0:
            return 0.0
        held = stems(text)
        return sum(weight for key, weight in self.weights.items() if key in held) / whole


def background(distances: Sequence[float]) -> float | None:
    """The distance a query's unrelated memories sit at: the median of its hits (nearest
    first) ranked 2nd to ``BACKGROUND_RANK``-th; None below ``BACKGROUND_MIN`` hits."""
    if len(distances) < BACKGROUND_MIN:
        return None
    return statistics.median(distances[1:BACKGROUND_RANK])


def vector_relevance(distance: float | None, behind: float | None = None) -> float:
    """A cosine distance as a share of certainty, the higher of two readings: absolute (1 at
    ``DISTANCE_FULL``, 0 at ``NONE``) and against the query's background ``behind`` (the
    share of the way from it down to ``DISTANCE_FULL`` the hit has come). A clear nearest
    answer in a store far from the query reads high; a hit as far as the rest reads 0."""
    if distance is None or math.isnan(distance):
        return 0.0
    share = (DISTANCE_NONE - distance) / (DISTANCE_NONE - DISTANCE_FULL)
    if behind is not None and behind > DISTANCE_FULL:
        share = max(share, (behind - distance) / (behind - DISTANCE_FULL))
    return min(1.0, max(0.0, share))


@dataclass(frozen=True)
class Candidate:
    """One memory either leg found: its rank and score per leg (None: that leg missed it)."""

    key: str
    lexical_rank: int | None = None
    lexical_score: float | None = None
    coverage: float = 0.0
    vector_rank: int | None = None
    distance: float | None = None
    # The query's background in the vector leg (``background``), None: too few hits.
    behind: float | None = None
    # For the vector leg's nearest memory, how much nearer it is than the next, as a share
    # of the way from the background to a sure match (0..1; 0 for every other memory).
    lead: float = 0.0
    # The key of the hit this memory neighbours in its session, and that hit's relevance.
    context_of: str | None = None
    context_relevance: float = 0.0
    # Written on a date the query names.
    dated: bool = False

    @property
    def legs(self) -> list[str]:
        found = [("lexical", self.lexical_rank), ("vector", self.vector_rank)]
        legs = [name for name, rank in found if rank is not None]
        extra = [name for name, on in (("context", self.context_of), ("date", self.dated)) if on]
        return [*legs, *extra]

    @property
    def meaning(self) -> float:
        """What the vector leg vouches for beyond the words: its relevance times the share of
        the query's words the memory lacks. A memory that shares words with the query sits
        nearer it in the embedding for those words alone, so its distance overstates how
        near its meaning is ("what do pandas eat" beside "Kai ... eats fish")."""
        return vector_relevance(self.distance, self.behind) * (1.0 - self.coverage)

    @property
    def relevance(self) -> float:
        """The surer leg's certainty; a neighbour of a hit is as relevant as that hit."""
        own = max(self.coverage, vector_relevance(self.distance, self.behind))
        return max(own, self.context_relevance)


@dataclass(frozen=True)
class Fusion:
    """How the two rankings merge: reciprocal ranks, plus a share of lexical relevance, plus
    what a hit's session neighbours and the dates a query names add.

    Chosen on the development split and checked conversation by conversation
    (docs/benchmarks.md, section 10).
    """

    lexical_weight: float = 1.0
    vector_weight: float = 0.8
    k: int = 5
    # Reciprocal ranks only order each leg; the weighted share of the query's words a memory
    # holds also tells two memories apart that the legs rank alike.
    coverage_weight: float = 0.2
    # A hit's session neighbours (up to ``CONTEXT_REACH`` turns before and after) gain this
    # share of its score: an answer often sits in the reply to the turn whose words the
    # query shares, or in the same speaker's next turn.
    context_share: float = 0.5
    context_sources: int = 10
    # A memory written on a date the query names ("on 7 July, 2023") gains this much: about
    # two thirds of what a first place in one leg is worth.
    date_bonus: float = 0.12
    # The vector leg's nearest memory gains this times its lead (``Candidate.lead``) times
    # the share of the query's words no memory holds: when the words say little, a clear
    # nearest meaning outranks memories that share one of them. 2.0 kept one more paraphrase
    # first and lost one LoCoMo question (docs/benchmarks.md).
    lead_weight: float = 1.5

    def score(self, item: Candidate, words: float = 1.0) -> float:
        """``item``'s fused score; ``words`` is the best coverage any memory reaches for
        this query (1: the words explain it fully, and the lead counts for nothing)."""
        total = self.coverage_weight * item.coverage
        total += self.lead_weight * max(0.0, 1.0 - words) * item.lead
        if item.lexical_rank is not None:
            total += self.lexical_weight / (self.k + item.lexical_rank)
        if item.vector_rank is not None:
            total += self.vector_weight / (self.k + item.vector_rank)
        return total


def candidates(
    lexical: Sequence[tuple[str, float]],
    vector: Sequence[tuple[str, float]],
    coverage: Mapping[str, float],
    behind: float | None = None,
) -> list[Candidate]:
    """Both legs' best-first hits ((key, bm25 score) and (key, distance)) as candidates,
    ranks counted from 1; ``coverage`` is each key's lexical relevance, ``behind`` the
    vector leg's background for this query (``background``)."""
    found: dict[str, dict[str, Any]] = {}
    for rank, (key, score) in enumerate(lexical, start=1):
        found.setdefault(key, {}).update(lexical_rank=rank, lexical_score=score)
    for rank, (key, distance) in enumerate(vector, start=1):
        found.setdefault(key, {}).update(vector_rank=rank, distance=distance, behind=behind)
    if len(vector) > 1 and behind is not None and behind > DISTANCE_FULL:
        lead = (vector[1][1] - vector[0][1]) / (behind - DISTANCE_FULL)
        found[vector[0][0]]["lead"] = min(1.0, max(0.0, lead))
    return [
        Candidate(key=key, coverage=coverage.get(key, 0.0), **fields)
        for key, fields in found.items()
    ]


def fuse(items: Iterable[Candidate], fusion: Fusion) -> list[tuple[Candidate, float]]:
    """(candidate, fused score) best first; ties go to the key, so the order is the same
    on every run. The best coverage among them says how well the query's words are held."""
    items = list(items)
    words = max((item.coverage for item in items), default=0.0)
    scored = [(item, fusion.score(item, words)) for item in items]
    return sorted(scored, key=lambda pair: (-pair[1], pair[0].key))


def relevant(
    scored: Sequence[tuple[Candidate, float]], min_relevance: float, limit: int
) -> list[tuple[Candidate, float]]:
    """Nothing when no hit reaches what ``answering`` asks: the store does not answer the
    query. Otherwise the first ``limit`` hits whose relevance reaches ``KEEP_SHARE`` of
    ``min_relevance``, order kept: once one hit answers, the fusion's order judges the rest
    better than their own certainty does (a reply that shares one word of the question is
    still the reply)."""
    if max((item.relevance for item, _ in scored), default=0.0) < answering(scored, min_relevance):
        return []
    return [pair for pair in scored if pair[0].relevance >= min_relevance * KEEP_SHARE][:limit]


def answering(scored: Sequence[tuple[Candidate, float]], min_relevance: float) -> float:
    """The relevance a hit needs for the store to answer the query: ``min_relevance``, or
    ``WORDS_ALONE`` when the vector leg searched the store (it has a background) and none of
    its hits' ``meaning`` reaches ``min_relevance``: then only words vouch for the answer."""
    meaning = [item.meaning for item, _ in scored if item.behind is not None]
    if meaning and max(meaning) < min_relevance:
        return max(min_relevance, WORDS_ALONE)
    return min_relevance


def with_context(
    scored: list[tuple[Candidate, float]],
    neighbours: Mapping[str, Sequence[Candidate]],
    fusion: Fusion,
) -> list[tuple[Candidate, float]]:
    """Each of the best ``context_sources`` hits lends ``context_share`` of its score to its
    neighbours (``neighbours[key]``: fresh candidates, relevance measured), which join the
    list (at their own score: what their coverage is worth) or rise in it; best first
    again, ties to the key."""
    found = {item.key: (item, score) for item, score in scored}
    lent: dict[str, tuple[float, Candidate]] = {}
    for source, score in scored[: fusion.context_sources]:
        for near in neighbours.get(source.key, ()):
            share = fusion.context_share * score
            if share > lent.get(near.key, (0.0, near))[0]:
                context = replace(near, context_of=source.key, context_relevance=source.relevance)
                lent[near.key] = (share, context)
    for key, (share, context) in lent.items():
        item, score = found.get(key, (context, fusion.score(context)))
        lifted = replace(
            item, context_of=context.context_of, context_relevance=context.context_relevance
        )
        found[key] = (lifted, score + share)
    return sorted(found.values(), key=lambda pair: (-pair[1], pair[0].key))


def with_dates(
    scored: list[tuple[Candidate, float]], dated: Iterable[str], fusion: Fusion
) -> list[tuple[Candidate, float]]:
    """The hits written on a date the query names (``dated`` keys) gain ``date_bonus``;
    best first again, ties to the key."""
    on = set(dated)
    lifted = [
        (replace(item, dated=True), score + fusion.date_bonus) if item.key in on else (item, score)
        for item, score in scored
    ]
    return sorted(lifted, key=lambda pair: (-pair[1], pair[0].key))


def rrf(rankings: Sequence[Sequence[str]], k: int = 60) -> list[tuple[str, float]]:
    """Plain reciprocal rank fusion of best-first rankings (pure)."""
    scores: dict[str, float] = {}
    for ranking in rankings:
        for position, key in enumerate(ranking):
            scores[key] = scores.get(key, 0.0) + 1.0 / (k + position + 1)
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))
