"""What every command shares: exit codes, the one-object ``--json`` output, the one-line
error, opening the outbox, and how a command group adds its subcommands to the parser."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from outbox.core.naming import shown_path

if TYPE_CHECKING:
    from outbox.api import Outbox

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
# What a shell reports for a tool that SIGPIPE ended (128 + 13), as ``yes | head -1`` does.
EXIT_PIPE_CLOSED = 141

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
        return f"{exc.strerror or 'error'}: {shown_path(exc.filename)}"
    # One line: SQLAlchemy's messages go on with the statement and a help link.
    return str(exc).splitlines()[0] if str(exc) else ""


def fail(message: str, code: int) -> int:
    """One line on stderr and the exit code: the command line never shows a traceback."""
    sys.stderr.write(f"outbox: {message}\n")
    return code


def silence_closed_stdout() -> bool:
    """If standard output is a pipe whose reader is gone, point it at /dev/null (the
    interpreter's last flush would fail again) and say so. A BrokenPipeError is then the
    reader's doing, not a sink's socket's; where poll cannot tell, it is not taken for one."""
    import os
    import select

    try:
        out = sys.stdout.fileno()
        poller = select.poll()
        poller.register(out, 0)
        events = poller.poll(0)
    except (AttributeError, OSError, ValueError):  # no poll, or stdout is no file
        return False
    if not any(flags & (select.POLLERR | select.POLLHUP) for _fd, flags in events):
        return False
    nowhere = os.open(os.devnull, os.O_WRONLY)
    os.dup2(nowhere, out)
    os.close(nowhere)
    return True


def open_outbox(*, repair: bool = True, create: bool = False) -> Outbox:
    """The outbox of the usual settings, imported here so a command that needs none starts
    without the database layer; ``repair=False`` writes nothing to the mirrors on open.
    Only a command that writes (``create``) may start a new store: any other one says that
    none was found, and where it looked, instead of opening an empty one."""
    from outbox.api import Outbox
    from outbox.core.config import load_settings
    from outbox.core.errors import OutboxError

    settings = load_settings()
    if not create and not settings.home.is_dir():
        raise OutboxError(
            f"no outbox store at {settings.home} (looked in {Path.cwd()} and above it; "
            "set OUTBOX_HOME, or write a first memory with outbox add)"
        )
    return Outbox.open(settings, repair=repair, create=create)


# The daemon says when it starts and stops (and warns) unless told to be quiet; the other
# long-running commands warn; a one-shot command speaks through its result and one error line.
_SAYS_WHAT_IT_DOES = ("run",)
_WARNS = ("drain", "mcp", "reindex")


class Subcommands:
    """A parser's subcommands, optional to argparse so that naming none gets an error that
    lists them (argparse's own says only ``required: COMMAND``)."""

    def __init__(self, parser: argparse.ArgumentParser, dest: str, metavar: str) -> None:
        self.parser, self.metavar = parser, metavar
        self.group = parser.add_subparsers(dest=dest, metavar=metavar)
        # A chosen subcommand's own ``choose_from=None`` replaces this default.
        parser.set_defaults(choose_from=self)

    def add(self, name: str, help_text: str) -> argparse.ArgumentParser:
        sub = self.group.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(choose_from=None)
        return sub

    def missing(self) -> None:
        """argparse's usage error naming what exists; exits 2."""
        names = ", ".join(self.group.choices)
        self.parser.error(f"the following arguments are required: {self.metavar} (one of {names})")


def lower_priority() -> None:
    """Nice this process by ``OUTBOX_RUN_NICE`` before any thread starts (each inherits it, as
    does a Chroma server it starts): a backfill (the daemon, a one-off drain, a reindex)
    leaves the writers the CPU. On an otherwise idle machine it costs the backfill nothing."""
    import os

    from outbox.core.config import load_settings

    os.nice(load_settings().run_nice)


def add_verbosity(parser: argparse.ArgumentParser, *, subcommand: bool = False) -> None:
    """``-v``/``-q`` on the command and again on each subcommand, so ``outbox run -v`` works
    as ``outbox -v run`` does (a subcommand's flag wins; unset, it leaves the other alone)."""
    flags = parser.add_mutually_exclusive_group()
    flags.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS if subcommand else 0,
        help="log more on stderr: -v the outbox's INFO lines, -vv DEBUG and other libraries",
    )
    flags.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS if subcommand else False,
        help="log errors only",
    )


class _LevelFilter(logging.Filter):
    """Per-source thresholds on the one stderr handler: the command's own lines, the
    outbox's, and every other library's (whose set-up chatter would hide ours). A filter,
    not logger levels, so calling ``main`` in a process leaves its loggers as they were."""

    def __init__(self, command: int, ours: int, others: int) -> None:
        super().__init__()
        self.command, self.ours, self.others = command, ours, others

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        if name.startswith("outbox.faces.cli.") or name == "outbox.faces.cli":
            return record.levelno >= self.command
        if name.startswith("outbox.") or name == "outbox":
            return record.levelno >= self.ours
        return record.levelno >= self.others


def configure_logging(args: argparse.Namespace) -> None:
    """Log levels from the command and its flags; ``-v`` adds a line per batch."""
    if args.quiet:
        ours = logging.ERROR
    elif args.verbose >= 2:
        ours = logging.DEBUG
    elif args.verbose == 1:
        ours = logging.INFO
    else:
        loud = args.command in _SAYS_WHAT_IT_DOES + _WARNS
        ours = logging.WARNING if loud else logging.ERROR
    says = args.command in _SAYS_WHAT_IT_DOES and not args.quiet
    command = min(ours, logging.INFO) if says else ours  # its start and stop lines
    others = logging.INFO if args.verbose >= 2 else max(ours, logging.WARNING)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("outbox: %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_LevelFilter(command, ours, others))
    logging.basicConfig(level=min(command, ours, others), handlers=[handler])


def failure_line(exc: Exception) -> str:
    """An unexpected error as one line. A database error names the database and what to
    check, which the driver's own text never does."""
    if type(exc).__module__.split(".")[0] in ("sqlalchemy", "sqlite3", "psycopg"):
        from outbox.core.config import load_settings
        from outbox.core.errors import OutboxError, StoreUnreadable
        from outbox.write.fallback import failure_reason

        try:
            db_url = load_settings().db_url
            return str(StoreUnreadable.of(db_url, exc, failure_reason(exc), doing="use"))
        except OutboxError:  # the settings themselves are bad: the plain line
            pass
    return f"{exc.__class__.__name__}: {error_line(exc)}"
