"""The lexical leg of recall, apart from any database: which words of a query to look up,
and the bounded steps in which every database's text index answers them.

SQLite's FTS5 (bm25, ``store/sqlite_recall.py``) and PostgreSQL's GIN ``tsvector`` index
(ts_rank, ``store/postgres_recall.py``) each answer the ``Overlay`` questions: how common each
word is, the best matches of the rare ones, and the newest matches of the common ones.
``lexical_hits`` asks them in that order; each question reads a bounded number of index
entries, so its cost stays flat with the store. Pure and free of SQLAlchemy, so ``outbox
search`` can run the SQLite leg on the bare driver.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

_WORD = re.compile(r"\w+", re.UNICODE)

# About how many index entries per query word one lookup of the pending overlay may touch:
# what keeps recall's cost flat however large the backlog grows.
MATCH_BUDGET = 500
# How many of the newest records (of the filter's session, when it names one) a filtered
# lookup reads to find the newest ``budget`` that pass the rest of the filter.
SCAN_FACTOR = 8


# English function words: what a question is phrased with rather than what it asks about.
# A query's own stop words would rank short memories that share only "what did you do"
# above the one that answers it; bm25's rarity weight alone does not offset that.
_STOP_WORDS = """
    a about above after again against all also am an and any are as at be because been
    before being below between both but by can could did didn do does doesn doing don down
    during each else ever few for from further had has have having he her here hers herself
    him himself his how if in into is isn it its itself just may me might more most must my
    myself no nor not now of off on once only or other our ours ourselves out over own same
    shall she should so some such than that the their theirs them themselves then there these
    they this those through to too under until up very was wasn we were weren what when where
    which while who whom whose why will with won would you your yours yourself yourselves
"""
QUERY_STOP_WORDS = frozenset(_STOP_WORDS.split())

# (key, score) best first; scores order one call's results only.
Found = list[tuple[str, float]]


def match_terms(query: str) -> list[str]:
    """Distinct lowercase words of a query that say what it is about (its stop words only
    when it has nothing else), longest first: the most telling ones."""
    words = dict.fromkeys(word.lower() for word in _WORD.findall(query) if len(word) > 1)
    telling = [word for word in words if word not in QUERY_STOP_WORDS] or list(words)
    return sorted(telling, key=len, reverse=True)[:16]


def telling_terms(counts: dict[str, int], budget: int) -> list[str]:
    """The rarest words whose matches fit in ``budget`` together (pure): they tell records
    apart, and ranking all their matches stays bounded."""
    chosen: list[str] = []
    spent = 0
    for term in sorted((term for term in counts if counts[term]), key=counts.__getitem__):
        if spent + counts[term] > budget:
            break
        chosen.append(term)
        spent += counts[term]
    return chosen


@dataclass(frozen=True)
class LexicalHits:
    """The lexical leg's answer: (key, score) best first, and what relevance needs: each
    query word's number of matches (counted no further than ``cap``) and the store's size."""

    hits: Found
    counts: dict[str, int] = field(default_factory=dict)
    cap: int = MATCH_BUDGET + 1
    total: int = 0


class Overlay(Protocol):
    """The bounded steps of a lookup, per database, each inside the caller's filter (and,
    for the pending overlay, only over records the vector sink lacks)."""

    def counts(self, terms: list[str], cap: int) -> dict[str, int]:
        """Each word's number of matches, counted no further than ``cap``."""
        ...

    def ranked(self, terms: list[str], wanted: int) -> Found:
        """Matches of any of ``terms`` (rare words), best first."""
        ...

    def newest(self, terms: list[str], wanted: int, window: int) -> Found:
        """Matches of any of ``terms`` among the newest ``window`` records."""
        ...

    def total(self) -> int:
        """The store's size, as its highest record sequence number."""
        ...


def lexical_hits(overlay: Overlay, query: str, *, limit: int, budget: int) -> LexicalHits:
    """The records that share words with ``query``, best first, found in bounded steps.

    Recall runs this on every query, so its cost must not grow with the store: each step
    reads at most about ``budget`` matches per word. Each word's matches are counted up to
    ``budget`` + 1; the rarest words whose matches fit in ``budget`` together are ranked over
    all their matches (SQLite: FTS5 bm25, PostgreSQL: ts_rank). Words more common than that
    only count among the newest ``budget`` records that pass the filter, whose hits come
    after: on SQLite ranked by how many of those words each holds, on PostgreSQL by ts_rank.
    """
    terms = match_terms(query)
    if not terms:
        return LexicalHits([])
    counts = overlay.counts(terms, budget + 1)
    telling = telling_terms(counts, budget)
    common = [term for term in terms if counts[term] and term not in telling]
    found = overlay.ranked(telling, limit) if telling else []
    if common and len(found) < limit:
        seen = {key for key, _score in found}
        found += [item for item in overlay.newest(common, limit, budget) if item[0] not in seen]
    return LexicalHits(found[:limit], counts, budget + 1, overlay.total())
