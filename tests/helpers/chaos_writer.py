"""A writer process for the chaos test: adds records until it is killed.

``chaos_writer.py NAME SEED``: settings come from ``OUTBOX_*``. Each record's content is unique
(``NAME`` and a counter). The moment ``add`` returns, the line ``<key> <status>`` is written
and flushed: a complete line is an acknowledgement the test holds the outbox to.
"""

from __future__ import annotations

import random
import sys
import time

from outbox import Outbox

WORDS = ["lease", "retry", "outbox", "sqlite", "chunk", "durable", "é", "🙂", "fallback"]


def main(name: str, seed: int) -> None:
    rng = random.Random(seed)
    with Outbox.open() as ob:
        number = 0
        while True:
            number += 1
            words = " ".join(rng.choices(WORDS, k=rng.randint(2, 30)))
            receipt = ob.add(f"chaos {name} #{number}: {words}", tags=rng.sample(WORDS, k=2))
            sys.stdout.write(f"{receipt.key} {receipt.status}\n")
            sys.stdout.flush()
            time.sleep(rng.uniform(0, 0.02))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
