"""The front matter built without the YAML dumper is the dumper's output, byte for byte.

``markdown.render`` writes simple front matter (booleans, integers, None, simple strings,
lists and string mappings of them) directly and hands everything else to ``yaml.dump``.
Whatever it writes must be exactly what the dumper writes, or files would change shape
between two versions of the library; the property test below checks that on front matter
full of the strings YAML treats specially.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.core.record import build_record
from outbox.mirror import markdown
from outbox.mirror.matter import delivered as from_deliveries
from outbox.mirror.matter import initial
from outbox.store.deliveries import DeliveryRow


def dumped(matter: dict[str, Any]) -> str:
    return yaml.dump(
        matter,
        Dumper=markdown._FrontMatterDumper,
        sort_keys=False,
        default_flow_style=None,
        allow_unicode=True,
        width=1_000_000,
    )


# Strings YAML reads as something else, or must quote, or cannot write plain.
TRICKY = [
    "true", "False", "yes", "NO", "on", "Off", "null", "Null", "~", "", " ", "1", "-1", "0x1F",
    "0o17", "017", "1_000", "1:20", "1.5", ".inf", ".nan", "-.inf", "1e3", "2026-11-29",
    "2026-11-29T08:00:00.000000Z", "2026-11-29 08:00:00", "a:b", "a: b", "a:", ":a", "a #b",
    "#a", "-a", "?a", "a,b", "[a]", "{a}", "a'b", 'a"b', "é", "a\nb", "a\tb", "\x85",
    "outbox.testing.sinks:NoopSink", "manual-0123abcd", "x" * 127, "x" * 128, "x" * 300,
]  # fmt: skip
texts = st.one_of(
    st.sampled_from(TRICKY),
    st.text(alphabet="aZ09_.-: '#,[]{}\"é\n", max_size=12),
)
leaves = st.one_of(st.none(), st.booleans(), st.integers(), texts, st.floats(allow_nan=False))
values = st.one_of(
    leaves,
    st.lists(texts, max_size=4),
    st.lists(leaves, max_size=3),
    st.dictionaries(texts, texts, max_size=3),
    st.dictionaries(texts, leaves, max_size=2),
    # Nested (metadata can hold anything): always the dumper's, never a cached line.
    st.dictionaries(texts, st.lists(texts, max_size=2), max_size=2),
    st.lists(st.lists(texts, max_size=2), max_size=2),
)
matters = st.dictionaries(st.one_of(st.sampled_from(["key", "tags", "sinks"]), texts), values)


# Front matter the direct path takes: strings of its grammar, YAML's special words among them.
simple = st.one_of(
    st.sampled_from([text for text in TRICKY if markdown._SIMPLE.fullmatch(text)]),
    st.from_regex(markdown._SIMPLE, fullmatch=True),
)
simple_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    simple,
    st.lists(simple, max_size=4),
    st.dictionaries(simple, simple, max_size=3),
)
# A list value makes the dumper write the mapping in block style, as every record's tags do.
simple_matters = st.builds(
    lambda matter, tags: {**matter, "tags": tags},
    st.dictionaries(simple, simple_values),
    st.lists(simple, max_size=4),
)


@settings(max_examples=600, deadline=None)
@given(st.one_of(matters, simple_matters))
def test_built_front_matter_is_the_dumpers_byte_for_byte(matter: dict[str, Any]) -> None:
    built = markdown._simple_front_matter(matter)
    if built is not None:
        assert built == dumped(matter)


@settings(max_examples=300, deadline=None)
@given(
    st.from_regex(r"[0-9a-f]{64}", fullmatch=True) | st.from_regex(r"[0-9b]{64}", fullmatch=True),
    st.datetimes(timezones=st.none()).map(lambda at: at.isoformat(timespec="microseconds") + "Z"),
)
def test_keys_and_timestamps_are_written_as_the_dumper_writes_them(key: str, ts: str) -> None:
    """The two shortcuts for every record's own strings (no resolver), including keys that
    are all digits or look like binary numbers, which must still take the long way."""
    matter = {"key": key, "timestamp": ts, "tags": [key, ts], "sinks": {key: ts}}
    assert markdown._simple_front_matter(matter) == dumped(matter)
    # and read back past the line cache as the loader reads them, types included
    text = dumped(matter)
    assert markdown._simple_matter(text) == loaded(text)
    for name in ("key", "timestamp"):
        assert type(markdown._simple_matter(text)[name]) is type(loaded(text)[name])


def test_a_records_front_matter_takes_the_direct_path() -> None:
    record = build_record("a memory", tags=["decision", "storage"], importance=7)
    matter = initial(record, ["chroma", "brainlayer", "outbox.testing.sinks:NoopSink"])
    assert markdown._simple_front_matter(matter) == dumped(matter)
    row = DeliveryRow(
        delivery_id=1,
        key=record.key,
        sink="brainlayer",
        state="delivered",
        attempts=2,
        available_at=1.0,
        last_error=None,
        error_class="db_busy",
        sink_id="manual-0123456789abcdef",
        mirror_pending=True,
        created_at=1.0,
        delivered_at=2.0,
    )
    delivered = from_deliveries(record, [row])
    assert markdown._simple_front_matter(delivered) == dumped(delivered)
    rendered = markdown.render(delivered, "body")
    assert rendered == markdown.FENCE + dumped(delivered).encode() + markdown.FENCE + b"body"
    assert yaml.safe_load(rendered.split(markdown.FENCE)[1]) == delivered


def test_other_front_matter_still_goes_through_the_dumper() -> None:
    matter = {"tags": ["a b", "ünïcode"], "timestamp": 1.5, "chunk_id": None}
    assert markdown._simple_front_matter(matter) is None
    assert markdown.render(matter, b"x") == (
        markdown.FENCE + dumped(matter).encode() + markdown.FENCE + b"x"
    )


def loaded(text: str) -> Any:
    return yaml.load(text, Loader=markdown._BaseLoader)


@settings(max_examples=600, deadline=None)
@given(st.one_of(matters, simple_matters))
def test_front_matter_read_directly_is_what_the_loader_reads(matter: dict[str, Any]) -> None:
    """Whatever the writer makes of any front matter, the direct reader either declines it
    or reads exactly what the safe loader reads (types included)."""
    text = markdown.render(matter, b"").split(markdown.FENCE)[1].decode()
    read = markdown._simple_matter(text)
    if read is not None:
        expected = loaded(text)
        assert read == expected
        assert [type(v) for v in read.values()] == [type(v) for v in expected.values()]


def test_a_records_front_matter_is_read_directly() -> None:
    record = build_record("a memory", tags=["decision", "true"], importance=7)
    matter = initial(record, ["chroma", "outbox.testing.sinks:NoopSink"])
    matter["sink_ids"] = {"chroma": record.key, "outbox.testing.sinks:NoopSink": record.key}
    text = markdown.render(matter, b"").split(markdown.FENCE)[1].decode()
    assert markdown._simple_matter(text) == loaded(text) == matter


@pytest.mark.parametrize(
    "text",
    [
        "a: yes\n",  # YAML 1.1 reads a boolean
        "true: x\n",  # a key YAML reads as a boolean
        "a: 017\n",  # an octal number
        "a: 1_000\n",
        "a: b # note\n",
        "a: [b, ]\n",
        "a: {b: c: d}\n",
        "a: b\r\n",
        "  a: b\n",
        "a: b",
        "{a: 1}\n",
    ],
)
def test_anything_else_is_left_to_the_loader(text: str) -> None:
    assert markdown._simple_matter(text) is None


def test_the_line_caches_keep_types_apart_and_hand_out_copies() -> None:
    """``True == 1`` and they hash alike, so the render cache must tell them apart; a list
    read from a cached line must be the caller's own to change."""
    for value, text in ((True, "a: true\n"), (1, "a: 1\n"), (True, "a: true\n"), (0, "a: 0\n")):
        matter = {"a": value, "tags": ["x"]}
        assert markdown._simple_front_matter(matter) == text + "tags: [x]\n" == dumped(matter)
    nested = {"tags": ["x"], "metadata": {"a": ["b"]}, "more": [["c"]]}
    assert markdown._simple_front_matter(nested) is None
    assert markdown.render(nested, b"").decode() == "---\n" + dumped(nested) + "---\n"
    first = markdown._simple_matter("tags: [x, y]\nsinks: {a: b}\n")
    assert first == {"tags": ["x", "y"], "sinks": {"a": "b"}}
    first["tags"].append("z")
    first["sinks"]["c"] = "d"
    assert markdown._simple_matter("tags: [x, y]\nsinks: {a: b}\n") == {
        "tags": ["x", "y"],
        "sinks": {"a": "b"},
    }
