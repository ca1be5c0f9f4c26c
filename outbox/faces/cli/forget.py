"""``outbox forget KEY``: remove a record from the database, every sink and both mirrors.

The answer comes once the forget is committed and the mirrors are redacted; the sinks'
deletes are then a dispatcher's work (queued, retried like deliveries). Before exiting, the
command also purges the database files' leftover copies, which takes longer on a big store.
"""

from __future__ import annotations

import argparse

from outbox.faces.cli.common import EXIT_FAILED, EXIT_OK, AddCommand, emit, fail, open_outbox


def cmd_forget(args: argparse.Namespace) -> int:
    from outbox.operations.catalog import NoSuchRecord

    with open_outbox() as ob:
        try:
            receipt = ob.forget(args.key)
        except NoSuchRecord as exc:
            return fail(str(exc), EXIT_FAILED)
        if not args.json:  # the answer first: the purge takes longer on a big store
            print(receipt.text, flush=True)
        purged = ob.forgetter.purge()
    if args.json:
        emit(args, {**receipt.to_dict(), "database_purged": purged.complete}, receipt.text)
    elif not purged.complete:
        print("(the database's write-ahead log is in use; its old copy goes at the next purge)")
    return EXIT_OK


def register(command: AddCommand) -> None:
    forget = command(
        "forget",
        cmd_forget,
        "remove a record from the database, every sink and the markdown file; redact its log line",
    )
    forget.add_argument("key", metavar="KEY", help="a key or a unique prefix of one")
