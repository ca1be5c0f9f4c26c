"""When to try a failed delivery again, and when to stop (pure, property-tested).

Exponential backoff with "equal jitter": half the step is fixed, half random, so retries from
many records spread out without ever coming back sooner than half the step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """``max_retries`` retries after the first attempt, then the record is a dead letter."""

    max_retries: int = 10
    base: float = 1.0
    cap: float = 300.0

    def step(self, attempts: int) -> float:
        """The un-jittered delay after the ``attempts``-th failed attempt (1-based)."""
        exponent = min(max(attempts, 1) - 1, 62)
        return min(self.cap, self.base * (2.0**exponent))

    def delay(self, attempts: int, rand: float) -> float:
        """Seconds to wait after ``attempts`` failures; ``rand`` is uniform in [0, 1)."""
        step = self.step(attempts)
        return step / 2.0 + step / 2.0 * min(max(rand, 0.0), 1.0)

    def exhausted(self, attempts: int) -> bool:
        return attempts > self.max_retries

    def next_attempt_at(self, attempts: int, now: float, rand: float) -> float | None:
        """When to retry, or None when the retries are used up (dead letter)."""
        if self.exhausted(attempts):
            return None
        return now + self.delay(attempts, rand)
