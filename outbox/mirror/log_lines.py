"""The JSONL log's lines that name one record, found without parsing the others.

``outbox show`` and the dashboard's memory page show them, and both must answer quickly at
any log size: parsing every
line of a 100,000-record log takes most of a second, while looking for the key's bytes in
the mapped file takes milliseconds. Only the lines holding the key are parsed, and kept
when their ``key`` field really is it; line numbers come from counting newlines chunk by
chunk, which copies no more than one chunk at a time.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.core.safe_files import open_file

CHUNK = 1 << 20


@dataclass(frozen=True)
class LogLine:
    number: int  # 1-based, as ``outbox show`` counts
    event: dict[str, Any]


def lines_naming(path: Path, key: str) -> list[LogLine]:
    """Every complete line of the log at ``path`` whose ``key`` is ``key``, in order."""
    try:
        fd = open_file(path, os.O_RDONLY, what="JSONL log")
    except FileNotFoundError:
        return []
    with os.fdopen(fd, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return []
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _matches(data, key)


def _matches(data: mmap.mmap, key: str) -> list[LogLine]:
    needle = key.encode("ascii")
    found: list[LogLine] = []
    number, counted_to, at = 1, 0, data.find(needle)
    while at != -1:
        start = data.rfind(b"\n", 0, at) + 1
        end = data.find(b"\n", at)
        if end == -1:  # a torn last line is no line yet
            break
        number += _newlines(data, counted_to, start)
        counted_to = start
        try:
            event = json.loads(data[start:end])
        except ValueError:
            event = None
        if isinstance(event, dict) and event.get("key") == key:
            found.append(LogLine(number, event))
        at = data.find(needle, end)
    return found


def _newlines(data: mmap.mmap, start: int, end: int) -> int:
    return sum(data[at : min(at + CHUNK, end)].count(b"\n") for at in range(start, end, CHUNK))
