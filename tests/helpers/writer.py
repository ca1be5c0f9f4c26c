"""A real writer process for the crash and concurrency tests; settings come from OUTBOX_*.

``writer.py crash SEED``: add records for ever, printing each returned key (flushed) the moment
``add``/``add_many`` returns, until killed.
``writer.py same CONTENT TIMESTAMP COUNT GO_FILE``: wait for GO_FILE to exist, then write the
same record COUNT times, printing one JSON receipt per call.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from outbox import Outbox

WORDS = ["memory", "decision", "sqlite", "outbox", "crash", "durable", "chroma", "brain", "é", "🙂"]


def crash(seed: int) -> None:
    rng = random.Random(seed)
    with Outbox.open() as ob:
        number = 0
        while True:
            count = rng.choice([1, 1, 1, rng.randint(2, 12)])
            items = []
            for _ in range(count):
                number += 1
                words = " ".join(rng.choices(WORDS, k=rng.randint(3, 60)))
                items.append(
                    {
                        "content": f"{seed}-{number} {words}",
                        "tags": rng.sample(WORDS, k=rng.randint(0, 3)),
                        "slug": rng.choice([None, None, "shared slug"]),
                    }
                )
            receipts = [ob.add(**items[0])] if count == 1 else ob.add_many(items)
            sys.stdout.write("".join(f"{receipt.key}\n" for receipt in receipts))
            sys.stdout.flush()


def same(content: str, timestamp: str, count: int, go_file: Path) -> None:
    with Outbox.open() as ob:
        while not go_file.exists():
            time.sleep(0.001)
        for _ in range(count):
            receipt = ob.add(content, timestamp=timestamp)
            sys.stdout.write(json.dumps(receipt.to_dict()) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        crash(int(sys.argv[2]))
    else:
        same(sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5]))
