"""Record identity (contract section 2): the key and the file name depend only on
(content, instant), whatever notation the instant arrives in."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox import ValidationError
from outbox.core.keys import canonical_timestamp, idempotency_key, parse_instant
from outbox.core.record import build_record
from outbox.core.slugs import markdown_filename

# Valid content: not blank, no NUL, no lone surrogate (the validation gate rejects those).
contents = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), min_size=1
).filter(lambda text: text.strip() != "")

# Instants far enough from the ends of datetime's range that any offset stays representable.
instants = st.datetimes(
    min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)
)
offsets = st.integers(min_value=-(23 * 60 + 59), max_value=23 * 60 + 59).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)
zones = st.sampled_from(
    ["America/St_Johns", "Asia/Kathmandu", "Pacific/Chatham", "Europe/Berlin", "Asia/Tokyo"]
).map(ZoneInfo)


def expected_canonical(instant: datetime) -> str:
    """The contract's form, built field by field rather than with strftime."""
    u = instant.astimezone(UTC)
    return (
        f"{u.year:04d}-{u.month:02d}-{u.day:02d}T{u.hour:02d}:{u.minute:02d}:{u.second:02d}"
        f".{u.microsecond:06d}Z"
    )


def expected_key(content: str, canonical: str) -> str:
    return hashlib.sha256(content.encode() + b"\n" + canonical.encode("ascii")).hexdigest()


def fraction(instant: datetime, digits: int) -> str:
    """The fractional part with ``digits`` digits, or as few as keep the value exact."""
    text = f"{instant.microsecond:06d}"
    shortest = text.rstrip("0")
    keep = max(digits, len(shortest))
    return "." + text[:keep] if keep else ""


def written(instant: datetime, digits: int, separator: str = "T", suffix: str | None = None) -> str:
    """``instant`` as ISO 8601 text in its own offset, or with ``suffix`` in place of it."""
    date = f"{instant.year:04d}-{instant.month:02d}-{instant.day:02d}"
    clock = instant.strftime("%H:%M:%S") + fraction(instant, digits)
    offset = instant.isoformat()[-6:] if suffix is None else suffix
    return f"{date}{separator}{clock}{offset}"


@st.composite
def notations(draw: st.DrawFn, instant: datetime) -> str | datetime:
    """One of many ways to write ``instant``: strings with any offset or none, Z, a space
    separator, trimmed or padded fractions, or aware/naive datetime objects."""
    kind = draw(st.sampled_from(["z", "plus0", "offset", "naive", "space", "dt_offset", "dt_zone"]))
    digits = draw(st.integers(0, 6))
    if kind == "dt_offset":
        return instant.astimezone(draw(offsets))
    if kind == "dt_zone":
        return instant.astimezone(draw(zones))
    if kind == "offset":
        return written(instant.astimezone(draw(offsets)), digits)
    if kind == "naive":
        return written(instant, digits, suffix="")
    if kind == "space":
        return written(instant, digits, separator=" ", suffix="Z")
    return written(instant, digits, suffix="Z" if kind == "z" else "+00:00")


@settings(max_examples=200)
@given(content=contents, instant=instants, data=st.data())
def test_any_two_notations_give_the_same_canonical_form_key_and_name(
    content: str, instant: datetime, data: st.DataObject
) -> None:
    first = data.draw(notations(instant))
    second = data.draw(notations(instant))
    canonical = expected_canonical(instant)
    a = build_record(content, timestamp=first)
    b = build_record(content, timestamp=second)
    assert a.timestamp == b.timestamp == canonical
    assert a.key == b.key == expected_key(content, canonical)
    assert a.slug == b.slug
    name = markdown_filename(a.timestamp, a.slug)
    assert name == markdown_filename(b.timestamp, b.slug)
    assert name.startswith(canonical[:10] + "-")


