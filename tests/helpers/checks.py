"""Read the outbox's files the way an outsider would, to check the library against them.

Nothing here uses the library's own parsers: the front matter is split off by hand and loaded
with ``yaml.safe_load`` (what contract section 3 promises), the JSONL is read line by line,
and keys are computed from section 2's formula, so a bug in the library cannot hide itself.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml


def split_markdown(path: Path) -> tuple[dict[str, Any], bytes]:
    """(front matter loaded with yaml.safe_load, body bytes after the closing ``---`` line)."""
    data = path.read_bytes()
    assert data.startswith(b"---\n"), f"{path} does not start with front matter"
    end = data.index(b"\n---\n", 3)
    matter = yaml.safe_load(data[4 : end + 1].decode("utf-8")) or {}
    return matter, data[end + len(b"\n---\n") :]


def front_matter(path: Path) -> dict[str, Any]:
    return split_markdown(path)[0]


def markdown_files(folder: Path) -> list[Path]:
    """The visible ``.md`` files of a folder (temp files and the fallback index start with .)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix == ".md" and not p.name.startswith("."))


def files_by_key(folder: Path) -> dict[str, list[Path]]:
    """Markdown files grouped by the ``key`` in their front matter (files without one: "")."""
    found: dict[str, list[Path]] = {}
    for path in markdown_files(folder):
        found.setdefault(str(front_matter(path).get("key") or ""), []).append(path)
    return found


def jsonl_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def accepted_counts(path: Path) -> Counter[str]:
    """How many ``accepted`` lines each key has in the JSONL mirror."""
    return Counter(e["key"] for e in jsonl_events(path) if e.get("event") == "accepted")


def chain_ok(path: Path) -> bool:
    """Every line's ``prev`` is the SHA-256 of the line before it (the first: 64 zeros)."""
    prev = "0" * 64
    if not path.exists():
        return True
    for raw in path.read_bytes().splitlines():
        if json.loads(raw).get("prev") != prev:
            return False
        prev = hashlib.sha256(raw).hexdigest()
    return True


def contract_key(content: str, canonical_ts: str) -> str:
    """Contract section 2's idempotency key, computed here independently of the library."""
    return hashlib.sha256(
        content.encode("utf-8") + b"\n" + canonical_ts.encode("ascii")
    ).hexdigest()
