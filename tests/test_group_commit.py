"""Group commit: concurrent writers in one process share a transaction, and every caller
still gets its own receipt, its own mirror lines and its own time bound."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from outbox import Outbox, Receipt, Settings
from outbox.core.record import build_record
from outbox.core.slugs import markdown_filename
from outbox.core.states import ReceiptStatus
from outbox.store.sqlite_writes import apply_discipline, sqlite_path
from outbox.store.transactions import SqliteTransactions

TS = "2026-11-29T08:00:00.000000Z"


class Gate:
    """Holds the first transaction's COMMIT until ``ready()`` is true, counts commits, and
    fails the commits named in ``fail`` (a database that stopped taking writes).

    It sits in the writer's own bare-driver connection (the SQLite write path runs no
    SQLAlchemy), opened as a subclass of ``sqlite3.Connection`` that sees each COMMIT.
    """

    def __init__(
        self,
        ob: Outbox,
        ready: Callable[[], bool],
        fail: frozenset[int] = frozenset(),
        before_commit: Callable[[], object] | None = None,
    ):
        self.writer = ob.writer
        self.ready = ready
        self.fail = fail
        self.before_commit = before_commit
        self.commits = 0
        self.transactions = sqlite_transactions(ob)
        self.original = self.transactions.connect
        path = sqlite_path(ob.settings.db_url)
        assert path is not None
        gate = self

        class Gated(sqlite3.Connection):
            def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
                if sql == "COMMIT":
                    gate._on_commit()
                return super().execute(sql, *args)

        def connect() -> sqlite3.Connection:
            conn = sqlite3.connect(path, check_same_thread=False, factory=Gated)
            busy_ms = int(ob.settings.busy_timeout * 1000)
            apply_discipline(
                conn, busy_ms=busy_ms, synchronous=ob.settings.synchronous, writer=True
            )
            return conn

        ob.writer.close()  # the next write opens a gated connection
        self.transactions.connect = connect

    def _on_commit(self) -> None:
        self.commits += 1
        if self.before_commit is not None:
            self.before_commit()
        if self.commits == 1:
            deadline = time.monotonic() + 10
            while not self.ready() and time.monotonic() < deadline:
                time.sleep(0.001)
        if self.commits in self.fail:
            raise sqlite3.OperationalError("disk I/O error")

    def remove(self) -> None:
        self.writer.close()
        self.transactions.connect = self.original


def sqlite_transactions(ob: Outbox) -> SqliteTransactions:
    """The writer's transactions on the bare driver, whose ``connect`` a test may wrap."""
    transactions = ob.writer.transactions
    assert isinstance(transactions, SqliteTransactions)
    return transactions


def queued(ob: Outbox, count: int) -> Callable[[], bool]:
    return lambda: ob.writer.queue.waiting >= count


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.001)


def run_in_threads(
    ob: Outbox, calls: list[dict[str, Any]]
) -> tuple[dict[int, Receipt], dict[int, BaseException]]:
    """The first call starts alone; the others once it leads (inside its transaction).
    Returns each call's receipt, or what it raised (an interrupt, in some tests)."""
    receipts: dict[int, Receipt] = {}
    raised: dict[int, BaseException] = {}

    def work(number: int) -> None:
        try:
            receipts[number] = ob.add(**calls[number])
        except BaseException as exc:
            raised[number] = exc

    threads = [threading.Thread(target=work, args=(n,)) for n in range(len(calls))]
    threads[0].start()
    wait_until(lambda: ob.writer.queue.leading)
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(30)
    return receipts, raised


def add_in_threads(ob: Outbox, calls: list[dict[str, Any]]) -> list[Receipt]:
    """``run_in_threads`` where no call may raise; receipts in call order."""
    receipts, raised = run_in_threads(ob, calls)
    assert not raised, raised
    return [receipts[n] for n in range(len(calls))]


@pytest.fixture
def ob(settings: Settings) -> Iterator[Outbox]:
    outbox = Outbox.open(settings)
    yield outbox
    outbox.close()


