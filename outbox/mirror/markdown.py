"""The markdown file format: YAML front matter, then the content byte for byte.

Simple front matter (every record's own) is written directly; anything else goes through
libyaml's safe dumper when present, which is faster than the pure-Python one. What the front
matter says is decided in ``mirror/matter.py``. A write that replaces a file goes through a
temp file beside it, whose name this module alone makes and reads back.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import yaml

_BaseDumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_BaseLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _FrontMatterDumper(_BaseDumper):  # type: ignore[misc,valid-type]
    """Safe dumper that writes None as an empty value (``chunk_id:``), the published form."""


_FrontMatterDumper.add_representer(
    type(None), lambda dumper, _value: dumper.represent_scalar("tag:yaml.org,2002:null", "")
)

FENCE = b"---\n"

# The two names the markdown folder keeps for the fallback queue (``write/fallback.py``): its
# index of waiting files, and the part of it an importer has claimed (``claim_index``). The
# mirrors read them too, to know whether fallback files wait, without importing the write path.
INDEX_NAME = ".outbox-fallback.idx"
PROCESSING_SUFFIX = ".processing"


class MalformedMarkdown(ValueError):
    """A file that is not front matter plus body; replay names it and moves on."""


def render(matter: Mapping[str, Any], content: str | bytes) -> bytes:
    body = content.encode("utf-8") if isinstance(content, str) else content
    text = _simple_front_matter(matter)
    if text is None:
        text = yaml.dump(
            dict(matter),
            Dumper=_FrontMatterDumper,
            sort_keys=False,
            default_flow_style=None,
            allow_unicode=True,
            width=1_000_000,
        )
    return FENCE + text.encode("utf-8") + FENCE + body


# Text PyYAML writes unquoted, or in single quotes when it would read back as another type:
# ASCII letters, digits, "_", "." and "-", starting with a letter or digit, with single ":"
# between such runs (a timestamp, a module:attr sink name). Anything else goes to yaml.dump.
_SIMPLE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*(?::[A-Za-z0-9_.\-]+)*")
# PyYAML's stubs leave ``resolve`` untyped; this is its signature as used here.
_resolve: Callable[[type[yaml.Node], str, tuple[bool, bool]], str] = (
    yaml.resolver.Resolver().resolve
)
_STR_TAG = "tag:yaml.org,2002:str"
_MAX_SIMPLE_KEY = 127  # PyYAML writes longer mapping keys in the explicit "? key" form


# Every record's own unique strings, settled without the resolver (and kept out of the cache,
# which they would flush): a canonical timestamp reads back as a timestamp, so it is quoted;
# a 64-hex key holding a, c, d, e or f can be no number (YAML's ints need digits only, or 0b
# and binary digits), so it is plain. tests/test_markdown_fast.py checks both against the dumper.
_CANONICAL_TS = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z")
_HEX_KEY = re.compile(r"[0-9a-f]{64}")
_NOT_A_NUMBER = re.compile(r"[acdef]")


def _scalar(text: str, *, flow: bool) -> str | None:
    """``text`` as PyYAML's emitter writes it, or None when it is not a simple string."""
    if _CANONICAL_TS.fullmatch(text):
        return f"'{text}'"
    if _HEX_KEY.fullmatch(text) and _NOT_A_NUMBER.search(text):
        return text
    return _recurring_scalar(text, flow=flow)


@functools.lru_cache(maxsize=4096)  # key names, sink names, states and tags recur
def _recurring_scalar(text: str, *, flow: bool) -> str | None:
    if not _SIMPLE.fullmatch(text):
        return None
    reads_back = _resolve(yaml.ScalarNode, text, (True, False)) == _STR_TAG
    plain = reads_back and not (flow and ":" in text)  # ":" is an indicator in [..] and {..}
    return text if plain else f"'{text}'"


