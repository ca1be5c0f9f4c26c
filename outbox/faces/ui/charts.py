"""The overview's activity chart as plain geometry, drawn by the template as inline SVG: no
chart library and no script, so the page renders the same with JavaScript off.

Deliveries grow up from the middle line and failures down from it, each on its own scale,
so a handful of failures stays visible beside thousands of deliveries.
"""

from __future__ import annotations

from dataclasses import dataclass

WIDTH, HEIGHT = 600, 160
TOP, MIDDLE, BOTTOM = 16, 100, 132  # deliveries between TOP and MIDDLE, failures below
LEFT = 4


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    count: int
    label: str  # what the bar's tooltip says


@dataclass(frozen=True)
class Chart:
    width: int
    height: int
    middle: int
    delivered: list[Bar]
    failed: list[Bar]
    delivered_peak: int
    failed_peak: int
    delivered_total: int
    failed_total: int
    bottom: int
    ticks: list[tuple[float, str, str]]  # (x, label, text-anchor) along the bottom


def activity_chart(delivered: list[int], failed: list[int], slice_seconds: float) -> Chart:
    """Bars for each slice, oldest left; ``ticks`` label minutes before now."""
    slices = max(len(delivered), 1)
    step = (WIDTH - 2 * LEFT) / slices
    up_peak, down_peak = max(delivered, default=0), max(failed, default=0)

    def bars(counts: list[int], peak: int, room: int, upward: bool, word: str) -> list[Bar]:
        found: list[Bar] = []
        for index, count in enumerate(counts):
            if not count:
                continue
            height = max(1.0, room * count / peak)
            ago = round((slices - index) * slice_seconds / 60)
            found.append(
                Bar(
                    x=round(LEFT + index * step + 0.5, 2),
                    y=round(MIDDLE - height if upward else MIDDLE, 2),
                    width=round(max(step - 1, 1.0), 2),
                    height=round(height, 2),
                    count=count,
                    label=f"{count} {word}, {ago} min ago",
                )
            )
        return found

    every = max(1, slices // 6)
    ticks = [
        (
            round(LEFT + index * step, 2),
            f"-{round((slices - index) * slice_seconds / 60)} min" if index < slices else "now",
            "end" if index == slices else "start",
        )
        for index in range(0, slices + 1, every)
    ]
    return Chart(
        width=WIDTH,
        height=HEIGHT,
        middle=MIDDLE,
        bottom=BOTTOM,
        delivered=bars(delivered, up_peak, MIDDLE - TOP, True, "delivered"),
        failed=bars(failed, down_peak, BOTTOM - MIDDLE, False, "failed"),
        delivered_peak=up_peak,
        failed_peak=down_peak,
        delivered_total=sum(delivered),
        failed_total=sum(failed),
        ticks=ticks,
    )
