"""The markdown and JSONL mirrors (contract sections 3 and 4): exact bodies, loadable front
matter, owner-only files, a hash-chained log, and repair that restores each record once."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox import Outbox, Settings, load_settings
from outbox.core.record import build_record
from outbox.mirror import markdown
from outbox.mirror.matter import initial
from tests.conftest import FAULTY

TS = "2026-11-29T08:00:00.000000Z"
GENESIS = "0" * 64

texts = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
contents = st.text(alphabet=texts, min_size=1).filter(lambda text: text.strip() != "")
tag_lists = st.lists(
    st.text(alphabet=texts, min_size=1, max_size=30).filter(lambda tag: tag.strip() != ""),
    max_size=6,
)


def split_file(data: bytes) -> tuple[bytes, bytes]:
    """(front matter, body): the body starts after the first line that is exactly ``---``."""
    lines = data.split(b"\n")
    assert lines[0] == b"---"
    close = lines.index(b"---", 1)
    return b"\n".join(lines[1:close]) + b"\n", b"\n".join(lines[close + 1 :])


def expected_tags(tags: list[str]) -> list[str]:
    return list(dict.fromkeys(tag.strip() for tag in tags))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- the markdown file -------------------------------------------------------------------

AWKWARD = {
    "crlf": "line one\r\nline two\r\n",
    "trailing spaces": "ends with spaces   ",
    "no final newline": "no newline at the end",
    "final newlines": "two newlines at the end\n\n",
    "emoji": "memory 🧠 with emoji 🙂 and ZWJ 👩‍💻",
    "yaml fences": "---\nkey: value\n---\nmore: text\n---",
    "yaml document": "key: value\nlist:\n  - a\n  - b\nchunk_id: 42\n",
    "leading fence": "---\n",
    "lone cr": "old mac\rline endings\r",
    "bom and controls": "\ufeffstarts with a BOM\x07\x1b[0m\x85\u2028\u2029",
    "tabs and blanks": "\t\tindented\n\n\n   \n",
    "long line": "x" * 100_000,
}


@pytest.mark.parametrize("content", AWKWARD.values(), ids=AWKWARD.keys())
def test_body_is_the_content_byte_for_byte(outbox: Outbox, content: str) -> None:
    receipt = outbox.add(content, timestamp=TS, tags=["decision"])
    assert receipt.markdown_path is not None
    assert outbox.wait_mirrored(10)  # a receipt promises the commit; the file follows
    data = receipt.markdown_path.read_bytes()
    matter, body = split_file(data)
    assert body == content.encode("utf-8")
    assert yaml.safe_load(matter)["key"] == receipt.key
    assert outbox.verify().ok


def test_front_matter_is_the_contracts(outbox: Outbox) -> None:
    receipt = outbox.add(
        "Use SQLite WAL for the outbox.",
        importance=7,
        tags=["decision", "storage"],
        timestamp="2026-11-29T09:00:00+01:00",
    )
    assert receipt.markdown_path is not None
    assert outbox.wait_mirrored(10)
    matter_bytes, _ = split_file(receipt.markdown_path.read_bytes())
    text = matter_bytes.decode("utf-8")
    lines = text.splitlines()
    assert lines[:8] == [
        "intended_brain_store: false",
        "importance: 7",
        "tags: [decision, storage]",
        "timestamp: '2026-11-29T08:00:00.000000Z'",
        "reason: pending",
        "retry_attempted: false",
        "chunk_id:",
        f"key: {receipt.key}",
    ]
    loaded = yaml.safe_load(text)
    assert loaded["timestamp"] == "2026-11-29T08:00:00.000000Z"  # a string, not a datetime
    assert loaded["chunk_id"] is None
    assert loaded["intended_brain_store"] is False
    assert loaded["retry_attempted"] is False


def test_intended_brain_store_is_true_with_a_brainlayer_sink(tmp_path: Path) -> None:
    """The write path never loads a sink, so naming brainlayer costs nothing here."""
    settings = load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks=f"brainlayer,{FAULTY}",
    )
    with Outbox.open(settings) as ob:
        receipt = ob.add("a memory meant for BrainLayer", timestamp=TS)
        assert receipt.markdown_path is not None
        assert ob.wait_mirrored(10)
        matter, _ = split_file(receipt.markdown_path.read_bytes())
        loaded = yaml.safe_load(matter)
        assert loaded["intended_brain_store"] is True
        assert loaded["chunk_id"] is None
        assert receipt.text == f"Queued {receipt.key} for BrainLayer, FaultySink"


@settings(max_examples=200)
@given(content=contents, tags=tag_lists, importance=st.integers(1, 10))
def test_rendered_file_loads_and_keeps_the_body(
    content: str, tags: list[str], importance: int
) -> None:
    record = build_record(content, importance=importance, tags=tags, timestamp=TS)
    data = markdown.render(initial(record, ["brainlayer"]), content)
    matter, body = split_file(data)
    loaded = yaml.safe_load(matter)
    assert body == content.encode("utf-8")
    assert loaded["tags"] == expected_tags(tags)
    assert loaded["importance"] == importance
    assert loaded["timestamp"] == TS
    assert loaded["key"] == record.key
    assert markdown.parse(data) == (loaded, body)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(content=contents, tags=tag_lists)
def test_written_file_loads_and_keeps_the_body(
    tmp_path_factory: pytest.TempPathFactory, content: str, tags: list[str]
) -> None:
    root = tmp_path_factory.mktemp("md")
    settings = load_settings(env={}, home=root / ".outbox", markdown_dir=root / "md", sinks=FAULTY)
    with Outbox.open(settings) as ob:
        receipt = ob.add(content, tags=tags, timestamp=TS)
        assert receipt.markdown_path is not None
        assert ob.wait_mirrored(10)
        matter, body = split_file(receipt.markdown_path.read_bytes())
        assert body == content.encode("utf-8")
        loaded = yaml.safe_load(matter)
        assert loaded["tags"] == expected_tags(tags)
        assert loaded["key"] == receipt.key
        (line,) = [line.event for line in ob.mirrors.jsonl.lines()]
        assert line["content"] == content
        assert line["tags"] == expected_tags(tags)
        assert ob.verify().ok


@pytest.fixture
def no_umask() -> Iterator[None]:
    """Umask 0: owner-only modes must come from the library, not from the user's umask."""
    old = os.umask(0)
    yield
    os.umask(old)