def _value(value: Any) -> str | None:
    """Exact types only: a subclass (an enum, an OrderedDict) may not dump the same way."""
    kind = type(value)
    if kind is bool:
        return "true" if value else "false"
    if kind is int:
        return str(value)
    if kind is str:
        return _scalar(value, flow=False)
    if kind is list:
        items = [_scalar(item, flow=True) if type(item) is str else None for item in value]
        return None if None in items else "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
    if kind is dict:
        pairs = []
        for key, item in value.items():
            if type(key) is not str or type(item) is not str or len(key) > _MAX_SIMPLE_KEY:
                return None
            name, text = _scalar(key, flow=True), _scalar(item, flow=True)
            if name is None or text is None:
                return None
            pairs.append(f"{name}: {text}")
        return "{" + ", ".join(pairs) + "}"
    return None


def _simple_front_matter(matter: Mapping[str, Any]) -> str | None:
    """The YAML ``yaml.dump`` gives for front matter made of booleans, integers, None and
    simple strings (alone, in a list or in a string-to-string mapping), built directly; None
    for anything else.

    The dumper's Python representer is a large part of each new file and of each
    front-matter update a delivery makes (figures in docs/benchmarks.md).
    tests/test_markdown_fast.py checks the output is the dumper's, byte for byte.
    """
    if not any(type(value) in (list, dict) for value in matter.values()):
        return None  # all scalars: the dumper writes the whole mapping in flow style, {..}
    lines = []
    for key, value in matter.items():
        kind = _KINDS.get(type(value))
        if kind is None or type(key) is not str:
            return None
        unique = _unique(value) if kind == "str" else None
        if unique is not None:  # a record's own key or timestamp: the cache would only churn
            name = _name(key)
            if name is None:
                return None
            lines.append(f"{name}: {unique}\n")
            continue
        frozen = value if kind in _SCALARS else tuple(value.items() if kind == "dict" else value)
        try:
            line = _line(key, kind, frozen)
        except TypeError:  # a list or dict inside it (unhashable): never simple front matter
            return None
        if line is None:
            return None
        lines.append(line)
    return "".join(lines) or None


# The exact types front matter may hold here, by name: the cache's key keeps True apart
# from 1 (equal, and equally hashed) and a list apart from a tuple.
_KINDS: dict[type, str] = {
    bool: "bool",
    int: "int",
    str: "str",
    type(None): "none",
    list: "list",
    dict: "dict",
}
_SCALARS = frozenset(("bool", "int", "str", "none"))


def _unique(text: str) -> str | None:
    """A record's own key or canonical timestamp as the emitter writes it (``_scalar``),
    settled without a cache; None for any other string."""
    if len(text) not in _UNIQUE_LENGTHS:
        return None
    if _CANONICAL_TS.fullmatch(text):
        return f"'{text}'"
    if _HEX_KEY.fullmatch(text) and _NOT_A_NUMBER.search(text):
        return text
    return None


_UNIQUE_LENGTHS = frozenset((27, 64))  # a canonical timestamp's, a key's


@functools.lru_cache(maxsize=256)
def _name(key: str) -> str | None:
    """A mapping key as ``_line`` writes it."""
    return None if len(key) > _MAX_SIMPLE_KEY else _scalar(key, flow=False)


@functools.lru_cache(maxsize=4096)  # most lines recur from file to file: only two are unique
def _line(key: str, kind: str, frozen: Any) -> str | None:
    """One ``key: value`` line, ``frozen`` being the value made hashable (a list or dict as
    a tuple of its items)."""
    if len(key) > _MAX_SIMPLE_KEY:
        return None
    value = list(frozen) if kind == "list" else dict(frozen) if kind == "dict" else frozen
    name = _scalar(key, flow=False)
    text = "" if value is None else _value(value)
    if name is None or text is None:
        return None
    return f"{name}: {text}\n" if text else f"{name}:\n"


