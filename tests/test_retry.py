"""Backoff properties: bounded, growing, jittered within its band, dead after the cap."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outbox.dispatch.retry import RetryPolicy

policies = st.builds(
    RetryPolicy,
    max_retries=st.integers(0, 50),
    base=st.floats(0.01, 10.0),
    cap=st.floats(1.0, 3600.0),
)
unit = st.floats(0.0, 1.0, exclude_max=True)


@given(policies, st.integers(1, 200), unit)
def test_delay_stays_in_the_jitter_band(policy: RetryPolicy, attempts: int, rand: float) -> None:
    step = policy.step(attempts)
    delay = policy.delay(attempts, rand)
    assert step / 2 <= delay <= step
    assert delay <= policy.cap


@given(policies, st.integers(1, 199))
def test_steps_never_shrink(policy: RetryPolicy, attempts: int) -> None:
    assert policy.step(attempts + 1) >= policy.step(attempts)


@given(policies, st.integers(1, 200), unit, st.floats(0, 1e9))
def test_dead_exactly_after_max_retries(
    policy: RetryPolicy, attempts: int, rand: float, now: float
) -> None:
    nxt = policy.next_attempt_at(attempts, now, rand)
    if attempts > policy.max_retries:
        assert nxt is None
    else:
        assert nxt is not None and nxt > now


def test_doubles_until_the_cap() -> None:
    policy = RetryPolicy(base=1.0, cap=10.0)
    assert [policy.step(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
