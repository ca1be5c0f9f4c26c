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


def open_outbox(*, repair: bool = True, create: bool = False) -> Outbox:
    """The outbox of the usual settings, imported here so a command that needs none starts
    without the database layer; ``repair=False`` writes nothing to the mirrors on open.
    Only a command that writes (``create``) may start a new store: any other one says that
    none was found, and where it looked, instead of opening an empty one."""
    from outbox.api import Outbox
    from outbox.config import load_settings
    from outbox.errors import OutboxError

    settings = load_settings()
    if not create and not settings.home.is_dir():
        raise OutboxError(
            f"no outbox store at {settings.home} (looked in {Path.cwd()} and above it; "
            "set OUTBOX_HOME, or write a first memory with outbox add)"
        )
    return Outbox.open(settings, repair=repair)
