"""The library's own exceptions, reports and log lines name a record by its key prefix, never
by its markdown file: a file's name starts with the memory's first words.

Each test puts private words among a memory's first eight (so they are in its file name), then
makes a real file operation on that name fail. Tests run as root, whom file modes do not stop,
so the failure is ``chattr +i`` on the folder: nobody may add, replace or remove a file there.
What is checked: ``str``, ``repr`` and the whole formatted traceback of the exception, every
exception it chains (``__cause__``, ``__context__``) with their file names, report texts, and
every log record at any level.
"""

from __future__ import annotations

import errno
import logging
import traceback
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from outbox import Outbox, Settings, StoreFailed
from outbox.core.errors import OutboxError, RecordFileError
from outbox.core.naming import key_prefix, shown_path
from tests.helpers.faults import held_write_lock, immutable

WORDS = ("zebrapass", "quokkaword")
TEXT = "my zebrapass and quokkaword are private, says the owner of this memory"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it chains, shown in a traceback or not."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        found = stack.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        yield found
        stack += [found.__cause__, found.__context__]


def _assert_no_words(*texts: object) -> None:
    for text in texts:
        for word in WORDS:
            assert word not in str(text), text


def _assert_names_the_record(exc: BaseException, key: str) -> None:
    """The error says which record (its key prefix) and carries none of its words anywhere."""
    assert isinstance(exc, RecordFileError) and isinstance(exc, OSError | OutboxError)
    assert exc.errno == errno.EPERM
    assert f"record {key_prefix(key)}:" in str(exc)
    _assert_no_words(str(exc), repr(exc), "".join(traceback.format_exception(exc)))
    for chained in _chain(exc):
        _assert_no_words(str(chained), repr(chained))
        if isinstance(chained, OSError):
            _assert_no_words(chained.filename, chained.filename2)


