"""Where each machine's mirrors live, as the store recorded them, and the check every open makes.

The store remembers its JSONL log and markdown folder per ``mirror_id``: the first open that
finds no row for its machine records the paths it was given (a new store, or one created before
this check existed). An open configured with other paths would split the audit trail into a
second log with its own chain and records whose files ``verify`` cannot find, so it is refused
with both paths and the setting to change. A store moved whole (nothing left at the recorded
place, something at the configured one) is not a split: the new place is recorded instead.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, Table, select
from sqlalchemy.dialects import postgresql, sqlite

from outbox.core.errors import OutboxError
from outbox.store.schema import store_locations
from outbox.store.steady import MirrorPlaces, Placed

log = logging.getLogger(__name__)


class LocationMismatch(OutboxError):
    """An open names other mirror paths than the ones its store recorded."""


# Each place: how the error names it, and the setting that moves it.
_PLACES = (
    ("jsonl_path", "JSONL log", "OUTBOX_JSONL_PATH"),
    ("markdown_dir", "markdown folder", "OUTBOX_MARKDOWN_DIR"),
)


@dataclass(frozen=True)
class Verdict:
    """What an open's paths mean against the recorded ones: problems refuse the open; the
    places in ``moved`` (described from where to where) were moved whole and are recorded anew."""

    problems: tuple[str, ...] = ()
    moved: tuple[str, ...] = ()


def judge(
    recorded: MirrorPlaces,
    configured: MirrorPlaces,
    *,
    same_place: Callable[[Path, Path], bool],
    exists: Callable[[Path], bool],
) -> Verdict:
    """Compare the places (pure: the two file-system questions are passed in)."""
    problems: list[str] = []
    moved: list[str] = []
    for field, what, setting in _PLACES:
        then, now = getattr(recorded, field), getattr(configured, field)
        if then == now or same_place(then, now):
            continue
        if not exists(then) and exists(now):
            moved.append(f"{what} from {then} to {now}")
            continue
        problems.append(
            f"this store keeps its {what} at {then}, but {setting} points to {now}: "
            f"set {setting}={then} (or move the {what} there, leaving nothing at the old place)"
        )
    return Verdict(tuple(problems), tuple(moved))


def _same_place(first: Path, second: Path) -> bool:
    """Both exist and are one file or folder (a symlinked path to the same place)."""
    try:
        return os.path.samefile(first, second)
    except OSError:
        return False


class LocationStore:
    """The ``store_locations`` rows: written once per machine, read by every open."""

    def __init__(self, engine: Engine, reader: Engine) -> None:
        self.engine = engine
        self.reader = reader
        postgres = engine.dialect.name == "postgresql"
        self._insert: Callable[[Table], Any] = postgresql.insert if postgres else sqlite.insert

    def recorded(self, mirror_id: str) -> MirrorPlaces | None:
        """The places ``mirror_id``'s mirrors were recorded at (None: not yet recorded)."""
        with self.reader.connect() as conn:
            row = conn.execute(
                select(store_locations.c.jsonl_path, store_locations.c.markdown_dir).where(
                    store_locations.c.mirror_id == mirror_id
                )
            ).first()
        return None if row is None else MirrorPlaces(Path(row[0]), Path(row[1]))

    def record(self, mirror_id: str, places: MirrorPlaces, *, replace: bool = False) -> None:
        """Record ``places`` for ``mirror_id``: only when none are (the first open wins a
        race), or over the old ones with ``replace``."""
        values = {
            "jsonl_path": str(places.jsonl_path),
            "markdown_dir": str(places.markdown_dir),
            "recorded_at": time.time(),
        }
        statement = self._insert(store_locations).values(mirror_id=mirror_id, **values)
        if replace:
            statement = statement.on_conflict_do_update(index_elements=["mirror_id"], set_=values)
        else:
            statement = statement.on_conflict_do_nothing(index_elements=["mirror_id"])
        with self.engine.begin() as conn:
            conn.execute(statement)

    def check(self, settings: Placed) -> None:
        """Every open: record the places if none are, else refuse other ones
        (LocationMismatch, one line naming both paths and the setting)."""
        configured = MirrorPlaces.of(settings)
        recorded = self.recorded(settings.mirror_id)
        if recorded is None:
            self.record(settings.mirror_id, configured)
            recorded = self.recorded(settings.mirror_id) or configured
        verdict = judge(recorded, configured, same_place=_same_place, exists=os.path.lexists)
        if verdict.problems:
            raise LocationMismatch("; ".join(verdict.problems))
        if verdict.moved:
            log.warning("the store's %s moved; recorded the new place", "; ".join(verdict.moved))
            self.record(settings.mirror_id, configured, replace=True)
