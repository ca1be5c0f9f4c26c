"""The ``outbox`` command: one module per command group, this one parses and dispatches.

Errors are one line on stderr, never a traceback; ``--json`` prints one object on stdout.
Heavy modules are imported inside the command that needs them so ``outbox add`` starts fast.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from outbox.cli import delivery, memory, records, reindex, status, writes
from outbox.cli.common import EXIT_FAILED, EXIT_INVALID, EXIT_OK, Handler, error_line, fail
from outbox.errors import ConfigError, OutboxError, ValidationError

__all__ = ["EXIT_FAILED", "EXIT_INVALID", "EXIT_OK", "build_parser", "main"]

# The long-running commands also log warnings, since nobody reads their return value.
_LONG_RUNNING = ("run", "drain", "mcp", "reindex")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox", description="Durable, never-lying write path for agent memory."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO on stderr")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, handler: Handler, help_text: str, json_flag: bool = True
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if json_flag:
            sub.add_argument("--json", action="store_true", help="print one JSON object")
        sub.set_defaults(handler=handler)
        return sub

    writes.register_add(command)
    status.register(command)
    delivery.register_drain_run(command)
    writes.register_replay(command)
    memory.register(command)
    delivery.register_dead(command)
    records.register(command)
    reindex.register(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return EXIT_INVALID if exc.code not in (0, None) else EXIT_OK
    # A one-shot command speaks through its result and one error line.
    quiet = logging.ERROR if args.command not in _LONG_RUNNING else logging.WARNING
    logging.basicConfig(
        level=logging.INFO if args.verbose else quiet,
        format="outbox: %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.handler(args))
    except (ValidationError, ConfigError) as exc:
        return fail(str(exc), EXIT_INVALID)
    except OutboxError as exc:
        return fail(str(exc), EXIT_FAILED)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except Exception as exc:  # one error line on the command line, never a traceback
        return fail(f"{exc.__class__.__name__}: {error_line(exc)}", EXIT_FAILED)