def _assert_no_words_logged(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        _assert_no_words(record.getMessage())
        if record.exc_info and record.exc_info[1] is not None:
            _assert_no_words("".join(traceback.format_exception(record.exc_info[1])))


def _written(ob: Outbox, text: str = TEXT) -> tuple[str, Path]:
    """A memory whose file exists, and that file (its name holds the words)."""
    receipt = ob.add(text)
    assert ob.wait_mirrored(10)
    assert receipt.markdown_path is not None and receipt.markdown_path.is_file()
    assert all(word in receipt.markdown_path.name for word in WORDS)
    return receipt.key, receipt.markdown_path


def test_a_markdown_file_repair_cannot_write_is_named_by_its_key(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """``sync_mirrors``, the mirror writer, the dispatcher's front-matter update, the open
    and verify's report, each with a file it cannot write."""
    caplog.set_level(logging.DEBUG)
    with Outbox.open(settings) as ob:
        key, path = _written(ob)
        path.unlink()
        with immutable(settings.markdown_dir):
            with pytest.raises(RecordFileError) as repairing:
                ob.sync_mirrors(full=True)
            _assert_names_the_record(repairing.value, key)
            assert f"in {settings.markdown_dir} " in str(repairing.value)
            report = ob.verify()
            assert not report.ok
            _assert_no_words(*report.problems)
            assert any(key_prefix(key) in problem for problem in report.problems)
            # The mirror writer and the dispatcher's outcome sync: warnings, no words.
            second = ob.add(TEXT + ", written while the folder was shut")
            assert ob.wait_mirrored(10)
            assert second.markdown_path is not None and not second.markdown_path.exists()
            ob.drain(timeout=20)
    with immutable(settings.markdown_dir), Outbox.open(settings) as ob:  # its repair: a warning
        with pytest.raises(RecordFileError) as again:
            ob.sync_mirrors()
        _assert_names_the_record(again.value, key)
    with Outbox.open(settings) as ob:  # the folder open again: repair writes both files
        assert path.is_file() and second.markdown_path.is_file()
        assert ob.verify().ok
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("markdown mirror write failed" in line for line in warned), warned
    assert any("mirror update after delivery failed" in line for line in warned), warned
    _assert_no_words_logged(caplog)


def test_a_forgotten_file_that_cannot_be_deleted_is_named_by_its_key(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Forget's file deletion: at once (a warning), then by the next repair (an error)."""
    caplog.set_level(logging.DEBUG)
    with Outbox.open(settings) as ob:
        key, path = _written(ob)
        with immutable(settings.markdown_dir):
            assert ob.forget(key_prefix(key)).key == key  # a warning: finished at the next open
    with (
        immutable(settings.markdown_dir),
        Outbox.open(settings) as ob,
        pytest.raises(RecordFileError) as finishing,
    ):
        ob.sync_mirrors()  # the repair finishes the forget: the file is still there
    _assert_names_the_record(finishing.value, key)
    assert "cannot delete" in str(finishing.value)
    assert path.exists()
    with Outbox.open(settings) as ob:
        assert not path.exists()
        assert ob.verify().ok
    assert any("forgotten; its mirrors are finished" in r.getMessage() for r in caplog.records)
    _assert_no_words_logged(caplog)


def test_an_export_that_cannot_write_names_the_record_by_its_key(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    folder = tmp_path / "export"
    folder.mkdir()
    with Outbox.open(settings) as ob:
        key, _path = _written(ob)
        with immutable(folder), pytest.raises(RecordFileError) as exporting:
            ob.catalog.export_markdown(folder)
    _assert_names_the_record(exporting.value, key)
    assert f"cannot export its markdown file in {folder} " in str(exporting.value)
    _assert_no_words_logged(caplog)


def test_fallback_and_replay_file_errors_carry_no_file_name(
    settings: Settings, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A fallback file that cannot be written (the database locked too): ``StoreFailed``, and
    nothing it chains names the file. A legacy file replay cannot stamp: a warning by key."""
    caplog.set_level(logging.DEBUG)
    settings = replace(settings, busy_timeout=0.3)
    with Outbox.open(settings) as ob:
        ob.add("a first memory, so the database exists")
        assert ob.wait_mirrored(10)
        with (
            held_write_lock(settings.home / "outbox.db"),
            immutable(settings.markdown_dir),
            pytest.raises(StoreFailed) as both,
        ):
            ob.add(TEXT)
        failed = both.value
        _assert_no_words(str(failed), repr(failed), "".join(traceback.format_exception(failed)))
        for chained in _chain(failed):
            _assert_no_words(str(chained), repr(chained))
            if isinstance(chained, OSError):
                _assert_no_words(chained.filename, chained.filename2)

        legacy = tmp_path / "legacy"
        legacy.mkdir()
        name = "2026-01-02-my-zebrapass-and-quokkaword-are-private.md"
        (legacy / name).write_text(
            "---\nintended_brain_store: true\nchunk_id:\ntimestamp: 2026-01-02T00:00:00Z\n"
            f"importance: 5\ntags: []\n---\n{TEXT}, from an older tool"
        )
        with immutable(legacy):
            report = ob.replay(legacy)
    assert len(report.imported) == 1
    assert report.warnings and "front matter of its file not updated" in report.warnings[0]
    _assert_no_words(*report.warnings, report.to_dict())
    _assert_no_words_logged(caplog)


def test_a_path_is_shown_without_a_markdown_files_name(tmp_path: Path) -> None:
    """The one rule the command line and the library share: a markdown file, or the
    temporary copy it is written through, by its folder; other paths as they are."""
    from outbox.faces.cli.common import error_line

    folder = tmp_path / "md"
    for name in ("2026-01-02-my-zebrapass-1a2b3c4d.md", ".2026-my-zebrapass.md.41-7.tmp"):
        assert shown_path(folder / name) == f"a markdown file in {folder}"
        assert shown_path(str(folder / name).encode()) == f"a markdown file in {folder}"
        line = error_line(PermissionError(errno.EPERM, "Operation not permitted", folder / name))
        assert line == f"Operation not permitted: a markdown file in {folder}"
    assert shown_path(tmp_path / "outbox.db") == str(tmp_path / "outbox.db")