@settings(max_examples=200)
@given(
    content=contents,
    instant=instants,
    importance=st.integers(1, 10),
    tags=st.lists(st.sampled_from(["a", "b", "decision", "x y"]), max_size=3),
    metadata=st.dictionaries(st.sampled_from(["agent", "n"]), st.integers(), max_size=2),
)
def test_key_and_file_name_ignore_everything_but_content_and_instant(
    content: str,
    instant: datetime,
    importance: int,
    tags: list[str],
    metadata: dict[str, int],
) -> None:
    plain = build_record(content, timestamp=instant)
    dressed = build_record(
        content, timestamp=instant, importance=importance, tags=tags, metadata=metadata
    )
    assert dressed.key == plain.key
    assert markdown_filename(dressed.timestamp, dressed.slug) == markdown_filename(
        plain.timestamp, plain.slug
    )


@settings(max_examples=200)
@given(content=contents, other=contents, instant=instants)
def test_different_content_or_instant_gives_a_different_key(
    content: str, other: str, instant: datetime
) -> None:
    canonical = expected_canonical(instant)
    later = expected_canonical(instant + timedelta(microseconds=1))
    assert idempotency_key(content, canonical) != idempotency_key(content, later)
    if other != content:
        assert idempotency_key(content, canonical) != idempotency_key(other, canonical)


@settings(max_examples=200)
@given(content=contents, canonical=instants.map(expected_canonical))
def test_key_formula_is_the_contract_formula(content: str, canonical: str) -> None:
    key = idempotency_key(content, canonical)
    assert key == expected_key(content, canonical)
    assert len(key) == 64
    assert key == key.lower()
    int(key, 16)


@settings(max_examples=200)
@given(instant=instants)
def test_naive_datetime_is_utc(instant: datetime) -> None:
    naive = instant.replace(tzinfo=None)
    assert canonical_timestamp(naive) == expected_canonical(instant)
    assert canonical_timestamp(naive.isoformat()) == expected_canonical(instant)


def test_known_value() -> None:
    """One fixed example, so a reader can check the formula by hand."""
    record = build_record("hello", timestamp="2026-11-29T09:30:00+01:30")
    assert record.timestamp == "2026-11-29T08:00:00.000000Z"
    assert record.key == hashlib.sha256(b"hello\n2026-11-29T08:00:00.000000Z").hexdigest()


def test_timestamp_is_captured_once_when_none_is_given() -> None:
    before = datetime.now(UTC)
    record = build_record("captured now")
    after = datetime.now(UTC)
    instant = parse_instant(record.timestamp)
    assert before - timedelta(microseconds=1) <= instant <= after
    assert record.timestamp == expected_canonical(instant)


@pytest.mark.parametrize(
    "bad",
    ["", "   ", "yesterday", "2026-13-01T00:00:00Z", "2026-11-29T25:00:00Z", "29/11/2026", 12345],
)
def test_bad_timestamps_are_rejected(bad: object) -> None:
    with pytest.raises(ValidationError) as info:
        build_record("some content", timestamp=bad)  # type: ignore[arg-type]
    assert info.value.field == "timestamp"


def test_instant_outside_the_range_is_a_validation_error() -> None:
    with pytest.raises(ValidationError, match="timestamp"):
        build_record("some content", timestamp="0001-01-01T00:00:00+05:00")


def test_nfc_and_nfd_are_two_keys() -> None:
    """Content is identified by its exact bytes: two Unicode forms of one text are two
    records, as docs/guarantees.md says (a caller normalises first if it wants one)."""
    import unicodedata

    text = "café au lait, décidé"
    nfc, nfd = unicodedata.normalize("NFC", text), unicodedata.normalize("NFD", text)
    ts = "2026-11-29T08:00:00Z"
    first, second = build_record(nfc, timestamp=ts), build_record(nfd, timestamp=ts)
    assert (first.content, second.content) == (nfc, nfd)  # kept as given, not normalised
    assert first.key != second.key
