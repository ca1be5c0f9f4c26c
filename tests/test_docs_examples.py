"""The console examples of the README and docs/ run as a test, so a doc cannot drift from the
code unseen.

A block runs when the line before its ```console fence is a marker::

    <!-- runs -->
    <!-- runs after: outbox add "a first memory"; outbox drain -->

``after:`` names set-up commands, run first, whose output is not shown. In the block, each
``$ `` line is a command (a trailing ``# comment`` is dropped, ``NAME=value`` prefixes are its
environment) and the lines under it, up to the next command, are what it prints: its result
on stdout, and when it fails (exit status not 0) its error lines on stderr before that. A
successful command's stderr (progress, log lines) is not compared: docs/operations.md shows
log lines apart, gathered from several runs. Every block runs in a fresh store of its own (the
real ``python -m outbox``, the real shared Chroma server, the offline MiniLM model), with
``OUTBOX_HOME`` in a temporary folder; an absolute path a command names is moved under it.

Compared after masking what differs from run to run on both sides: absolute paths, times,
durations (``0.6s``, ``35 ms``), record keys and key prefixes. A key the doc shows is bound to
the key the run printed in the same place, so a later ``outbox show 351f`` asks for the run's
own record. Numbers with a decimal point (relevance, distance) must agree within 0.011: one
unit of their last printed digit, so another CPU's rounding passes, and a changed model or
fusion does not. A line holding only ``…`` stands for any number of lines.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.chroma_server import stop_servers_under

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!--\s*runs(?:\s+after:\s*(?P<after>.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```console\s*$")
ANY_LINES = "…"
FLOAT_TOLERANCE = 0.011
STEP_TIMEOUT = 180.0

KEY = re.compile(r"\b[0-9a-f]{64}\b")
_MASKS = [
    (re.compile(r"(?<![\w/])/[^\s'\"),;]+"), "<path>"),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:\.\d+)?Z?"), "<time>"),
    (KEY, "<key>"),
    (re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{4,63}\b"), "<prefix>"),
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|µs|s)\b"), "<duration>"),
]
_FLOAT = re.compile(r"^-?\d+\.\d+$")


@dataclass(frozen=True)
class Step:
    """One ``$`` line of a block and the output the doc shows under it."""

    command: str
    expected: tuple[str, ...]
    line: int


@dataclass(frozen=True)
class Block:
    """A runnable console block: where it is, its hidden set-up, its steps."""

    path: Path
    line: int
    setup: tuple[str, ...]
    steps: tuple[Step, ...]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def runnable_blocks(path: Path) -> list[Block]:
    """Every marked ```console block of ``path``, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    for number, text in enumerate(lines):
        fence = FENCE.match(text)
        marker = MARKER.match(lines[number - 1]) if number else None
        if not fence or not marker:
            continue
        indent = len(fence.group(1))
        body: list[tuple[int, str]] = []
        for offset, inner in enumerate(lines[number + 1 :], start=number + 2):
            if inner.strip() == "```":
                break
            body.append((offset, inner[indent:]))
        after = marker.group("after")
        setup = tuple(part.strip() for part in after.split(";")) if after else ()
        found.append(Block(path, number + 1, setup, tuple(_steps(body))))
    return found


def _steps(body: list[tuple[int, str]]) -> Iterator[Step]:
    command: tuple[int, str] | None = None
    expected: list[str] = []
    for number, text in body:
        if text.startswith("$ "):
            if command is not None:
                yield Step(command[1], tuple(expected), command[0])
            command, expected = (number, text[2:]), []
        elif command is not None:
            expected.append(text)
    if command is not None:
        yield Step(command[1], tuple(expected), command[0])


def mask(line: str) -> str:
    """A line with what varies from run to run replaced, and its spaces collapsed (columns
    widen with their values)."""
    for pattern, label in _MASKS:
        line = pattern.sub(label, line)
    return " ".join(line.split())


def same_line(expected: str, actual: str) -> bool:
    """Equal once masked, decimal numbers within ``FLOAT_TOLERANCE``."""
    want, got = mask(expected).split(" "), mask(actual).split(" ")
    if len(want) != len(got):
        return False
    for left, right in zip(want, got, strict=True):
        if _FLOAT.match(left) and _FLOAT.match(right):
            if abs(float(left) - float(right)) > FLOAT_TOLERANCE:
                return False
        elif left != right:
            return False
    return True


def matches(expected: list[str], actual: list[str]) -> list[tuple[str, str]] | None:
    """The (expected, actual) line pairs that matched, or None; ``…`` matches any lines."""
    if not expected:
        return [] if not actual else None
    head, rest = expected[0], expected[1:]
    if head.strip() == ANY_LINES:
        for skip in range(len(actual) + 1):
            tail = matches(rest, actual[skip:])
            if tail is not None:
                return tail
        return None
    if not actual or not same_line(head, actual[0]):
        return None
    tail = matches(rest, actual[1:])
    return None if tail is None else [(head, actual[0]), *tail]


