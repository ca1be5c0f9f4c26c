"""Every number option of the command line is checked by range where argparse parses it, and a
command group named without its command says which ones exist (issue 22, point 3)."""

from __future__ import annotations

import argparse
import hashlib
import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.faces.cli import numbers
from tests.helpers.subproc import child_env, run_cli

# -- the pure range helpers -------------------------------------------------------------------

bounds = st.integers(-(10**6), 10**6)


@given(low=bounds, span=st.integers(0, 10**6), value=st.integers(-(10**7), 10**7))
def test_whole_takes_exactly_the_numbers_in_its_range(low: int, span: int, value: int) -> None:
    parse = numbers.whole(low, low + span)
    if low <= value <= low + span:
        assert parse(str(value)) == value
        assert parse(f" {value} ") == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"{low}..{low + span}"):
            parse(str(value))


@given(low=bounds, value=st.integers(-(10**7), 10**7))
def test_whole_without_a_top_has_no_top(low: int, value: int) -> None:
    parse = numbers.whole(low)
    if value >= low:
        assert parse(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"{low} or more"):
            parse(str(value))


@given(st.text())
def test_whole_refuses_any_text_that_is_not_an_integer(text: str) -> None:
    try:
        int(text.strip())
    except ValueError:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(text))):
            numbers.positive_int(text)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_fraction_is_zero_to_one_and_finite(value: float) -> None:
    if 0.0 <= value <= 1.0:
        assert numbers.fraction(repr(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=r"0\.\.1"):
            numbers.fraction(repr(value))


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_seconds_are_finite_and_not_negative(value: float) -> None:
    for parse, inside in (
        (numbers.seconds, value >= 0.0),
        (numbers.positive_seconds, value > 0.0),
    ):
        if inside and math.isfinite(value):
            assert parse(repr(value)) == value
        else:
            with pytest.raises(argparse.ArgumentTypeError):
                parse(repr(value))


@given(st.integers(-(10**6), 10**6))
def test_a_port_is_a_tcp_port_or_zero(value: int) -> None:
    if 0 <= value <= 65535:
        assert numbers.port_or_zero(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=r"0\.\.65535"):
            numbers.port_or_zero(str(value))


# -- through the real command line ------------------------------------------------------------


def files_of(root: Path) -> dict[str, tuple[str, int]]:
    """Every file's digest and modification time: a command that opened the store for
    writing, or wrote anything, changes one."""
    return {
        str(path.relative_to(root)): (
            hashlib.sha256(path.read_bytes()).hexdigest(),
            path.stat().st_mtime_ns,
        )
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A store holding one record, shared by the cases: none of them may change it."""
    root = tmp_path_factory.mktemp("numbers")
    env = child_env()
    done = run_cli(["add", "a record that must stay as it is"], cwd=root, env=env)
    assert done.returncode == 0, done.stderr
    return root, env


# (argv, the option the error names, the range it states)
BAD_NUMBERS = [
    (["search", "q", "--min-relevance", "2"], "--min-relevance", "0..1"),
    (["search", "q", "--min-relevance", "nan"], "--min-relevance", "0..1"),
    (["search", "q", "-n", "0"], "-n", "1..100"),
    (["search", "q", "-n", "101"], "-n", "1..100"),
    (["search", "q", "--min-importance", "11"], "--min-importance", "1..10"),
    (["recent", "--limit", "0"], "--limit", "1..100"),
    (["recent", "--limit", "-3"], "--limit", "1..100"),
    (["drain", "--timeout", "-1"], "--timeout", "above 0"),
    (["drain", "--timeout", "inf"], "--timeout", "above 0"),
    (["ui", "--port", "99999"], "--port", "0..65535"),
    (["run", "--metrics-port", "70000"], "--metrics-port", "0..65535"),
    (["replay", "--budget", "0"], "--budget", "1 or more"),
    (["reindex", "--batch", "0"], "--batch", "1 or more"),
    (["mcp", "--store-wait", "-0.5"], "--store-wait", "0 or more"),
    (["dead", "list", "--limit", "x"], "--limit", "1 or more"),
]


@pytest.mark.parametrize(
    ("argv", "option", "allowed"), BAD_NUMBERS, ids=[" ".join(case[0]) for case in BAD_NUMBERS]
)
def test_a_number_out_of_range_is_exit_2_naming_the_option_and_writes_nothing(
    store: tuple[Path, dict[str, str]], argv: list[str], option: str, allowed: str
) -> None:
    root, env = store
    before = files_of(root)
    result = run_cli(argv, cwd=root, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stdout == b""
    *_usage, line = result.stderr.decode().splitlines()
    assert f"error: argument {option}: expected" in line
    assert allowed in line
    assert "Traceback" not in result.stderr.decode()
    assert files_of(root) == before


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        ([], ("COMMAND", "add", "drain", "dead", "ui")),
        (["dead"], ("ACTION", "list, show, retry, discard")),
        (["dead", "show"], ("required: KEY",)),
        (["dead", "purge"], ("'list', 'show', 'retry', 'discard'",)),
        (["nosuch"], ("'add'", "'export'")),
    ],
)
def test_a_missing_or_unknown_subcommand_names_what_exists(
    store: tuple[Path, dict[str, str]], argv: list[str], names: tuple[str, ...]
) -> None:
    root, env = store
    before = files_of(root)
    result = run_cli(argv, cwd=root, env=env)
    assert result.returncode == 2
    *_usage, line = result.stderr.decode().splitlines()
    assert "error:" in line
    for name in names:
        assert name in line
    assert files_of(root) == before
