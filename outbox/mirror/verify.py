"""``outbox verify``: prove the mirrors and the database agree, and the log was not edited."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from outbox.keys import idempotency_key
from outbox.mirror import markdown
from outbox.mirror.jsonl import JsonlLog
from outbox.store.storage import Storage

MAX_PROBLEMS = 50


@dataclass
class VerifyReport:
    records: int = 0
    jsonl_lines: int = 0
    markdown_files: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, problem: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)
        elif len(self.problems) == MAX_PROBLEMS:
            self.problems.append("… more problems not listed")


def _why(exc: Exception) -> str:
    """What went wrong, without the file's name (a markdown file's name carries words of
    its content, and verify's output ends up in logs and issues)."""
    if isinstance(exc, OSError):
        return exc.strerror or exc.__class__.__name__
    return str(exc)


def verify(storage: Storage, jsonl: JsonlLog, markdown_dir: Path, mirror_id: str) -> VerifyReport:
    """Check the chain, one accepted line per record, and each record's markdown file."""
    report = VerifyReport()
    for problem in jsonl.verify_chain():
        report.add(problem)
    accepted: Counter[str] = Counter()
    # What each accepted line says besides its key; its content and timestamp are checked
    # against the key itself, so an edit of the last line (which no later line chains) shows.
    described: dict[str, tuple[object, object]] = {}
    for number, line in enumerate(jsonl.lines(), start=1):
        report.jsonl_lines += 1
        event = line.event
        if event.get("event") != "accepted":
            continue
        key = str(event.get("key"))
        accepted[key] += 1
        content, timestamp = event.get("content"), event.get("timestamp")
        if not (
            isinstance(content, str)
            and isinstance(timestamp, str)
            and timestamp.isascii()
            and idempotency_key(content, timestamp) == key
        ):
            report.add(f"{jsonl.path}: line {number}: content or timestamp does not match its key")
        described[key] = (event.get("importance"), event.get("tags"))
    for item in storage.records.iter_records(origin=mirror_id):
        report.records += 1
        key = item.record.key
        count = accepted.pop(key, 0)
        if count != 1:
            report.add(f"record {key[:12]}: {count} accepted lines in {jsonl.path} (expected 1)")
        elif described.get(key) != (item.record.importance, list(item.record.tags)):
            report.add(
                f"record {key[:12]}: importance or tags in {jsonl.path} differ from the database"
            )
        path = markdown_dir / item.markdown_name
        try:
            matter, body = markdown.read(path)
        except FileNotFoundError:
            report.add(f"record {key[:12]}: its markdown file is missing from {markdown_dir}")
            continue
        except (OSError, markdown.MalformedMarkdown) as exc:
            report.add(f"record {key[:12]}: its markdown file is unreadable ({_why(exc)})")
            continue
        report.markdown_files += 1
        if matter.get("key") not in (None, key):
            report.add(f"record {key[:12]}: its markdown file carries another key")
        if body != item.record.content.encode("utf-8"):
            report.add(
                f"record {key[:12]}: the body of its markdown file differs from the stored content"
            )
    for key, count in accepted.items():
        report.add(f"{count} accepted line(s) for {key[:12]}, which the database does not hold")
    return report
