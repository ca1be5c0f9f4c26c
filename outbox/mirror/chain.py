"""The log's chain across the two ways it may legitimately bend: a forget's in-place
redaction (the ``forgotten`` line keeps the old hash) and an operator's repair of a break in
the middle (a ``reanchored`` line records it). Everything else that bends it is tampering
or loss, and ``verify`` says so.
"""

from __future__ import annotations

from outbox.core.states import MirrorEvent
from outbox.mirror.jsonl import JsonlLog, reanchor_event


def marks(jsonl: JsonlLog) -> tuple[dict[int, str], set[tuple[int, str]]]:
    """(offset of each redacted line -> the hash it had, (offset, expected hash) of each
    break a ``reanchored`` line accounts for), in one pass over the log."""
    redacted: dict[int, str] = {}
    anchored: set[tuple[int, str]] = set()
    for line in jsonl.lines():
        kind, where = line.event.get("event"), line.event.get("line")
        if not isinstance(where, int):
            continue
        if kind == MirrorEvent.FORGOTTEN:
            redacted[where] = str(line.event.get("hash"))
        elif kind == MirrorEvent.REANCHORED:
            anchored.add((where, str(line.event.get("expected"))))
    return redacted, anchored


def reanchor(jsonl: JsonlLog) -> int:
    """Append one ``reanchored`` line per break nothing accounts for yet (the history before
    it stays as it is); returns how many breaks it recorded."""
    gaps = jsonl.breaks(*marks(jsonl))
    jsonl.append([reanchor_event(gap) for gap in gaps])
    return len(gaps)
