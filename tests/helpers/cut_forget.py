"""Forget one record and stop dead at a chosen step, for a test to SIGKILL there.

``cut_forget.py KEY POINT``: opens the store the environment names, then forgets KEY (and
purges, as ``outbox forget`` does) with the step POINT replaced by a stop: the process prints
``cut`` (flushed) and waits on standard input, so the test kills it exactly between two
steps of the forget instead of at a random moment.
"""

from __future__ import annotations

import sys
from typing import Any

from outbox import Outbox
from outbox.mirror.forget import Redactor
from outbox.store.forgetting import ForgetStore

# Each step a forget takes after its commit, named by what is done when it stops there.
POINTS: dict[str, tuple[type, str]] = {
    "committed": (Redactor, "finish"),  # the transaction only
    "forgotten-line": (Redactor, "_overwrite"),  # + the forgotten line appended
    "redacted": (Redactor, "_delete_file"),  # + the accepted line redacted in place
    "files-deleted": (ForgetStore, "mirrors_done"),  # + the markdown file deleted
    "unpurged": (ForgetStore, "purge"),  # + the mirrors marked done, the purge not run
}


def _stop(*_args: Any, **_kwargs: Any) -> None:
    sys.stdout.write("cut\n")
    sys.stdout.flush()
    sys.stdin.read()  # until the test's SIGKILL
    raise SystemExit("the test was to kill this process")


def main() -> None:
    key, point = sys.argv[1], sys.argv[2]
    with Outbox.open() as ob:
        owner, name = POINTS[point]
        setattr(owner, name, _stop)  # only now: the open's own repair ran unchanged
        ob.forget(key)
        ob.forgetter.purge()


if __name__ == "__main__":
    main()