# A line of simple front matter as ``_simple_front_matter`` writes it: a plain key, then a
# value; a value the reader below cannot settle exactly sends the whole text to YAML.
_MATTER_LINE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*):(?: (.*))?")
_QUOTED = re.compile(r"'([A-Za-z0-9][A-Za-z0-9_.\-]*(?::[A-Za-z0-9_.\-]+)*)'")
_DECIMAL = re.compile(r"0|-?[1-9][0-9]*")
_BOOLEANS = {"true": True, "false": False}


class _NotSimple(Exception):
    """The text is outside the grammar the direct reader settles; YAML reads it."""


@functools.lru_cache(maxsize=4096)
def _plain_tag(text: str) -> str:
    return _resolve(yaml.ScalarNode, text, (True, False))


def _read_string(text: str, *, flow: bool) -> str:
    """A string item as the writer leaves it: single-quoted, or plain when it reads back
    as a string (in a flow collection, without ":")."""
    quoted = _QUOTED.fullmatch(text)
    if quoted:
        return quoted.group(1)
    if _HEX_KEY.fullmatch(text) and _NOT_A_NUMBER.search(text):
        return text
    if not _SIMPLE.fullmatch(text) or (flow and ":" in text) or _plain_tag(text) != _STR_TAG:
        raise _NotSimple
    return text


def _read_value(text: str) -> Any:
    if not text:
        return None
    if text in _BOOLEANS:
        return _BOOLEANS[text]
    if _DECIMAL.fullmatch(text):
        return int(text)
    if text[0] == "[" and text[-1] == "]":
        inner = text[1:-1]
        return [_read_string(item, flow=True) for item in inner.split(", ")] if inner else []
    if text[0] == "{" and text[-1] == "}":
        pairs = [pair.split(": ") for pair in text[1:-1].split(", ")] if text[1:-1] else []
        if any(len(pair) != 2 for pair in pairs):
            raise _NotSimple
        return {_read_string(k, flow=True): _read_string(v, flow=True) for k, v in pairs}
    return _read_string(text, flow=False)


def _simple_matter(text: str) -> dict[str, Any] | None:
    """What the safe loader reads from front matter ``_simple_front_matter`` wrote, read
    directly (its constructors were a large part of each delivery's front-matter update);
    None for anything else. tests/test_markdown_fast.py checks it against the loader."""
    if not text.endswith("\n"):
        return None
    matter: dict[str, Any] = {}
    try:
        for line in text[:-1].split("\n"):
            name, value = _read_unique(line) or _read_line(line)
            matter[name] = value.copy() if type(value) in (list, dict) else value
    except _NotSimple:
        return None
    return matter or None


def _read_unique(line: str) -> tuple[str, Any] | None:
    """A line holding a record's own key or canonical timestamp, read without the cache
    (which such lines would only churn); None for any other line."""
    name, colon, text = line.partition(": ")
    if not colon or len(text) not in _UNIQUE_QUOTED_LENGTHS:
        return None
    value = text[1:-1] if text[0] == "'" and text[-1] == "'" else text
    if _unique(value) != text or _read_name(name) is None:
        return None
    return name, value


_UNIQUE_QUOTED_LENGTHS = frozenset((29, 64))  # a quoted canonical timestamp's, a key's


@functools.lru_cache(maxsize=256)
def _read_name(name: str) -> str | None:
    """A mapping key as ``_read_line`` accepts it, or None."""
    found = _MATTER_LINE.fullmatch(name + ":")
    return name if found is not None and _plain_tag(name) == _STR_TAG else None


@functools.lru_cache(maxsize=4096)  # most lines recur from file to file: only two are unique
def _read_line(line: str) -> tuple[str, Any]:
    """One line's key and value (shared by the cache: the caller copies a list or dict)."""
    found = _MATTER_LINE.fullmatch(line)
    if found is None or _plain_tag(found.group(1)) != _STR_TAG:
        raise _NotSimple
    return found.group(1), _read_value(found.group(2) or "")