@pytest.mark.usefixtures("no_umask")
def test_files_are_owner_only_and_created_folders_0700(tmp_path: Path) -> None:
    settings = load_settings(
        env={},
        home=tmp_path / "state" / "outbox-home",
        markdown_dir=tmp_path / "notes" / "docs.local" / "decisions",
        sinks=FAULTY,
    )
    with Outbox.open(settings) as ob:
        receipt = ob.add("private memory", timestamp=TS)
    assert receipt.markdown_path is not None
    for folder in (
        tmp_path / "notes",
        tmp_path / "notes" / "docs.local",
        settings.markdown_dir,
        tmp_path / "state",
        settings.home,
    ):
        assert mode(folder) == 0o700, folder
    for path in (receipt.markdown_path, settings.jsonl_path, settings.home / "outbox.db"):
        assert mode(path) == 0o600, path


@pytest.mark.usefixtures("no_umask")
def test_log_lock_and_database_folders_outside_home_are_0700_too(tmp_path: Path) -> None:
    """The JSONL log (and its lock) and the database may live in new folder trees of their
    own; every folder the library creates for them is owner-only, parents included."""
    settings = load_settings(
        env={},
        home=tmp_path / "home",
        jsonl_path=tmp_path / "logs" / "outbox" / "outbox.jsonl",
        db_url=f"sqlite:///{tmp_path / 'data' / 'db' / 'outbox.db'}",
        markdown_dir=tmp_path / "md",
        sinks=FAULTY,
    )
    with Outbox.open(settings) as ob:
        ob.add("a memory whose log and database live elsewhere", timestamp=TS)
    for folder in ("logs", "logs/outbox", "data", "data/db"):
        assert mode(tmp_path / folder) == 0o700, folder
    assert mode(settings.jsonl_path) == 0o600


@pytest.mark.usefixtures("no_umask")
def test_an_existing_folder_keeps_its_mode(tmp_path: Path) -> None:
    folder = tmp_path / "shared-notes"
    folder.mkdir(mode=0o755)
    settings = load_settings(env={}, home=tmp_path / ".outbox", markdown_dir=folder, sinks=FAULTY)
    with Outbox.open(settings) as ob:
        receipt = ob.add("a memory in a folder the user made", timestamp=TS)
    assert mode(folder) == 0o755
    assert receipt.markdown_path is not None
    assert mode(receipt.markdown_path) == 0o600


