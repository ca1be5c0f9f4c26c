"""How a batch of texts is cut into model runs: texts of like length together.

A transformer run pads every text to the longest of its run, and its cost grows with the
padded area (texts x width), so a run should hold texts of nearly one length; but each run
also has a fixed cost, so a run per text is not free either. With the lengths sorted, the
cheapest cut is found exactly by dynamic programming over where runs start. A fixed count
per run cannot do this: on LoCoMo turns, 32 texts a run spent most of its work on padding
(76 texts/s against 143 with 4 on one thread), and 4 a run wastes the fixed cost on the many
texts of one length.

Pure functions: no model, no numpy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

# A run's fixed cost (session call, feeds, pooling) as the work of this many padded tokens:
# measured as the intercept of run time against padded tokens with MiniLM int8 on one thread
# (6 to 10 tokens); the cut hardly changes between 4 and 16.
RUN_COST_TOKENS = 8
# Most padded tokens in one run: past a few thousand the activations leave the CPU's cache
# and each token costs more (64 texts x 64 tokens took twice the time per token of 8 x 64).
MAX_RUN_TOKENS = 1024
# Longest stretch of sorted texts one run may take: bounds the search on a huge batch.
_MAX_RUN_TEXTS = 64


def cut_runs(
    lengths: Sequence[int],
    run_cost: int = RUN_COST_TOKENS,
    max_tokens: int = MAX_RUN_TOKENS,
) -> list[tuple[int, int]]:
    """The ``(start, end)`` slices of ``lengths`` (sorted ascending) that make the cheapest
    runs: each run costs ``run_cost`` plus its texts times its longest text, and holds at most
    ``max_tokens`` padded tokens (a single text longer than that runs alone)."""
    count = len(lengths)
    if any(a > b for a, b in itertools.pairwise(lengths)):
        raise ValueError("cut_runs needs the lengths sorted ascending")
    best = [0] + [-1] * count  # cheapest cost of the first j texts
    start = [0] * (count + 1)  # where the last run of that cheapest cut starts
    for end in range(1, count + 1):
        width = max(1, lengths[end - 1])
        for begin in range(end - 1, max(-1, end - 1 - _MAX_RUN_TEXTS), -1):
            texts = end - begin
            if texts > 1 and texts * width > max_tokens:
                break
            cost = best[begin] + run_cost + texts * width
            if best[end] < 0 or cost < best[end]:
                best[end], start[end] = cost, begin
    runs: list[tuple[int, int]] = []
    end = count
    while end > 0:
        runs.append((start[end], end))
        end = start[end]
    return runs[::-1]