def parse(data: bytes) -> tuple[dict[str, Any], bytes]:
    """Split a file into (front matter, body bytes). The body is everything after the
    closing ``---`` line, untouched."""
    if not (data.startswith(b"---\n") or data.startswith(b"---\r\n")):
        raise MalformedMarkdown("does not start with a --- front matter line")
    start = data.index(b"\n") + 1
    pos = start
    while True:
        end = data.find(b"\n", pos)
        if end == -1:
            raise MalformedMarkdown("front matter has no closing --- line")
        if data[pos:end].rstrip(b"\r") == b"---":
            break
        pos = end + 1
    try:
        text = data[start:pos].decode("utf-8")
        loaded = _simple_matter(text)
        if loaded is None:
            loaded = yaml.load(text, Loader=_BaseLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise MalformedMarkdown(
            f"front matter is not valid YAML ({exc.__class__.__name__})"
        ) from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise MalformedMarkdown("front matter is not a mapping")
    return loaded, data[end + 1 :]


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fill(fd: int, data: bytes, path: Path | str, *, fsync: bool) -> None:
    """Write all of ``data`` to the new file ``fd`` and close it; on any failure, close it
    and remove ``path``, so no partial file is left behind."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def write_new(path: Path | str, data: bytes) -> bool:
    """Create ``path`` 0600 with ``data`` unless it exists; returns whether it was created.

    Not fsynced: the database is the source of truth and repair rewrites a lost file.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    _fill(fd, data, path, fsync=False)
    return True


class TempName(NamedTuple):
    """What a temp file's name says: the file it was to become, and the writer's process
    and thread."""

    target: str
    pid: int
    tid: int


def temp_name(target: str, pid: int, tid: int) -> str:
    """The name ``write_atomic`` gives its temp file of ``target``: hidden, in the same
    folder, one per process and thread, so two writers never share (and truncate) one."""
    return f".{target}.{pid}-{tid}.tmp"


# Exactly what ``temp_name`` writes: decimal numbers without leading zeros, so a name that
# parses is the name its writer used, and a person's look-alike file is never taken for one.
_TEMP_NAME = re.compile(r"\.(.+)\.(0|[1-9][0-9]*)-(0|[1-9][0-9]*)\.tmp", re.DOTALL)


def parse_temp_name(name: str) -> TempName | None:
    """The target and writer of a name ``temp_name`` gave, or None for any other name: the
    one reading forget and verify use to find a temp file a killed writer left (pure)."""
    found = _TEMP_NAME.fullmatch(name)
    if found is None:
        return None
    return TempName(found.group(1), int(found.group(2)), int(found.group(3)))


# After this long a temp file is stale even if its pid runs: that process is another one by
# now (pids are reused), as no write holds its temp file for more than moments.
STALE_TEMP_AGE = 3600.0


def _writer_gone(pid: int) -> bool:
    """Whether no process has ``pid``: a writer that still runs may rename its temp file yet."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (none can have that pid)
        return True
    except PermissionError:  # another user's process: alive
        return False
    return False


def stale_temps(folder: Path, target: str | None = None) -> list[TempName]:
    """The temp files in ``folder`` (of ``target`` only, when given) whose writer was killed
    before its rename: its pid runs no process, or the file is older than ``STALE_TEMP_AGE``.
    Each is a whole copy of what was written; a live writer's temp is never among them."""
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    now = time.time()
    found = []
    for entry in entries:
        temp = parse_temp_name(entry.name)
        if temp is None or (target is not None and temp.target != target):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # renamed into place meanwhile
            continue
        if stat.S_ISREG(info.st_mode) and (
            _writer_gone(temp.pid) or now - info.st_mtime > STALE_TEMP_AGE
        ):
            found.append(temp)
    return found


def remove_stale_temps(folder: Path, target: str | None = None) -> int:
    """Delete what ``stale_temps`` finds; returns how many."""
    temps = stale_temps(folder, target)
    for temp in temps:
        (folder / temp_name(*temp)).unlink(missing_ok=True)
    return len(temps)


def write_atomic(path: Path, data: bytes, *, exclusive: bool = False, durable: bool = True) -> bool:
    """Durably write ``path``: temp file, fsync, rename (or link), fsync of the folder.

    With ``exclusive`` an existing file is left alone and False is returned. Used where the
    file is the only copy (the fallback queue) and for in-place front-matter updates.
    ``durable=False`` skips both fsyncs where the database can rebuild the file. A writer
    killed before the rename leaves its temp file: ``stale_temps`` finds it.
    """
    tmp = path.with_name(temp_name(path.name, os.getpid(), threading.get_ident()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    _fill(fd, data, tmp, fsync=durable)
    try:
        if exclusive:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(path.parent)
    return True


# A write(2) of a regular file is cut short by a fatal signal only between pages, so a
# front matter ending within the first page is on disk whole or not at all.
_PAGE = 4096


def overwrite(path: Path | str, head: bytes, body: bytes) -> None:
    """Replace an existing file's bytes with front matter ``head`` (fences included) and
    ``body``, in place: a tenth of the cost of a temporary file renamed over it (18 against
    226 µs here, in a folder of 3,000), which, once per delivered record, bounded the drain.

    For the delivery sync's front-matter updates only: its outcome stays pending in the
    database until this returns, so a writer killed half-way leaves the new front matter
    (whole, see ``_PAGE``) over a wrong body, which the next repair restores from the
    database. A front matter longer than a page goes through ``write_atomic``.
    """
    if len(head) > _PAGE:
        write_atomic(Path(path), head + body, durable=False)
        return
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        _write_from_start(fd, head + body)
    finally:
        os.close(fd)


def _write_from_start(fd: int, data: bytes, size: int | None = None) -> None:
    """``data`` as the whole of the open file ``fd``, written from its first byte; the
    file is cut to it unless its ``size`` is known to be no longer."""
    view = memoryview(data)
    offset = 0
    while offset < len(data):
        offset += os.pwrite(fd, view[offset:], offset)
    if size is None or size > len(data):
        os.ftruncate(fd, len(data))


def _read_all(fd: int) -> bytes:
    """Every byte of the open file ``fd``, with the bare system call (a buffered reader
    cost more than the read itself on a 1 KiB file)."""
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def read(path: Path | str) -> tuple[dict[str, Any], bytes]:
    """A file's (front matter, body); a symlink is refused (ELOOP), never followed, so a
    planted link cannot pull another file's text into the store or its mirrors."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        return parse(_read_all(fd))
    finally:
        os.close(fd)


class Opened:
    """A record's file, read and parsed, held open so the delivery sync rewrites it in place
    through the same descriptor: one open for both (a second open, with its own lookup of
    the name, was a large part of each delivered record's update). A file the owner may
    not write is read all the same; rewriting it fails as ``overwrite`` would.
    """

    def __init__(self, path: Path | str) -> None:
        """Open ``path`` (never through a symlink) and parse it; raises as ``read`` does."""
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            self._writable = True
        except PermissionError:
            self._fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            self._writable = False
        try:
            data = _read_all(self._fd)
            self._size = len(data)
            self.matter, self.body = parse(data)
        except BaseException:
            os.close(self._fd)
            raise

    def overwrite(self, head: bytes, body: bytes) -> None:
        """``overwrite`` on this file, through the open descriptor when it can."""
        if len(head) > _PAGE or not self._writable:
            overwrite(self.path, head, body)
        else:
            _write_from_start(self._fd, head + body, self._size)

    def __enter__(self) -> Opened:
        return self

    def __exit__(self, *_exc: object) -> None:
        os.close(self._fd)


def update_front_matter(
    path: Path, updates: Mapping[str, Any], *, durable: bool = True
) -> dict[str, Any]:
    """Change front-matter keys in place, keeping the body byte for byte."""
    matter, body = read(path)
    matter.update(updates)
    write_atomic(path, render(matter, body), durable=durable)
    return matter
