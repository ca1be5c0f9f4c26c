"""Markdown file names (contract section 3) for arbitrary Unicode, long tokens and hostile slugs.

The reference functions below restate the contract's rules one character at a time; the
library's slugs must agree with them exactly.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from outbox import Outbox
from outbox.core.keys import content_hash_prefix
from outbox.core.slugs import (
    carries_content_hash,
    choose_slug,
    derive_slug,
    markdown_filename,
    sanitize_slug,
)

HEX8 = re.compile(r"[0-9a-f]{8}")
TS = "2026-11-29T08:00:00.000000Z"

texts = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=400)
long_tokens = st.builds(
    lambda unit, count, tail: unit * count + tail,
    st.sampled_from(["a", "é", "日本", "😀", "a-", "ß", "Ǆ", "İ", "-x", "\u0301e"]),
    st.integers(40, 200),
    st.sampled_from(["", "!", "-", " tail", "…"]),
)
any_text = texts | long_tokens | st.lists(long_tokens, max_size=3).map(" ".join)


def ref_cut(text: str) -> str:
    """At most 100 UTF-8 bytes, dropping whole characters from the end, then trailing hyphens."""
    while len(text.encode("utf-8")) > 100:
        text = text[:-1]
    return text.rstrip("-")


def ref_tokens(content: str) -> list[str]:
    tokens = []
    for raw in content.split():
        chars = list(raw)
        while chars and not chars[0].isalnum():
            chars.pop(0)
        while chars and not chars[-1].isalnum():
            chars.pop()
        token = "".join(ch for ch in "".join(chars).lower() if ch.isalnum() or ch == "-")
        if token:
            tokens.append(token)
    return tokens[:8]


def ref_derived(content: str) -> str:
    prefix = hashlib.sha256(content.encode("utf-8")).hexdigest()[:8]
    part = ref_cut("-".join(ref_tokens(content)))
    return f"{part}-{prefix}" if part else prefix


def ref_supplied(slug: str) -> str:
    text = slug.lower().replace(" ", "-")
    text = "".join(ch for ch in text if ch.isalnum() or ch == "-")
    while "--" in text:
        text = text.replace("--", "-")
    return ref_cut(text.strip("-"))


def token_part(slug: str) -> str:
    """What precedes the 8-hex tail of a derived slug ('' when it is the tail alone)."""
    return slug[:-9] if len(slug) > 8 else ""


@settings(max_examples=300)
@given(content=any_text)
@example(content="Decision: use SQLite WAL -- for the outbox!")
@example(content="!!! ??? ...")
@example(content="x" * 500)
def test_derived_slug_follows_the_contract(content: str) -> None:
    slug = derive_slug(content)
    assert slug == ref_derived(content)
    prefix = hashlib.sha256(content.encode("utf-8")).hexdigest()[:8]
    assert slug.endswith(prefix)
    part = token_part(slug)
    if part:
        assert slug == f"{part}-{prefix}"
        assert not part.endswith("-")
        assert len(part.encode("utf-8")) <= 100
        assert all(ch.isalnum() or ch == "-" for ch in part)
        # Cut at a character boundary: the part is a prefix of the uncut token string.
        assert "-".join(ref_tokens(content)).startswith(part)
    else:
        assert HEX8.fullmatch(slug)
        assert ref_tokens(content) == [] or ref_cut("-".join(ref_tokens(content))) == ""


@settings(max_examples=300)
@given(supplied=any_text)
@example(supplied="../../x")
@example(supplied="a/b")
@example(supplied="--Hello   World--")
def test_supplied_slug_is_sanitised_by_the_contract_rules(supplied: str) -> None:
    cleaned = sanitize_slug(supplied)
    assert cleaned == ref_supplied(supplied)
    assert "--" not in cleaned
    assert not cleaned.startswith("-")
    assert not cleaned.endswith("-")
    assert "/" not in cleaned
    assert "." not in cleaned
    assert len(cleaned.encode("utf-8")) <= 100
    chosen = choose_slug("body of the memory", supplied)
    assert chosen == (cleaned or derive_slug("body of the memory"))


@settings(max_examples=300)
@given(
    content=any_text,
    supplied=st.none() | any_text,
    key=st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
)
def test_file_names_stay_within_255_bytes_and_inside_the_folder(
    content: str, supplied: str | None, key: str
) -> None:
    slug = choose_slug(content, supplied)
    for name in (markdown_filename(TS, slug), markdown_filename(TS, slug, collision_key=key)):
        assert len(name.encode("utf-8")) <= 255
        assert name.startswith("2026-11-29-")
        assert name.endswith(".md")
        assert "/" not in name
        assert "\x00" not in name
    assert markdown_filename(TS, slug, collision_key=key) == f"2026-11-29-{slug}-{key[:8]}.md"


@pytest.mark.parametrize(
    ("supplied", "expected"),
    [
        ("../../x", "x"),
        ("a/b", "ab"),
        ("Hello World", "hello-world"),
        ("  spaced  out  ", "spaced-out"),
        ("--a---b--", "a-b"),
        ("Ünïcödé Slug", "ünïcödé-slug"),
        ("日本 語", "日本-語"),
    ],
)
def test_hostile_and_ordinary_supplied_slugs(supplied: str, expected: str) -> None:
    assert choose_slug("whatever the content", supplied) == expected


@pytest.mark.parametrize("supplied", [None, "", "   ", "!!!", "../..", "/", "-- --", "🙂🙂"])
def test_slugs_with_nothing_left_are_derived(supplied: str | None) -> None:
    content = "The Outbox keeps memories: safe & sound."
    expected = (
        "the-outbox-keeps-memories-safe-sound-" + hashlib.sha256(content.encode()).hexdigest()[:8]
    )
    assert choose_slug(content, supplied) == expected


def test_only_eight_tokens_are_used() -> None:
    content = "one two three four five six seven eight nine ten"
    prefix = hashlib.sha256(content.encode()).hexdigest()[:8]
    assert derive_slug(content) == f"one-two-three-four-five-six-seven-eight-{prefix}"


def test_content_without_tokens_gives_the_hash_alone() -> None:
    content = "?! … —— ::"
    assert derive_slug(content) == hashlib.sha256(content.encode()).hexdigest()[:8]


def test_long_multibyte_token_is_cut_at_a_character_boundary() -> None:
    content = "日" * 40  # 120 bytes: the cut must fall after 33 characters (99 bytes)
    part = token_part(derive_slug(content))
    assert part == "日" * 33


def test_hyphen_at_the_cut_is_stripped() -> None:
    content = "a" * 99 + "-bcd"
    assert token_part(derive_slug(content)) == "a" * 99


@pytest.mark.parametrize("supplied", ["../../escape", "a/b", "/etc/passwd", "..", "sub/dir/x"])
def test_a_hostile_slug_never_leaves_the_markdown_folder(outbox: Outbox, supplied: str) -> None:
    receipt = outbox.add(f"memory written with slug {supplied!r}", slug=supplied)
    assert receipt.markdown_path is not None
    assert outbox.wait_mirrored(10)  # the receipt promises the commit; the file follows
    path = Path(receipt.markdown_path)
    assert path.parent.resolve() == outbox.markdown_dir.resolve()
    assert path.is_file()
    files = [p for p in outbox.markdown_dir.rglob("*") if p.is_file()]
    assert files == [path]


@settings(max_examples=200)
@given(content=any_text, other=any_text)
def test_a_derived_slug_carries_its_content_hash_and_no_other(content: str, other: str) -> None:
    """The write path skips looking a derived name up in the folder: it must be recognised
    as derived, and a name derived from other content (or a plain supplied slug) must not."""
    assert carries_content_hash(derive_slug(content), content)
    if content_hash_prefix(other) != content_hash_prefix(content):
        assert not carries_content_hash(derive_slug(other), content)
    assert not carries_content_hash("notes", content) or content_hash_prefix(content) == "notes"