def test_writers_arriving_during_a_commit_share_the_next_transaction(ob: Outbox) -> None:
    texts = [f"memory number {n} from its own thread" for n in range(5)]
    gate = Gate(ob, queued(ob, 4))
    receipts = add_in_threads(ob, [{"content": text} for text in texts])

    assert gate.commits == 2  # the first alone, the four that queued behind it together
    assert [r.status for r in receipts] == [ReceiptStatus.QUEUED] * 5
    assert not any(r.duplicate for r in receipts)
    stored = {row.record.key: row.record.content for row in ob.storage.records.iter_records()}
    assert stored == {r.key: text for r, text in zip(receipts, texts, strict=True)}
    assert ob.wait_mirrored(10)  # the receipts promise the commit; the files follow
    lines = [json.loads(line) for line in ob.settings.jsonl_path.read_text().splitlines()]
    assert sorted(line["key"] for line in lines) == sorted(r.key for r in receipts)
    for receipt, text in zip(receipts, texts, strict=True):
        assert receipt.markdown_path.read_bytes().endswith(text.encode())
    assert ob.verify().ok


def test_the_same_record_twice_in_one_group_is_one_record(ob: Outbox) -> None:
    gate = Gate(ob, queued(ob, 3))
    calls = [{"content": "the opener", "timestamp": TS}]
    calls += [{"content": "the same memory", "timestamp": TS}] * 3
    receipts = add_in_threads(ob, calls)

    assert gate.commits == 2
    twins = receipts[1:]
    assert len({r.key for r in twins}) == 1
    assert sorted(r.duplicate for r in twins) == [False, True, True]
    assert {r.markdown_path for r in twins} == {twins[0].markdown_path}
    assert ob.storage.records.count_records() == 2
    assert ob.wait_mirrored(10)
    assert len(list(ob.markdown_dir.glob("*.md"))) == 2
    assert ob.verify().ok


def test_a_failed_group_commit_sends_every_caller_in_it_to_the_fallback(ob: Outbox) -> None:
    texts = [f"memory {n} that must not be lost" for n in range(4)]
    gate = Gate(ob, queued(ob, 3), fail=frozenset({2}))
    receipts = add_in_threads(ob, [{"content": text} for text in texts])

    assert gate.commits == 2
    assert receipts[0].status == ReceiptStatus.QUEUED
    assert [r.status for r in receipts[1:]] == [ReceiptStatus.FALLBACK] * 3
    assert all(r.markdown_path.exists() for r in receipts[1:])
    assert ob.storage.records.count_records() == 1

    gate.remove()
    assert len(ob.import_fallback().imported) == 3
    assert {row.record.key for row in ob.storage.records.iter_records()} == {
        r.key for r in receipts
    }
    assert ob.verify().ok


def test_a_writer_queued_past_its_time_bound_falls_back_in_time(settings: Settings) -> None:
    ob = Outbox.open(dataclasses.replace(settings, busy_timeout=0.05))
    try:
        release = threading.Event()
        gate = Gate(ob, release.is_set)
        leader = threading.Thread(target=ob.add, args=("the slow leader",))
        leader.start()
        wait_until(lambda: ob.writer.queue.leading)
        started = time.monotonic()
        late = ob.add("a writer stuck behind the leader")
        waited = time.monotonic() - started
        release.set()
        leader.join(30)
        assert late.status == ReceiptStatus.FALLBACK
        assert late.markdown_path.exists()
        assert waited < 5  # its bound is 0.55 s; generous for a loaded machine
        assert gate.commits == 1
        assert ob.storage.records.count_records() == 1
    finally:
        ob.close()


def test_an_interrupted_leader_sends_the_others_to_the_fallback_and_hands_on(ob: Outbox) -> None:
    """KeyboardInterrupt in the thread leading a group is that thread's alone: the others
    in its group fall back (nothing lost), and the next write in the process still commits."""

    class Interrupting(Gate):
        def _on_commit(self) -> None:
            self.commits += 1
            if self.commits == 1:
                wait_until(self.ready)
            elif self.commits == 2:
                raise KeyboardInterrupt

    Interrupting(ob, queued(ob, 3))
    calls = [{"content": f"memory {n} written while someone hits Ctrl-C"} for n in range(4)]
    receipts, raised = run_in_threads(ob, calls)

    assert len(raised) == 1 and isinstance(next(iter(raised.values())), KeyboardInterrupt)
    assert receipts[0].status == ReceiptStatus.QUEUED
    fallen = [r for n, r in receipts.items() if n != 0]
    assert len(fallen) == 2 and all(r.status == ReceiptStatus.FALLBACK for r in fallen)
    assert not ob.writer.queue.leading and not ob.writer.queue.waiting
    assert ob.add("the next write after the interrupt").status == ReceiptStatus.QUEUED


