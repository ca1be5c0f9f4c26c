"""``Outbox.forget``: a record removed from the database, every sink and both mirrors.

The forget commits first (tombstone, search row, graph node, one delete per sink), so from
then on nothing serves or sends the content; the mirrors follow under the mirror lock, and a
crash in between is finished by the next repair. The database's leftover copies (old search
index segments, WAL frames) go in ``purge``, which is heavier, so it runs after the answer:
at the end of ``outbox forget``, in a dispatcher's maintenance, or when the caller asks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outbox.mirror.forget import Redactor
from outbox.operations.catalog import NoSuchRecord
from outbox.store.forgetting import PurgeResult

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from collections.abc import Callable

    from outbox.core.config import Settings
    from outbox.mirror.mirrors import Mirrors
    from outbox.operations.catalog import Catalog
    from outbox.store.storage import Storage


@dataclass(frozen=True)
class ForgetReceipt:
    """What a forget did: the sinks that get a delete, those the record never reached."""

    key: str
    sinks: list[str] = field(default_factory=list)
    never_sent: list[str] = field(default_factory=list)
    already: bool = False
    leftovers: int = 0  # files still carrying the key that a repeated forget removed

    @property
    def text(self) -> str:
        if self.already and self.leftovers:
            return (
                f"Forgotten {self.key[:12]} (it already was; {self.leftovers} leftover "
                "markdown files removed)"
            )
        if self.already:
            return f"Forgotten {self.key[:12]} (it already was)"
        if not self.sinks:
            return f"Forgotten {self.key[:12]}; no sink had it"
        return f"Forgotten {self.key[:12]}; deletes queued for {', '.join(self.sinks)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "status": "forgotten",
            "deletes_queued": self.sinks,
            "never_sent": self.never_sent,
            "already": self.already,
            "leftovers_removed": self.leftovers,
        }


class Forgetter:
    """Forget by key prefix, and purge what forgets leave in the database files."""

    def __init__(
        self,
        storage: Storage,
        mirrors: Mirrors,
        catalog: Catalog,
        settings: Settings,
        wake: Callable[[], None],
    ) -> None:
        self.storage = storage
        self.mirrors = mirrors
        self.catalog = catalog
        self.settings = settings
        self.wake = wake
        self._purge_owed = False  # this process forgot something and has not purged since

    def forget(self, prefix: str) -> ForgetReceipt:
        """Forget the one record whose key starts with ``prefix``; raises ``NoSuchRecord``,
        or ``ValidationError`` for a prefix that is not hex or names several records."""
        key = self.catalog.resolve(prefix)
        plan = self.storage.forgetting.forget(key, self.settings.sinks)
        if plan is None:
            raise NoSuchRecord(f"no record has a key starting with {prefix!r}")
        self._purge_owed = not plan.already or self._purge_owed
        if plan.deletes:
            self.wake()  # this process's dispatcher, at once; others within one poll
        leftovers = 0
        try:
            # The exclusive mirror lock waits for this process's queued mirror writes, so
            # the record's own line and file exist before the redaction looks for them.
            with self.mirrors.hold():
                redactor = Redactor(
                    self.storage,
                    self.mirrors.jsonl,
                    self.mirrors.markdown_dir,
                    self.mirrors.mirror_id,
                )
                item = None if plan.already else self.storage.records.get_record(key)
                if item is not None and item.origin == self.mirrors.mirror_id:
                    redactor.finish(item, resumed=False)  # its own mirrors: at once
                    self.storage.forgetting.mirrors_done([key])
                redactor.run()  # any forget a crash left unfinished
                if plan.already:  # asked again: finish what an earlier one could not reach
                    leftovers = redactor.sweep(key)
        except OSError as exc:  # committed: the next repair finishes the mirrors
            log.warning(
                "record %s forgotten; its mirrors are finished at the next open (%s)",
                key[:12],
                exc.strerror or exc.__class__.__name__,
            )
        return ForgetReceipt(key, plan.deletes, plan.never_sent, plan.already, leftovers)

    def purge(self) -> PurgeResult:
        """Remove the database's own leftover copies of forgotten records (see the store)."""
        result = self.storage.forgetting.purge()
        self._purge_owed = not result.complete
        return result

    def purge_if_due(self) -> None:
        """At open and in a dispatcher's maintenance: purge when a forget waits for it. A
        busy database only delays it to the next round; it never fails an open."""
        try:
            if self.storage.forgetting.purge_due():
                self.purge()
        except Exception as exc:
            log.warning("purge of forgotten records deferred (%s)", exc.__class__.__name__)

    def close(self) -> None:
        """Purge before the process ends if it forgot something: nobody else may open the
        store for a long time. A failure here is left to the next open's purge."""
        if not self._purge_owed:
            return
        try:
            self.purge()
        except Exception as exc:
            log.warning("purge of forgotten records deferred (%s)", exc.__class__.__name__)
