"""The validation gate and the immutable record it produces (pure: no I/O).

Everything a write could trip over is checked here, before a transaction starts, so a bad
input never leaves half a record behind.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any

from outbox.core.errors import ValidationError
from outbox.core.keys import canonical_timestamp, idempotency_key
from outbox.core.slugs import choose_slug

DEFAULT_IMPORTANCE = 5
MAX_CONTENT_BYTES = 1_048_576
MAX_TAGS = 64
MAX_TAG_CHARS = 200
MAX_METADATA_BYTES = 65_536


# Metadata a replay adds to a record it imports from a file another tool's fallback wrote, the
# names BrainLayer's ``store_memory`` takes them by: the file's absolute path, and what
# replayed it (``outbox <version>``). Neither is part of the key.
FALLBACK_SOURCE_PATH = "fallback_source_path"
REPLAYED_BY = "replayed_by"


@dataclass(frozen=True)
class Record:
    """One memory as the outbox stores it; ``key`` is its identity everywhere."""

    key: str
    timestamp: str
    content: str
    importance: int = DEFAULT_IMPORTANCE
    tags: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    slug: str = ""


def _check_text(field_name: str, value: str) -> None:
    if "\x00" in value:
        raise ValidationError(field_name, "contains a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(field_name, "contains a lone surrogate (not valid UTF-8)") from None


def check_content(
    content: object,
    *,
    min_length: int = 1,
    max_bytes: int = MAX_CONTENT_BYTES,
    field_name: str = "content",
) -> str:
    """Reject a corrupted memory before it is stored: empty, blank, too short, too big."""
    if not isinstance(content, str):
        raise ValidationError(field_name, f"must be text, not {type(content).__name__}")
    if content == "":
        raise ValidationError(field_name, "is empty")
    if not content.strip():
        raise ValidationError(field_name, "is only whitespace")
    _check_text(field_name, content)
    if len(content.strip()) < min_length:
        raise ValidationError(
            field_name, f"is shorter than OUTBOX_MIN_CONTENT_LENGTH ({min_length} characters)"
        )
    size = len(content.encode("utf-8"))
    if size > max_bytes:
        raise ValidationError(field_name, f"is {size} bytes, over the cap of {max_bytes} bytes")
    return content


def check_importance(importance: object) -> int:
    if isinstance(importance, bool) or not isinstance(importance, int):
        text = importance.strip() if isinstance(importance, str) else ""
        # ASCII digits only: "²" and other Unicode digits pass isdigit() but not int().
        if text.lstrip("-").isascii() and text.lstrip("-").isdigit():
            importance = int(text)
        else:
            raise ValidationError("importance", f"must be a whole number 1..10, not {importance!r}")
    if not 1 <= importance <= 10:
        raise ValidationError("importance", f"must be between 1 and 10, got {importance}")
    return importance


def check_tags(tags: Iterable[object] | None) -> tuple[str, ...]:
    if tags is None:
        return ()
    if isinstance(tags, str):
        raise ValidationError("tags", "must be a list of strings, not one string")
    cleaned: list[str] = []
    for tag in tags:
        if not isinstance(tag, str):
            raise ValidationError("tags", f"each tag must be text, got {type(tag).__name__}")
        _check_text("tags", tag)
        tag = tag.strip()
        if not tag:
            raise ValidationError("tags", "a tag is empty")
        if len(tag) > MAX_TAG_CHARS:
            raise ValidationError("tags", f"a tag is longer than {MAX_TAG_CHARS} characters")
        if tag not in cleaned:
            cleaned.append(tag)
    if len(cleaned) > MAX_TAGS:
        raise ValidationError("tags", f"more than {MAX_TAGS} tags")
    return tuple(cleaned)


MAX_METADATA_DEPTH = 32
_SCALARS = (str, int, float, bool, type(None))


def _check_shape(metadata: Mapping[str, Any]) -> None:
    """Walk the metadata once, within a budget: JSON's types only, finite numbers, limited
    nesting, and a size bound counted on the way, so that a small YAML file whose anchors
    expand to gigabytes is refused before anything expands it."""
    budget = MAX_METADATA_BYTES
    todo: list[tuple[Any, int]] = [(metadata, 0)]
    while todo:
        value, depth = todo.pop()
        if depth > MAX_METADATA_DEPTH:
            raise ValidationError("metadata", f"nests deeper than {MAX_METADATA_DEPTH} levels")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValidationError("metadata", "holds NaN or infinity, which JSON cannot carry")
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ValidationError("metadata", "has a key that is not text")
                budget -= len(key) + 4
                todo.append((item, depth + 1))
        elif isinstance(value, list | tuple):
            budget -= 2 + len(value)
            todo.extend((item, depth + 1) for item in value)
        elif isinstance(value, _SCALARS):
            budget -= len(value) if isinstance(value, str) else 4
        else:
            raise ValidationError(
                "metadata", f"holds a {type(value).__name__}, which JSON cannot carry"
            )
        if budget < 0:
            raise ValidationError("metadata", f"is over {MAX_METADATA_BYTES} bytes as JSON")


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ValidationError("metadata", f"must be a mapping, not {type(metadata).__name__}")
    _check_shape(metadata)
    try:
        text = json.dumps(metadata, ensure_ascii=False, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValidationError("metadata", f"is not JSON-serialisable ({exc})") from None
    _check_text("metadata", text)
    if len(text.encode("utf-8")) > MAX_METADATA_BYTES:
        raise ValidationError("metadata", f"is over {MAX_METADATA_BYTES} bytes as JSON")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def check_slug(slug: object) -> str | None:
    if slug is None:
        return None
    if not isinstance(slug, str):
        raise ValidationError("slug", f"must be text, not {type(slug).__name__}")
    _check_text("slug", slug)
    return slug


def build_record(
    content: object,
    *,
    importance: object = DEFAULT_IMPORTANCE,
    tags: Iterable[object] | None = None,
    timestamp: str | datetime | date | None = None,
    slug: object = None,
    metadata: Mapping[str, Any] | None = None,
    min_length: int = 1,
    max_bytes: int = MAX_CONTENT_BYTES,
) -> Record:
    """Validate every input, capture the canonical timestamp once, derive key and slug."""
    text = check_content(content, min_length=min_length, max_bytes=max_bytes)
    level = check_importance(importance)
    tag_tuple = check_tags(tags)
    meta = check_metadata(metadata)
    supplied = check_slug(slug)
    ts = canonical_timestamp(timestamp)
    return Record(
        key=idempotency_key(text, ts),
        timestamp=ts,
        content=text,
        importance=level,
        tags=tag_tuple,
        metadata=meta,
        slug=choose_slug(text, supplied),
    )
