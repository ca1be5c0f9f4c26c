"""A state machine over the outbox's life: writes, claims, deliveries, failures, crashes,
fallback files and reopens, in any order Hypothesis finds, with the invariants checked after
every step.

A crash is an ``Outbox`` dropped without ``close``, sometimes after tearing the JSONL tail or
deleting a record's markdown file (what a process killed between its commit and its mirror
writes leaves behind). A fallback write goes through ``FallbackQueue.write`` as if the
database had been locked. The database is read with ``sqlite3`` directly and the mirrors
with the outsider's readers of ``tests/helpers/checks.py``, not through the library.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from outbox import Outbox, load_settings
from outbox.core.record import build_record
from outbox.dispatch.retry import RetryPolicy
from outbox.testing.sinks import FaultySink
from outbox.write.fallback import INDEX_NAME, FallbackQueue
from tests.conftest import FAULTY
from tests.helpers.checks import accepted_counts, contract_key, files_by_key, front_matter

# Failed deliveries are due again within milliseconds, and never run out of retries here.
EAGER = RetryPolicy(max_retries=100_000, base=0.001, cap=0.002)

# Content that exercises the byte-for-byte promise: line ends, fences, non-ASCII.
TEXT = st.lists(
    st.sampled_from(["a", "Z", "7", " ", "\n", "\r\n", "-", "---\n", "é", "🙂", ":"]),
    max_size=12,
).map("".join)


class OutboxLife(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="outbox-stateful-"))
        self.settings = load_settings(
            env={},
            home=self.folder / "home",
            markdown_dir=self.folder / "decisions",
            sinks=FAULTY,
            busy_timeout=2.0,
        )
        self.db_path = self.settings.home / "outbox.db"
        self.ob: Outbox | None = Outbox.open(self.settings)
        self.acked: dict[str, tuple[str, str]] = {}  # key -> (content, timestamp)
        self.only_in_fallback: set[str] = set()
        # Records committed since the last open's repair: the ones a crash can leave unmirrored
        # (repair checks what is past its watermark, not every file ever written).
        self.since_repair: set[str] = set()
        self.counter = 0

    def teardown(self) -> None:
        if self.ob is not None:
            self.ob.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # -- helpers ------------------------------------------------------------------------------

    def _next(self, text: str) -> tuple[str, str]:
        self.counter += 1
        stamp = f"2026-11-{1 + self.counter % 28:02d}T08:00:00.{self.counter:06d}Z"
        return f"memory {self.counter}{text}", stamp

    def _pick(self, fresh: bool, text: str, index: int) -> tuple[str, str]:
        if fresh or not self.acked:
            return self._next(text)
        return list(self.acked.values())[index % len(self.acked)]

    def _query(self, sql: str) -> list[tuple[object, ...]]:
        conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=10)
        try:
            return conn.execute(sql).fetchall()
        finally:
            conn.close()

    def _db_keys(self) -> set[str]:
        return {str(row[0]) for row in self._query("SELECT key FROM records")}

    def _delivered_keys(self) -> set[str]:
        rows = self._query("SELECT record_key FROM deliveries WHERE state = 'delivered'")
        return {str(row[0]) for row in rows}

    def _tear_last_line(self, amount: int) -> None:
        """Cut into the JSONL's last line, as a process killed mid-append leaves it.

        Only a line written since the last repair: one the repair had already seen complete
        can only go missing through a lost disk write (power failure), not a killed process.
        """
        path = self.settings.jsonl_path
        data = path.read_bytes() if path.exists() else b""
        if not data:
            return
        start = data.rfind(b"\n", 0, len(data) - 1) + 1
        ((watermark,),) = self._query("SELECT coalesce(max(jsonl_offset), 0) FROM mirror_state")
        if start < int(watermark):  # type: ignore[call-overload]
            return
        with path.open("r+b") as handle:
            handle.truncate(len(data) - 1 - amount % (len(data) - start))

    def _key_of_file(self, path: Path) -> str:
        return str(front_matter(self.settings.markdown_dir / path.name)["key"])

    def _sink(self, **faults: float) -> FaultySink:
        return FaultySink(self.folder / "sink.db", FAULTY, **faults)

    # -- rules --------------------------------------------------------------------------------

    @rule(fresh=st.booleans(), text=TEXT, index=st.integers(0, 1000))
    def add(self, fresh: bool, text: str, index: int) -> None:
        ob = self._open()
        content, stamp = self._pick(fresh, text, index)
        key = contract_key(content, stamp)
        in_db = key in self._db_keys()
        receipt = ob.add(content, timestamp=stamp)
        # The files follow the commit on the mirror writer's thread; the invariants read
        # them, and a crash here means a killed process, whose thread would be gone too.
        assert ob.wait_mirrored(10)
        assert receipt.key == key
        assert receipt.duplicate == in_db  # a key only in a fallback file is not in the outbox
        delivered = receipt.key in self._delivered_keys()
        assert receipt.status == ("stored" if delivered else "queued")
        if not receipt.duplicate:
            self.since_repair.add(receipt.key)
        self.acked[receipt.key] = (content, stamp)
        self.only_in_fallback.discard(receipt.key)

    @rule(fresh=st.booleans(), text=TEXT, index=st.integers(0, 1000))
    def fallback_write(self, fresh: bool, text: str, index: int) -> None:
        """What ``add`` does when the database is locked: the record goes to a fallback file."""
        content, stamp = self._pick(fresh, text, index)
        record = build_record(content, timestamp=stamp)
        queue = FallbackQueue(self.settings.markdown_dir, self.settings.sinks)
        path, _existed = queue.write(record, "db_busy")
        assert path.is_file()
        if record.key not in self._db_keys():
            self.only_in_fallback.add(record.key)
        self.acked[record.key] = (content, stamp)

    @rule(limit=st.integers(1, 8))
    def claim_and_vanish(self, limit: int) -> None:
        """A dispatcher claims rows and dies: its lease runs out in a millisecond."""
        self._open().storage.deliveries.claim(
            FAULTY, "a-dispatcher-that-died", limit, lease_seconds=0.001
        )

    @rule()
    def deliver(self) -> None:
        with self._open().dispatcher(sink_objects={FAULTY: self._sink()}, policy=EAGER) as d:
            d.drain()

    @rule(null_ack=st.booleans())
    def fail(self, null_ack: bool) -> None:
        """One batch against a sink that closes the transport, or acks with no id."""
        faults = {"null_rate": 1.0} if null_ack else {"fail_rate": 1.0}
        with self._open().dispatcher(
            sink_objects={FAULTY: self._sink(**faults)}, policy=EAGER
        ) as d:
            d.workers[FAULTY].run_batch()

    @rule()
    def import_fallback(self) -> None:
        """What a running dispatcher's maintenance does from time to time."""
        report = self._open().import_fallback()
        self.since_repair |= {self._key_of_file(Path(name)) for name in report.imported}
        self.only_in_fallback -= self._db_keys()

    @rule(
        damage=st.sampled_from(["none", "cut_jsonl", "delete_markdown"]), amount=st.integers(1, 300)
    )
    def crash(self, damage: str, amount: int) -> None:
        """Drop the outbox without closing it, maybe with a mirror write lost on the way."""
        if damage == "cut_jsonl":
            self._tear_last_line(amount)
        elif damage == "delete_markdown" and self.since_repair:
            # Killed after the commit, before the markdown file was written.
            rows = self._query("SELECT key, markdown_name FROM records")
            names = sorted(str(name) for key, name in rows if key in self.since_repair)
            (self.settings.markdown_dir / names[amount % len(names)]).unlink(missing_ok=True)
        self.ob = None

    @rule()
    def reopen(self) -> None:
        if self.ob is not None:
            self.ob.close()
            self.ob = None
        self._open()

    def _open(self) -> Outbox:
        """The open outbox; after a crash, a new process opening it, checked strictly: every
        key exactly one record, one accepted JSONL line and one markdown file."""
        if self.ob is not None:
            return self.ob
        self.ob = Outbox.open(self.settings)
        assert self.ob.unavailable is None
        self.only_in_fallback.clear()
        self.since_repair.clear()
        db_keys = self._db_keys()
        assert db_keys == set(self.acked)  # exactly the acknowledged keys, each one record
        assert accepted_counts(self.settings.jsonl_path) == dict.fromkeys(db_keys, 1)
        by_key = files_by_key(self.settings.markdown_dir)
        assert {key: len(files) for key, files in by_key.items()} == dict.fromkeys(db_keys, 1)
        for key, (content, _stamp) in self.acked.items():
            stored = self.ob.storage.records.get_record(key)
            assert stored is not None and stored.record.content == content
        report = self.ob.verify()
        assert report.ok, report.problems
        return self.ob

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def every_acknowledged_key_is_somewhere_durable(self) -> None:
        db_keys = self._db_keys()
        waiting = set()
        index = self.settings.markdown_dir / INDEX_NAME
        listed = set()
        for name in (index, index.with_name(INDEX_NAME + ".processing")):
            if name.exists():
                listed |= set(name.read_text(encoding="utf-8").split())
        for key, files in files_by_key(self.settings.markdown_dir).items():
            for path in files:
                if front_matter(path).get("outbox_fallback") is True and path.name in listed:
                    waiting.add(key)
        missing = set(self.acked) - db_keys - waiting
        assert not missing, missing
        assert self.only_in_fallback <= waiting

    @invariant()
    def no_delivery_is_delivered_without_a_sink_id(self) -> None:
        rows = self._query(
            "SELECT count(*) FROM deliveries WHERE state = 'delivered' "
            "AND (sink_id IS NULL OR sink_id = '')"
        )
        assert rows == [(0,)]

    @invariant()
    def delivered_keys_are_never_reported_queued(self) -> None:
        if self.ob is None:
            return
        delivered = self._delivered_keys()
        for key in self._db_keys():
            receipt = self.ob.wait_delivered(key, timeout=0)
            assert receipt.status == ("stored" if key in delivered else "queued"), key
            if key in delivered:
                assert receipt.text.startswith("Stored in FaultySink: faulty-")
            else:
                assert "Stored" not in receipt.text


OutboxLife.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestOutboxLife = OutboxLife.TestCase
