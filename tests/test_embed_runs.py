"""The cut of a sorted batch into model runs (``outbox.sinks.embed_runs``)."""

from __future__ import annotations

import itertools
import random

import pytest

from outbox.sinks.embed_runs import cut_runs


def padded(lengths: list[int], runs: list[tuple[int, int]], run_cost: int = 8) -> int:
    return sum(run_cost + (end - begin) * lengths[end - 1] for begin, end in runs)


def test_runs_cover_every_text_once_in_order() -> None:
    lengths = sorted(random.Random(3).randint(3, 120) for _ in range(200))
    runs = cut_runs(lengths)
    assert runs[0][0] == 0 and runs[-1][1] == len(lengths)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(runs))


def test_texts_of_one_length_share_runs_up_to_the_token_bound() -> None:
    runs = cut_runs([32] * 64, max_tokens=1024)
    assert runs == [(0, 32), (32, 64)]


def test_a_long_text_does_not_pad_short_ones() -> None:
    runs = cut_runs([10] * 8 + [250])
    assert runs == [(0, 8), (8, 9)]


def test_a_text_longer_than_the_bound_runs_alone() -> None:
    assert cut_runs([5, 2000], max_tokens=1024) == [(0, 1), (1, 2)]


def test_the_cut_is_no_dearer_than_any_fixed_count() -> None:
    lengths = sorted(random.Random(7).randint(10, 100) for _ in range(64))
    best = padded(lengths, cut_runs(lengths))
    for size in (1, 2, 4, 8, 16):
        fixed = [(s, min(64, s + size)) for s in range(0, 64, size)]
        assert best <= padded(lengths, fixed)


def test_empty_and_unsorted() -> None:
    assert cut_runs([]) == []
    with pytest.raises(ValueError, match="sorted"):
        cut_runs([5, 3])
