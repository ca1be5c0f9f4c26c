"""Group commit: threads of one process that write at the same time share one transaction.

While one transaction commits, callers that arrive queue up; the next to lead commits all of
them at once, so they pay one fsync between them instead of one each. Every caller keeps its
own result and its own time bound. Knows nothing of SQL or files: it is handed the function
that commits a list of items (records, each with the file its caller rendered).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from outbox.core.errors import MirrorBusy

Item = TypeVar("Item")  # what a caller commits
T = TypeVar("T")  # what it gets back, one per item

# Commits ``items`` as one transaction bounded by ``deadline``; one result per item.
CommitFn = Callable[[Sequence[Item], float], list[T]]


@dataclass(eq=False)
class Ticket(Generic[Item, T]):
    """One caller's items waiting to be committed, alone or in a group with others'."""

    items: Sequence[Item]
    deadline: float
    done: threading.Event | None = None  # only a ticket that waits needs one
    lead: bool = False
    passed: bool = False  # this ticket led and handed the lead on
    results: list[T] | None = None
    error: BaseException | None = None


class GroupCommit(Generic[Item, T]):
    """The queue of callers and the lead that passes between them."""

    def __init__(self, commit: CommitFn[Item, T]) -> None:
        self._commit = commit
        self._lock = threading.Lock()
        self._waiting: list[Ticket[Item, T]] = []
        self._leading = False

    @property
    def leading(self) -> bool:
        """Whether a caller is committing a group right now."""
        return self._leading

    @property
    def waiting(self) -> int:
        """How many callers are queued (the leader's own ticket until it takes the queue)."""
        return len(self._waiting)

    def submit(self, items: Sequence[Item], deadline: float) -> list[T]:
        """Commit ``items`` in this caller's group; one result per item, in order.

        A group commits as a whole or not at all: if its transaction fails, every caller
        in it sees that error.
        """
        ticket: Ticket[Item, T] = Ticket(items, deadline)
        with self._lock:
            self._waiting.append(ticket)
            if self._leading:
                ticket.done = threading.Event()
            else:
                self._leading = ticket.lead = True
        try:
            if not ticket.lead:
                self.wait_turn(ticket)
            if ticket.lead:
                self._lead(ticket)
        except BaseException:
            self._abandon(ticket)
            raise
        if ticket.error is not None:
            raise ticket.error
        assert ticket.results is not None
        return ticket.results

    def wait_turn(self, ticket: Ticket[Item, T]) -> None:
        """Wait until a leader has committed this ticket or handed over the lead to it.

        A ticket nobody has taken by its deadline leaves the queue and fails in time (the
        caller falls back); one already taken waits for its group, whose leader is bounded.
        """
        assert ticket.done is not None
        if ticket.done.wait(max(0.0, ticket.deadline - time.monotonic())):
            return
        with self._lock:
            if not ticket.lead and ticket in self._waiting:
                self._waiting.remove(ticket)
                raise MirrorBusy("other writers held the write queue past the write's time bound")
        ticket.done.wait()

    def _lead(self, own: Ticket[Item, T]) -> None:
        """Commit every queued ticket as one group, then pass the lead to the next in line.

        The group's bound is its earliest deadline, so no caller in it waits past its own.
        """
        group: list[Ticket[Item, T]] = []
        try:
            with self._lock:
                group, self._waiting = self._waiting, []
            items = [item for ticket in group for item in ticket.items]
            results = self._commit(items, min(ticket.deadline for ticket in group))
        except BaseException as exc:
            for ticket in group or [own]:  # empty: interrupted before taking the queue
                # Only the leader's own thread sees an interrupt (KeyboardInterrupt,
                # SystemExit); the others' writes just did not commit, and fall back.
                interrupted = ticket is not own and not isinstance(exc, Exception)
                ticket.error = MirrorBusy("its group was interrupted") if interrupted else exc
        else:
            start = 0
            for ticket in group:
                ticket.results = results[start : start + len(ticket.items)]
                start += len(ticket.items)
        finally:
            own.passed = True
            with self._lock:
                if own in self._waiting:  # interrupted before taking the queue
                    self._waiting.remove(own)
                self._pass_lead()
            for ticket in group:
                if ticket.done is not None:
                    ticket.done.set()

    def _pass_lead(self) -> None:
        """Wake the first waiting ticket as the next leader, or mark nobody leading.
        Call with the queue lock held."""
        if self._waiting:
            successor = self._waiting[0]
            successor.lead = True
            assert successor.done is not None
            successor.done.set()
        else:
            self._leading = False

    def _abandon(self, ticket: Ticket[Item, T]) -> None:
        """An interrupted caller leaves the queue, and hands on a lead it never used."""
        with self._lock:
            if ticket in self._waiting:
                self._waiting.remove(ticket)
            if ticket.lead and not ticket.passed:
                ticket.passed = True
                self._pass_lead()
