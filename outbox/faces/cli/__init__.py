"""The ``outbox`` command: one module per command group, this one parses and dispatches.

Errors are one line on stderr, never a traceback; ``--json`` prints one object on stdout.
Heavy modules are imported inside the command that needs them so ``outbox add`` starts fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from outbox.core.errors import ConfigError, OutboxError, ValidationError
from outbox.faces.cli import delivery, forget, memory, rebuild, records, reindex, status, ui, writes
from outbox.faces.cli.common import (
    EXIT_FAILED,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_PIPE_CLOSED,
    Handler,
    Subcommands,
    add_verbosity,
    configure_logging,
    fail,
    failure_line,
    silence_closed_stdout,
)

__all__ = ["EXIT_FAILED", "EXIT_INVALID", "EXIT_OK", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox", description="Durable, never-lying write path for agent memory."
    )
    add_verbosity(parser)
    commands = Subcommands(parser, "command", "COMMAND")

    def command(
        name: str, handler: Handler, help_text: str, json_flag: bool = True
    ) -> argparse.ArgumentParser:
        sub = commands.add(name, help_text)
        if json_flag:
            sub.add_argument("--json", action="store_true", help="print one JSON object")
        sub.set_defaults(handler=handler)
        add_verbosity(sub, subcommand=True)
        return sub

    writes.register_add(command)
    status.register(command)
    delivery.register_drain_run(command)
    writes.register_replay(command)
    memory.register(command)
    delivery.register_dead(command)
    records.register(command)
    forget.register(command)
    reindex.register(command)
    rebuild.register(command)
    ui.register(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.choose_from is not None:  # a command group named without its command
            args.choose_from.missing()
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return EXIT_INVALID if exc.code not in (0, None) else EXIT_OK
    configure_logging(args)
    try:
        code = int(args.handler(args))
        sys.stdout.flush()  # a reader gone before the last line is found here, not at exit
        return code
    except BrokenPipeError as exc:
        if silence_closed_stdout():  # `outbox export | head -1`: the reader has what it wanted
            return EXIT_PIPE_CLOSED
        return fail(failure_line(exc), EXIT_FAILED)
    except (ValidationError, ConfigError) as exc:
        return fail(str(exc), EXIT_INVALID)
    except OutboxError as exc:
        return fail(str(exc), EXIT_FAILED)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except Exception as exc:  # one error line on the command line, never a traceback
        return fail(failure_line(exc), EXIT_FAILED)
