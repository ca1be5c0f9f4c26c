"""Which Chroma collection serves recall and delivery: a pointer that ``outbox reindex`` moves.

``vector-index.json`` under ``OUTBOX_HOME`` maps each configured collection name
(``OUTBOX_CHROMA_COLLECTION``) to the collection serving it now and the ``OUTBOX_EMBEDDING``
value that built it, so every process embeds queries and records with the model of the index
it talks to, whatever its own setting says. Without an entry the configured collection serves,
with the configured embedder. The file is only ever replaced whole (``os.replace``): a reader
sees the old pointer or the new one, never half of each.

Every sink call holds a shared ``flock`` on ``vector-index.lock`` while it uses the collection
it read; a reindex takes it exclusively to move the pointer. So when the pointer moves no call
is still writing into the old collection, and every later call sees the new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.core.folders import ensure_private_dir

INDEX_FILE = "vector-index.json"
LOCK_FILE = "vector-index.lock"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActiveIndex:
    """The collection serving a configured name, and the setting that built its vectors
    (None when unknown: the process's own ``OUTBOX_EMBEDDING`` is used)."""

    collection: str
    embedding: str | None = None
    generation: int = 0


def write_json_atomically(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to a temporary file, flush it to disk, then rename it over ``path``:
    a crash leaves the old file or the new one."""
    ensure_private_dir(path.parent)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when the file is missing or not such an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s (%s)", path, exc.__class__.__name__)
        return None
    return value if isinstance(value, dict) else None


class IndexPointer:
    """The pointer entry of one configured collection name, and the lock guarding its use."""

    def __init__(self, home: Path, base: str) -> None:
        self.home = Path(home)
        self.base = base
        self.path = self.home / INDEX_FILE
        self.lock_path = self.home / LOCK_FILE
        self._warned = False

    def read(self) -> ActiveIndex | None:
        """The entry for this name, or None (the configured collection serves)."""
        entry = ((read_json(self.path) or {}).get("indexes") or {}).get(self.base)
        if not isinstance(entry, dict) or not isinstance(entry.get("collection"), str):
            return None
        embedding = entry.get("embedding")
        generation = entry.get("generation")
        return ActiveIndex(
            entry["collection"],
            embedding if isinstance(embedding, str) and embedding else None,
            generation if isinstance(generation, int) else 0,
        )

    def current(self) -> ActiveIndex:
        return self.read() or ActiveIndex(self.base)

    def write(self, active: ActiveIndex) -> None:
        """Point this name at ``active``; the caller holds the lock exclusively."""
        document = read_json(self.path) or {}
        indexes = dict(document.get("indexes") or {})
        indexes[self.base] = {
            "collection": active.collection,
            "embedding": active.embedding,
            "generation": active.generation,
        }
        write_json_atomically(self.path, {"version": 1, "indexes": indexes})

    @contextlib.contextmanager
    def held(self, exclusive: bool = False) -> Iterator[None]:
        """The lock, shared by sink calls, exclusive for moving the pointer. A home that
        cannot hold the lock file leaves calls unguarded (a reindex needs it, and fails)."""
        try:
            ensure_private_dir(self.home)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exclusive:
                raise
            if not self._warned:
                self._warned = True
                log.warning("cannot open %s (%s): switches go unguarded", self.lock_path, exc)
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing the only descriptor releases the lock
