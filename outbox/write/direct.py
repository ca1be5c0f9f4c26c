"""``outbox add`` on a SQLite store in its steady state, without importing SQLAlchemy.

Opening the outbox checks the schema and the mirror locations and repairs the mirrors, all
through SQLAlchemy, whose import alone takes longer than the command's start budget. A
store in its steady state needs none of that work, and the store's steady-state check
(``store/steady.py``) shows it cheaply on the bare driver before writing: the schema is
current and the mirrors are where the store recorded them. The write itself goes through the
outbox's own ``Writer``, ``Mirrors`` and fallback decision, so there is one write path.
Afterwards the same check stands in for the repair that follows the command's write: when
its own records are all the log gained since the repair's watermark, it moves the watermark;
when anything else is owed (a crashed writer's records, fallback files, delivery outcomes or
a forget not yet mirrored, a torn log) it says so and the caller runs the full repair.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from outbox.core.errors import MirrorBusy
from outbox.core.folders import ensure_private_dir
from outbox.core.receipt import Receipt
from outbox.core.record import Record
from outbox.core.states import MirrorEvent
from outbox.mirror.gap import bare_file, steady
from outbox.mirror.mirrors import Mirrors
from outbox.store.driver_errors import UNAVAILABLE_BARE
from outbox.store.on_demand import StorageOnDemand
from outbox.store.sqlite_writes import connect_writer
from outbox.store.steady import SteadyCheck
from outbox.store.transactions import transactions_for
from outbox.write.durable import commit_or_fallback
from outbox.write.fallback import FallbackQueue
from outbox.write.writer import Writer

if TYPE_CHECKING:
    from outbox.core.config import Settings


@dataclass(frozen=True)
class DirectWrite:
    """A write done without the full outbox, and whether a repair is still owed."""

    receipt: Receipt
    repair_owed: bool


def add(settings: Settings, record: Record) -> DirectWrite | None:
    """Write ``record`` the way ``Outbox.add`` would; None, having written nothing, when the
    store needs the full open first (no SQLite file yet, another backend or URL form, a
    schema to migrate, mirror places to record or to refuse, records the log names and the
    database lacks)."""
    path = bare_file(settings)
    if path is None:
        return None
    try:  # one connection for the checks before and after the write
        checks = _connect(path, settings)
    except sqlite3.Error:  # the full open meets it too, and decides (fallback or error)
        return None
    try:
        return _add_if_ready(checks, settings, record)
    finally:
        checks.close()


def _add_if_ready(
    checks: sqlite3.Connection, settings: Settings, record: Record
) -> DirectWrite | None:
    """``add`` once the store is open for its checks (on ``checks``)."""
    check = SteadyCheck(checks)
    if not steady(check, settings):  # a gap included: the full open's to refuse
        return None
    with contextlib.suppress(OSError):  # the full open only warns about it as well
        ensure_private_dir(settings.home)
    storage = StorageOnDemand(settings)
    mirrors = Mirrors.from_settings(storage, settings)
    writer = Writer(
        storage,
        mirrors,
        transactions=transactions_for(settings, storage),
        sinks=settings.sinks,
        origin=settings.mirror_id,
        busy_timeout=settings.busy_timeout,
    )
    fallback = FallbackQueue(settings.markdown_dir, settings.sinks)
    try:
        (receipt,), unavailable = commit_or_fallback(
            writer, fallback, [record], expected=UNAVAILABLE_BARE
        )
        owed = False
        if unavailable is None:
            try:  # the exclusive hold waits for the mirror writer: the files are all there
                with mirrors.hold(time.monotonic() + settings.busy_timeout):
                    owed = (
                        check.catch_up(
                            settings.mirror_id,
                            _MirrorFiles(mirrors),
                            fallback_waits=bool(fallback.pending_count()),
                        )
                        is not None
                    )
            except (MirrorBusy, sqlite3.Error):  # the mirrors or the database are busy:
                owed = True  # the full repair waits for them; the write stands
    finally:
        writer.close()
        mirrors.close()
        storage.close()
    return DirectWrite(receipt, owed)


def _connect(path: Path, settings: Settings) -> sqlite3.Connection:
    return connect_writer(
        path, busy_timeout=settings.busy_timeout, synchronous=settings.synchronous
    )


class _MirrorFiles:
    """This machine's log and markdown folder as the steady-state check reads them."""

    def __init__(self, mirrors: Mirrors) -> None:
        self.mirrors = mirrors

    def torn(self) -> bool:
        size = self.mirrors.jsonl.size()
        if size == 0:
            return False
        with open(self.mirrors.jsonl.path, "rb") as handle:
            handle.seek(size - 1)
            return handle.read(1) != b"\n"

    def continues_at(self, offset: int, line_hash: str | None) -> bool:
        return self.mirrors.jsonl.continues_at(offset, line_hash)

    def accepted_since(self, offset: int) -> Collection[str]:
        return {
            str(line.event.get("key"))
            for line in self.mirrors.jsonl.lines(offset)
            if line.event.get("event") == MirrorEvent.ACCEPTED
        }

    def has_file(self, name: str) -> bool:
        return self.mirrors.path(name).exists()

    def end(self) -> tuple[int, str | None]:
        return self.mirrors.jsonl.end()
