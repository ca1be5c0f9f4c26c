"""Forgets records one by one, printing each key once its forget has answered.

Run as ``python forgetter.py COUNT TAG``: writes COUNT records (each naming a word of its
own, printed as ``KEY WORD``), delivers them to the fault sink, prints ``ready``, then forgets
them in order, printing each key when ``forget`` returned.
The crash test SIGKILLs this process at random moments, in the middle of some forget.
"""

from __future__ import annotations

import sys

from outbox import Outbox

SECRET = "{word} keeps the vault combination"


def main() -> None:
    count, tag = int(sys.argv[1]), sys.argv[2]
    with Outbox.open() as ob:
        keys = []
        for number in range(count):
            word = f"pangolin{tag}x{number}z"
            keys.append(ob.add(SECRET.format(word=word)).key)
            print(keys[-1], word, flush=True)
        ob.drain(timeout=60)
        print("ready", flush=True)
        for key in keys:
            ob.forget(key)
            print(key, flush=True)


if __name__ == "__main__":
    main()
