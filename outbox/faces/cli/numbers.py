"""The number options' ``type=`` functions: each checks its range where argparse parses it.

A value out of range is argparse's one-line ``error:`` naming the option and the range, exit 2,
before any command opens the store. Pure functions of the text, imported by ``outbox add``
too, so this module loads nothing but the standard library.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# The most results a recall answers with, as memory-core's MCP tools allow.
MAX_RESULTS = 100


def whole(low: int, high: int | None = None) -> Callable[[str], int]:
    """A parser of whole numbers from ``low`` to ``high`` (no upper bound when None)."""
    allowed = f"{low}..{high}" if high is not None else f"{low} or more"

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected a whole number {allowed}, got {text!r}")
        return value

    parse.__name__ = f"whole {allowed}"
    return parse


def decimal(
    low: float, high: float | None = None, *, above: bool = False
) -> Callable[[str], float]:
    """A parser of finite numbers from ``low`` (exclusive when ``above``) to ``high``."""
    if high is not None:
        allowed = f"{'above ' if above else ''}{low:g}..{high:g}"
    else:
        allowed = f"above {low:g}" if above else f"{low:g} or more"

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        inside = value > low if above else value >= low
        if not math.isfinite(value) or not inside or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected a number {allowed}, got {text!r}")
        return value

    parse.__name__ = f"number {allowed}"
    return parse


positive_int = whole(1)
results = whole(1, MAX_RESULTS)
importance = whole(1, 10)
fraction = decimal(0.0, 1.0)
seconds = decimal(0.0)
positive_seconds = decimal(0.0, above=True)
port_or_zero = whole(0, 65535)  # 0 means something where it is used: any free port, or none
