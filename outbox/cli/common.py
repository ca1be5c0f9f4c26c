"""What every command shares: exit codes, the one-object ``--json`` output, the one-line
error, opening the outbox, and how a command group adds its subcommands to the parser."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from outbox.api import Outbox

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2

Handler = Callable[[argparse.Namespace], int]


class AddCommand(Protocol):
    """Adds one subcommand (with ``--json`` unless told otherwise) and returns its parser."""

    def __call__(
        self, name: str, handler: Handler, help_text: str, json_flag: bool = True
    ) -> argparse.ArgumentParser: ...


def emit(args: argparse.Namespace, payload: dict[str, Any], text: str) -> None:
    """One JSON object under ``--json``, else the human text: scripts and people both parse."""
    if getattr(args, "json", False):
        sys.stdout.write(json.dumps(payload, ensure_ascii=False, default=str) + "\n")
    elif text:
        sys.stdout.write(text.rstrip("\n") + "\n")


def error_line(exc: BaseException) -> str:
    """The first line of an error, naming no markdown file: a file's name carries the first
    words of its memory, and error lines end up in logs and issues."""
    if isinstance(exc, OSError) and exc.filename is not None:
        where = Path(os.fsdecode(exc.filename))
        shown = f"a markdown file in {where.parent}" if where.suffix == ".md" else str(where)
        return f"{exc.strerror or 'error'}: {shown}"
    # One line: SQLAlchemy's messages go on with the statement and a help link.
    return str(exc).splitlines()[0] if str(exc) else ""


def fail(message: str, code: int) -> int:
    """One line on stderr and the exit code: the command line never shows a traceback."""
    sys.stderr.write(f"outbox: {message}\n")
    return code


def open_outbox(*, repair: bool = True) -> Outbox:
    """The outbox of the usual settings, imported here so a command that needs none starts
    without the database layer; ``repair=False`` writes nothing to the mirrors on open."""
    from outbox.api import Outbox

    return Outbox.open(repair=repair)