# -- the JSONL log -----------------------------------------------------------------------


def test_jsonl_has_one_accepted_object_per_record_in_a_hash_chain(outbox: Outbox) -> None:
    receipts = [
        outbox.add("first memory 🙂", importance=3, tags=["a"], timestamp=TS),
        *outbox.add_many(["second memory", {"content": "third memory", "tags": ["b", "c"]}]),
    ]
    outbox.add("first memory 🙂", timestamp=TS)  # a duplicate adds no line
    assert outbox.wait_mirrored(10)
    raw = outbox.settings.jsonl_path.read_bytes()
    assert raw.endswith(b"\n")
    lines = raw.split(b"\n")[:-1]
    assert len(lines) == 3
    prev = GENESIS
    for line, receipt in zip(lines, receipts, strict=True):
        event = json.loads(line.decode("utf-8"))
        assert event["event"] == "accepted"
        assert event["key"] == receipt.key
        assert event["timestamp"] == receipt.timestamp
        assert event["prev"] == prev
        prev = hashlib.sha256(line).hexdigest()
    first = json.loads(lines[0])
    assert (first["content"], first["importance"], first["tags"]) == ("first memory 🙂", 3, ["a"])
    assert "🙂".encode() in lines[0]  # UTF-8 text, not \u escapes


def test_verify_notices_an_edited_line(outbox: Outbox) -> None:
    outbox.add("the original words", timestamp=TS)
    outbox.add("a second memory", timestamp=TS)
    assert outbox.wait_mirrored(10)
    path = outbox.settings.jsonl_path
    path.write_bytes(path.read_bytes().replace(b"original words", b"forged words!!"))
    report = outbox.verify()
    assert not report.ok
    assert any("line 2 does not chain" in problem for problem in report.problems)


# -- repair on open ----------------------------------------------------------------------


def open_outbox(settings: Settings) -> Outbox:
    return Outbox.open(settings)


def file_state(ob: Outbox) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(ob.markdown_dir.glob("*.md"))}


def accepted_keys(ob: Outbox) -> list[str]:
    events = [line.event for line in ob.mirrors.jsonl.lines()]
    return [str(event["key"]) for event in events if event.get("event") == "accepted"]