class DocMismatch(AssertionError):
    """A command's output is not what its doc shows."""


@dataclass
class Session:
    """One fresh store the steps of a block run in, and the keys bound so far."""

    root: Path
    keys: dict[str, str] = field(default_factory=dict)

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env["OUTBOX_HOME"] = str(self.root / ".outbox")
        return env

    def moved(self, value: str) -> str:
        """An absolute path under the temporary root; a doc's key prefix as the run's own."""
        if value.startswith("/"):
            return str(self.root / "elsewhere" / value.lstrip("/"))
        if re.fullmatch(r"[0-9a-f]{4,64}", value):
            for doc_key, run_key in self.keys.items():
                if doc_key.startswith(value):
                    return run_key[: len(value)]
        return value

    def run(self, command: str) -> list[str]:
        """``command`` as the real CLI: its stdout, after its stderr when it failed."""
        words = shlex.split(command, comments=True)
        env = self.environ()
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = self.moved(value)
        if not words or words[0] != "outbox":
            raise DocMismatch(f"only outbox commands run here: {command!r}")
        done = subprocess.run(
            [sys.executable, "-m", "outbox", *(self.moved(word) for word in words[1:])],
            cwd=self.root,
            env=env,
            capture_output=True,
            timeout=STEP_TIMEOUT,
            check=False,
        )
        said = done.stdout if done.returncode == 0 else done.stderr + done.stdout
        return said.decode("utf-8", errors="replace").splitlines()

    def check(self, block: Block) -> None:
        """Run the set-up, then every step, comparing each one's output with the doc's."""
        for command in block.setup:
            self.run(command)
        for step in block.steps:
            actual = self.run(step.command)
            paired = matches(list(step.expected), actual)
            if paired is None:
                raise DocMismatch(
                    f"{block.path.name}:{step.line}: `{step.command}` printed\n"
                    + "\n".join(f"    {line}" for line in actual)
                    + "\n  where the doc shows\n"
                    + "\n".join(f"    {line}" for line in step.expected)
                )
            for want, got in paired:
                self.keys.update(zip(KEY.findall(want), KEY.findall(got), strict=False))


BLOCKS = [block for path in DOCS for block in runnable_blocks(path)]


@pytest.fixture
def session(tmp_path: Path) -> Iterator[Session]:
    root = tmp_path / "store"
    root.mkdir()
    yield Session(root)
    stop_servers_under(tmp_path)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.name for block in BLOCKS])
def test_doc_example_runs_as_shown(block: Block, session: Session) -> None:
    session.check(block)


def test_the_readme_tour_is_among_the_runnable_blocks() -> None:
    """The harness finds what it should: a marker lost in an edit must not pass unseen."""
    readme = [block for block in BLOCKS if block.path.name == "README.md"]
    assert readme and readme[0].steps[0].command.startswith("outbox add ")
    assert len(readme[0].steps) >= 8
    assert any(step.command.startswith("outbox drain") for step in readme[0].steps)


def test_a_changed_expected_line_fails(tmp_path: Path, session: Session) -> None:
    """A copy of the README whose tour expects one record more than it writes: the harness
    must report that line (the tour is cut after ``status``, so no drain runs)."""
    text = (REPO / "README.md").read_text(encoding="utf-8").replace("records: 1", "records: 2")
    copy = tmp_path / "README.md"
    copy.write_text(text, encoding="utf-8")
    (tour,) = [
        block for block in runnable_blocks(copy) if block.steps[0].command.startswith("outbox add")
    ]
    cut = Block(tour.path, tour.line, tour.setup, tour.steps[:2])
    with pytest.raises(DocMismatch, match=r"`outbox status` printed\n    records: 1"):
        session.check(cut)


def test_masks_keep_what_a_doc_promises() -> None:
    """What the masks leave alone still has to match: words, counts, two-decimal numbers."""
    assert same_line("OK: 1 records, 2 JSONL lines", "OK: 1 records,  2 JSONL lines")
    assert not same_line("OK: 1 records, 2 JSONL lines", "OK: 2 records, 2 JSONL lines")
    assert same_line("lexical+vector 0.34 0.00 0.597", "lexical+vector 0.35 0.00 0.590")
    assert not same_line("lexical+vector 0.34 0.00 0.597", "lexical+vector 0.46 0.00 0.597")
    assert same_line(f"Queued {'a1' * 32} for Chroma", f"Queued {'0f' * 32} for Chroma")
    assert same_line("chroma 1 0 0.6s", "chroma 1 0 12.3s")
    assert same_line("markdown: /tmp/tour/x.md", "markdown: /tmp/pytest-1/store/y.md")
    assert matches(["key: x", ANY_LINES, "end"], ["key: x", "a", "b", "end"]) is not None
    assert matches(["key: x", ANY_LINES, "end"], ["key: y", "end"]) is None
