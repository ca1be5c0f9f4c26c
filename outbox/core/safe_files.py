"""Opening the store's own files without trusting what was there before.

A symlink planted where the log, the lock, the database or a markdown file should be would
make the library write memories into, or truncate, a file elsewhere; a file or folder that
another user owns or can write lets that user read or change memories. Both are refused with
an error naming the path, before anything is written.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO, TYPE_CHECKING

from outbox.core.errors import OutboxError

if TYPE_CHECKING:
    from outbox.core.config import Settings

# Group or others may write: whoever they are could read or change what is stored.
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafeFile(OutboxError):
    """A store file or folder that is a symlink, not ours, or writable by others."""


def check_owned(path: Path, info: os.stat_result, what: str) -> None:
    """Refuse ``path`` unless this user owns it and nobody else may write it."""
    if info.st_uid != os.geteuid():
        raise UnsafeFile(f"{what} {path} belongs to user id {info.st_uid}, not to this user")
    if info.st_mode & _SHARED_WRITE:
        raise UnsafeFile(
            f"{what} {path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}); "
            "make it owner-only (chmod go-w)"
        )


def check_folder(path: Path, what: str = "folder") -> None:
    """A folder of the store, if it exists: ours and not writable by others (a symlink to
    such a folder is fine: the folder is what counts)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    check_owned(path, info, what)


def open_file(path: Path | str, flags: int, mode: int = 0o600, what: str = "file") -> int:
    """``os.open`` that never follows a symlink and refuses a file that is not ours alone."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(
                f"{what} {path} is a symbolic link; the store never follows one"
            ) from None
        raise
    try:
        check_owned(Path(path), os.fstat(fd), what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_file(path: Path, what: str) -> None:
    """A store file that something else opens (SQLite opens the database itself): refused
    if it is a symlink or not ours alone; fine if it does not exist yet."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeFile(f"{what} {path} is a symbolic link; the store never follows one")
    check_owned(path, info, what)


def check_store(settings: Settings, database: Path | None) -> None:
    """Every file and folder of a store that exists already, before the store is opened
    (``database``: the SQLite file, None on a server)."""
    check_folder(settings.home, "OUTBOX_HOME")
    check_folder(settings.markdown_dir, "markdown folder (OUTBOX_MARKDOWN_DIR)")
    check_folder(settings.jsonl_path.parent, "folder of the JSONL log")
    check_file(settings.jsonl_path, "JSONL log (OUTBOX_JSONL_PATH)")
    check_file(settings.jsonl_path.with_name(settings.jsonl_path.name + ".lock"), "mirror lock")
    if database is not None:
        for suffix in ("", "-wal", "-shm", "-journal"):
            check_file(database.with_name(database.name + suffix), "database file")


def open_stream(path: Path, what: str, mode: str = "a+") -> IO[str]:
    """A text file object over ``open_file`` (append and read, created 0600): for the lock
    files whose handles ``flock`` holds."""
    flags = os.O_RDWR | os.O_CREAT | os.O_APPEND
    return os.fdopen(open_file(path, flags, 0o600, what), mode, encoding="utf-8")


def check_unshared(path: Path, fd: int, what: str) -> None:
    """Refuse a secret file that group or others may read: a key they could copy is no key."""
    info = os.fstat(fd)
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UnsafeFile(
            f"{what} {path} is readable by other users (mode {stat.S_IMODE(info.st_mode):o}); "
            "make it owner-only (chmod 600)"
        )
