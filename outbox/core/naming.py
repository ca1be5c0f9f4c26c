"""How errors, log lines and reports name a record or a file without quoting a memory.

A markdown file's name starts with its memory's first words (``<date>-<first words>-<hash>.md``),
so no message the library makes shows one: a record is named by its key prefix, a file with no
key to go by by a digest of its name, and a markdown path only by its folder. Every layer uses
these, the command line included, so there is one definition of each. The one exception is
the ``outbox replay`` report, which its owner reads in a terminal: it gives a skipped file's
path so they can find it (contract section 11).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# Hex digits of a key that name its record in errors, logs and reports.
KEY_PREFIX = 12


def key_prefix(key: str) -> str:
    """How a message names a record: enough of its key to find it (``outbox show``)."""
    return key[:KEY_PREFIX]


def file_digest(path: Path | str) -> str:
    """A file's name in reports when it has no key: 8 hex of SHA-256 of its name, which an
    operator can recompute to find it, and which says nothing of the memory inside."""
    return hashlib.sha256(os.path.basename(path).encode("utf-8", "surrogateescape")).hexdigest()[:8]


def is_markdown_name(path: os.PathLike[str] | str | bytes) -> bool:
    """Whether a path's last part is a markdown file or a temporary copy of one
    (``.<name>.md.<pid>-<thread>.tmp``): either name carries a memory's first words."""
    return ".md" in os.path.basename(os.fsdecode(path))


def shown_path(path: os.PathLike[str] | str | bytes) -> str:
    """A path as a message shows it: a markdown file only by its folder, any other as it is."""
    where = Path(os.fsdecode(path))
    return f"a markdown file in {where.parent}" if is_markdown_name(where) else str(where)
