"""A progress line on standard error for the long commands (``rebuild``, ``reindex``, ``replay``).

On a terminal it is one line, rewritten in place; anywhere else (a log file, CI) it is a
plain line every few seconds, so the log keeps a readable history without a line per item.
"""

from __future__ import annotations

import sys
import time

# Seconds between progress lines when stderr is not a terminal (a log keeps them all).
LINE_EVERY = 2.0


class StatusLine:
    """Shows progress texts; off a terminal at most one per ``LINE_EVERY`` unless ``always``."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = 0.0
        self.shown = False  # a rewritten line is on screen and wants its newline

    def show(self, text: str, *, always: bool = False) -> None:
        now = time.monotonic()
        if not self.tty and not always and now - self.last < LINE_EVERY:
            return
        self.last = now
        sys.stderr.write(f"\r{text}\033[K" if self.tty else f"{text}\n")
        sys.stderr.flush()
        self.shown = True

    def finish(self) -> None:
        """End the rewritten line (a new phase starts below it, or the command is done)."""
        if self.tty and self.shown:
            sys.stderr.write("\n")
        self.shown = False
