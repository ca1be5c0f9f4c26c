"""``outbox ui``: the local dashboard (``outbox/faces/ui/``), on loopback unless told otherwise."""

from __future__ import annotations

import argparse

from outbox.faces.cli import numbers
from outbox.faces.cli.common import EXIT_OK, AddCommand, open_outbox

DEFAULT_PORT = 8765


def cmd_ui(args: argparse.Namespace) -> int:
    from outbox.faces.ui.server import serve

    with open_outbox(repair=False) as ob:
        serve(ob, args.host, args.port)
    return EXIT_OK


def register(command: AddCommand) -> None:
    ui = command("ui", cmd_ui, "the local dashboard: overview, memories, dead letters", False)
    ui.add_argument(
        "--port",
        type=numbers.port_or_zero,
        default=DEFAULT_PORT,
        help=f"port 0..65535 (default {DEFAULT_PORT}; 0: any free one)",
    )
    ui.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; anything else is reachable by others)",
    )