@pytest.mark.parametrize("reopened_before_damage", [False, True])
def test_repair_restores_every_mirror_exactly_once(
    settings: Settings, reopened_before_damage: bool
) -> None:
    with open_outbox(settings) as ob:
        receipts = [
            ob.add(f"memory number {n} for the repair test", timestamp=TS) for n in range(5)
        ]
        assert ob.wait_mirrored(10)
        files_before = file_state(ob)
        log_before = settings.jsonl_path.read_bytes()
    if reopened_before_damage:  # the watermark now points at the end of the intact log
        open_outbox(settings).close()

    lines = log_before.split(b"\n")[:-1]
    assert len(lines) == 5
    # Drop the last accepted line, cut the one before it mid-line, delete a markdown file.
    damaged = b"\n".join(lines[:3]) + b"\n" + lines[3][: len(lines[3]) // 2]
    settings.jsonl_path.write_bytes(damaged)
    assert receipts[1].markdown_path is not None
    receipts[1].markdown_path.unlink()

    with open_outbox(settings) as ob:
        report = ob.last_repair
        assert report is not None
        assert report.torn_bytes_cut == len(lines[3]) // 2
        assert report.lines_appended == 2
        assert report.files_written == 1
        assert sorted(accepted_keys(ob)) == sorted(receipt.key for receipt in receipts)
        assert file_state(ob) == files_before
        assert ob.mirrors.jsonl.verify_chain() == []
        check = ob.verify()
        assert check.ok, check.problems
        assert (check.records, check.jsonl_lines, check.markdown_files) == (5, 5, 5)

    with open_outbox(settings) as ob:  # a second open finds nothing left to do
        report = ob.last_repair
        assert report is not None
        assert (report.torn_bytes_cut, report.lines_appended, report.files_written) == (0, 0, 0)
        assert settings.jsonl_path.read_bytes().count(b'"event":"accepted"') == 5


@pytest.mark.parametrize("kept", [0, 1, 40, -1])
def test_repair_rewrites_a_markdown_file_cut_short_while_created(
    settings: Settings, kept: int
) -> None:
    """A writer killed between creating the file and writing it leaves it empty or short."""
    with open_outbox(settings) as ob:
        receipt = ob.add("a memory whose file was cut short", tags=["t"], timestamp=TS)
    assert receipt.markdown_path is not None
    whole = receipt.markdown_path.read_bytes()
    receipt.markdown_path.write_bytes(whole[: kept if kept >= 0 else len(whole) - 1])
    with open_outbox(settings) as ob:
        assert receipt.markdown_path.read_bytes() == whole
        assert ob.verify().ok


def test_repair_leaves_a_file_the_user_edited(settings: Settings) -> None:
    with open_outbox(settings) as ob:
        receipt = ob.add("the memory as written", timestamp=TS)
    assert receipt.markdown_path is not None
    receipt.markdown_path.write_bytes(b"---\nnote: mine\n---\nthe memory as I rewrote it")
    with open_outbox(settings) as ob:
        assert receipt.markdown_path.read_bytes().endswith(b"as I rewrote it")
        report = ob.verify()
        assert not report.ok
        assert any("differs from the stored content" in p for p in report.problems)


@pytest.mark.parametrize(
    ("regrown", "same_length"),
    [("a much longer memory " * 40, False), ("the memory whose line the disk LOST", True)],
    ids=["past-the-offset", "to-the-same-length"],
)
def test_a_log_that_lost_its_tail_and_grew_again_is_rescanned(
    settings: Settings, regrown: str, same_length: bool
) -> None:
    """Power loss took lines the last repair had seen, then a writer that skips repair
    appended again: the next repair must neither miss nor repeat. When the new line has the
    lost one's length, the remembered offset falls exactly on a line boundary again, and
    only the hash of the line that ended there tells the logs apart."""
    with open_outbox(settings) as ob:
        first = ob.add("the first memory", timestamp=TS)
        lost = ob.add("the memory whose line the disk lost", timestamp=TS)
    open_outbox(settings).close()  # the watermark now points at the end of both lines
    log = settings.jsonl_path.read_bytes()
    settings.jsonl_path.write_bytes(log[: log.index(b"\n") + 1])
    with Outbox.open(settings, repair=False) as ob:
        grown = ob.add(regrown, timestamp=TS)
    size = settings.jsonl_path.stat().st_size
    assert size == len(log) if same_length else size > len(log)
    with open_outbox(settings) as ob:
        assert sorted(accepted_keys(ob)) == sorted([first.key, lost.key, grown.key])
        check = ob.verify()
        assert check.ok, check.problems


def test_two_threads_writing_one_name_atomically_never_share_a_temp_file(tmp_path: Path) -> None:
    """Two fallback writes of the same name at once: one file, whole, from one writer."""
    datas = [b"---\nkey: first\n---\n" + b"a" * 50_000, b"---\nkey: second\n---\n" + b"b" * 50_000]
    for round_number in range(60):
        path = tmp_path / f"round-{round_number}.md"
        barrier = threading.Barrier(2)
        results: dict[int, bool | BaseException] = {}

        def write(
            number: int,
            target: Path = path,
            wait: threading.Barrier = barrier,
            out: dict[int, bool | BaseException] = results,
        ) -> None:
            wait.wait()
            try:
                out[number] = markdown.write_atomic(target, datas[number], exclusive=True)
            except BaseException as exc:  # a shared temp file shows up as an error here
                out[number] = exc

        threads = [threading.Thread(target=write, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert sorted(results.values(), key=str) == [False, True], results
        winner = next(n for n, created in results.items() if created is True)
        assert path.read_bytes() == datas[winner]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_delivery_state_is_never_written_into_another_keys_file(outbox: Outbox) -> None:
    receipt = outbox.add("a memory whose file another record's file replaced")
    assert receipt.markdown_path is not None
    assert outbox.wait_mirrored(10)
    foreign = b"---\nkey: another-key\nintended_brain_store: true\n---\nsomeone else\n"
    receipt.markdown_path.write_bytes(foreign)
    outbox.drain(timeout=30)
    (row,) = outbox.storage.deliveries.deliveries_for([receipt.key])[receipt.key]
    assert row.state == "delivered"
    assert receipt.markdown_path.read_bytes() == foreign
