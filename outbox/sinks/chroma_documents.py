"""What a record becomes in Chroma: which content can be embedded, which vectors are usable,
and the metadata Chroma accepts. Pure functions: no chromadb needed to use them.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from outbox.core.recall_filter import TAG_PREFIX
from outbox.core.record import Record

# Metadata keys the sink writes itself; a record's own metadata cannot override them.
RESERVED_KEYS = frozenset({"timestamp", "timestamp_epoch", "importance", "tags"})
# One boolean key per tag (``TAG_PREFIX`` + name, the key the recall filter's ``where`` tests):
# Chroma's ``where`` cannot test a list's members. Documents written before these keys existed
# lack them: a tag filter's vector leg misses them until they are embedded again (the lexical
# leg still finds them).
_INT64 = (-(2**63), 2**63 - 1)
_TS_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"

Scalar = str | int | float | bool
MetadataValue = Scalar | list[str] | list[int] | list[float] | list[bool]


def has_visible_text(content: str) -> bool:
    """False when every character is whitespace, a control or format character (zero-width
    space, BOM, bidi marks), a lone accent (Mn) or U+FFFD (what a decoding error leaves):
    MiniLM's tokenizer drops all of them, so such content embeds to the vector of the empty
    string, one point shared by every such record, which no query can tell apart."""
    return any(
        unicodedata.category(ch)[0] not in "CZ"
        and unicodedata.category(ch) != "Mn"
        and ch != "\ufffd"
        for ch in content
    )


def vector_problem(vector: Sequence[float]) -> str | None:
    """Why Chroma should not get this vector (a custom embedder's NaN, an all-zero vector)."""
    import numpy as np

    values = np.asarray(vector, dtype=np.float64).ravel()
    if values.size == 0:
        return "the embedding is empty"
    if not np.isfinite(values).all():
        return "the embedding holds NaN or infinity"
    if not values.any():
        return "the embedding is all zeros (no cosine direction)"
    return None


def _metadata_key_ok(key: str) -> bool:
    # Chroma refuses empty keys, keys starting with '#' or '$', and its 'chroma:' keys.
    return bool(key) and key[0] not in "#$" and not key.startswith("chroma:")


def _scalar(value: Any) -> Scalar | None:
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if _INT64[0] <= value <= _INT64[1] else str(value)
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Nested mappings become dotted keys; Chroma takes no nesting."""
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{name}.")
        else:
            yield name, value


def chroma_metadata(record: Record) -> dict[str, MetadataValue]:
    """The record's scalar metadata plus timestamp (text and epoch float), importance, tags
    (as a list, and as one ``tag:<name>`` key each, for filters).

    Dropped, as Chroma would refuse them: None, empty or mixed-type lists, lists of
    non-scalars, keys it reserves. Integers past 64 bits become text.
    """
    metadata: dict[str, MetadataValue] = {}
    for key, value in _flatten(record.metadata):
        if key in RESERVED_KEYS or key.startswith(TAG_PREFIX) or not _metadata_key_ok(key):
            continue
        if isinstance(value, list):
            items = [_scalar(item) for item in value]
            kinds = {type(item) for item in items}
            if items and len(kinds) == 1 and None not in items:
                metadata[key] = items  # type: ignore[assignment]
            continue
        scalar = _scalar(value)
        if scalar is not None:
            metadata[key] = scalar
    moment = datetime.strptime(record.timestamp, _TS_FORMAT).replace(tzinfo=UTC)
    metadata["timestamp"] = record.timestamp
    metadata["timestamp_epoch"] = moment.timestamp()
    metadata["importance"] = record.importance
    if record.tags:
        metadata["tags"] = list(record.tags)
        for tag in record.tags:
            if _metadata_key_ok(TAG_PREFIX + tag):
                metadata[TAG_PREFIX + tag] = True
    return metadata