def test_a_caller_interrupted_after_being_handed_the_lead_hands_it_on(ob: Outbox) -> None:
    """Otherwise the lead sat with a caller that had gone, and every later write in the
    process waited out its bound and fell back."""
    gate = Gate(ob, queued(ob, 2))
    original = ob.writer.queue.wait_turn
    interrupted: list[BaseException] = []
    receipts: dict[int, Receipt] = {}

    def wait_then_interrupt(ticket: Any) -> None:
        original(ticket)
        if ticket.items[0].record.content.startswith("interrupted") and ticket.lead:
            raise KeyboardInterrupt

    ob.writer.queue.wait_turn = wait_then_interrupt  # type: ignore[method-assign]

    def work(number: int, text: str) -> None:
        try:
            receipts[number] = ob.add(text)
        except KeyboardInterrupt as exc:
            interrupted.append(exc)

    leader = threading.Thread(target=work, args=(0, "the leader"))
    leader.start()
    wait_until(lambda: ob.writer.queue.leading)
    first = threading.Thread(target=work, args=(1, "interrupted as it takes the lead"))
    first.start()
    wait_until(queued(ob, 1))
    second = threading.Thread(target=work, args=(2, "the one behind it"))
    second.start()
    for thread in (leader, first, second):
        thread.join(30)

    assert len(interrupted) == 1
    assert receipts[0].status == ReceiptStatus.QUEUED and receipts[2].status == ReceiptStatus.QUEUED
    assert gate.commits == 2
    assert not ob.writer.queue.leading and not ob.writer.queue.waiting
    assert ob.storage.records.count_records() == 2


def test_a_name_taken_by_a_fallback_file_during_the_commit_moves_the_record(ob: Outbox) -> None:
    """A fallback writer (outside the mirror lock) may create the very name the transaction
    chose before the mirror writer creates the file; the committed record then gets its
    -<key8> name, in the database and on disk (its receipt, issued at the commit, named the
    file it was to have)."""
    content = "the name of this memory is taken while it commits"
    foreign = b"---\nkey: someone-else\n---\nanother memory\n"
    record = build_record(content, timestamp=TS)
    ob.markdown_dir.mkdir(parents=True, exist_ok=True)
    chosen = ob.markdown_dir / markdown_filename(record.timestamp, record.slug)

    def create_foreign_file() -> None:
        chosen.write_bytes(foreign)

    gate = Gate(ob, lambda: True, before_commit=create_foreign_file)
    try:
        receipt = ob.add(content, timestamp=TS)
    finally:
        gate.remove()

    assert receipt.status == ReceiptStatus.QUEUED
    assert ob.wait_mirrored(10)
    assert chosen.read_bytes() == foreign  # the other key's file is left alone
    moved = ob.markdown_path(receipt.key)
    assert moved is not None and moved != chosen
    assert moved.name.endswith(f"-{receipt.key[:8]}.md")
    assert moved.read_bytes().endswith(content.encode())
    (line,) = [json.loads(raw) for raw in ob.settings.jsonl_path.read_text().splitlines()]
    assert line["markdown"] == moved.name
    assert ob.verify().ok


def test_a_group_is_written_with_one_statement_per_table(ob: Outbox) -> None:
    """The leader looks the whole group up at once and inserts its records in one
    statement (the other tables' rows in one prepared statement each), so a group costs
    about what one record costs in statements."""
    statements: list[str] = []
    gate = Gate(ob, queued(ob, 6))
    gated = sqlite_transactions(ob).connect
    assert gated is not None

    def traced() -> sqlite3.Connection:
        conn = gated()
        conn.set_trace_callback(statements.append)
        return conn

    sqlite_transactions(ob).connect = traced
    receipts = add_in_threads(ob, [{"content": f"grouped memory {n}"} for n in range(7)])
    gate.remove()
    assert gate.commits == 2  # the first alone, then the six that queued behind it together
    assert not any(r.duplicate for r in receipts)

    def count(prefix: str) -> int:
        return sum(1 for sql in statements if sql.lstrip().startswith(prefix))

    assert count('SELECT "key", markdown_name FROM records') == 2  # one lookup per group
    assert count("INSERT INTO records (") == 2  # one multi-row insert per group
    assert ob.storage.records.count_records() == 7
    assert ob.wait_mirrored(10) and ob.verify().ok
