"""Embedded Chroma in a child process, so a stalled store cannot freeze this one.

chromadb's Rust bindings keep the GIL while a client start, an upsert or a count waits on a
SQLite lock: with another process holding ``BEGIN EXCLUSIVE`` on chroma.sqlite3, every Python
thread of the process stops for the whole hold, the dispatcher's timeout and the caller's own
writes included (measured; only ``get`` lets go). So a child owns the ``PersistentClient``
and this process waits on a pipe, which a timeout can bound.

Used only when ``OUTBOX_CHROMA_MODE=embedded``; by default every process shares one server
(``chroma_service``). There is one child per store folder per process, shared by every sink on
that folder, and a lock file keeps the children of other processes and the shared server out:
two processes writing one folder corrupt it (docs/research/chroma.md). A call that times out
is not cancelled; the child finishes it and its answer is read and dropped before the next
request.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import outbox
from outbox.core.errors import OutboxError
from outbox.core.states import FailureReason
from outbox.sinks.base import Transient

OWNER_LOCK = "outbox-owner.lock"
OPS = frozenset({"open", "upsert", "query", "count", "drop", "delete"})
_HEADER = struct.Struct("!Q")
# The sink's own bound comes a little after the dispatcher's, which normally fires first.
_GRACE = 1.0
# Starting a child (Python, then chromadb's import) may take seconds on a busy machine; it is
# not the store's fault, so it has its own bound instead of eating the call's.
_STARTUP = 60.0
_EXIT_WAIT = 5.0
_READY = ("ok", "ready")


class ChromaStalled(TimeoutError):
    """The embedded Chroma did not answer in time (a lock held elsewhere, a slow disk): a
    TimeoutError, so the record is retried as a ``timeout``."""


class ChromaChildGone(OutboxError):
    """The embedded Chroma process exited; the next call starts a new one (meanwhile the
    record is retried as ``unknown``)."""


class StoreOwned(Transient, OutboxError):
    """Another process has the store folder open: a busy database, retried until it closes."""

    def __init__(self, message: str) -> None:
        super().__init__(message, FailureReason.DB_BUSY)


def _frame(value: object) -> bytes:
    body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


class _Child:
    """The child process of one store folder, and the one-at-a-time conversation with it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.users = 0
        self.lock = threading.Lock()
        self.process: subprocess.Popen[bytes] | None = None
        self.buffer = bytearray()
        self.unanswered = 0
        self.starting = False

    def running(self) -> subprocess.Popen[bytes]:
        if self.process is not None and self.process.poll() is None:
            return self.process
        self.forget()
        root = str(Path(outbox.__file__).resolve().parent.parent)
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "outbox.sinks.chroma_local", str(self.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            env={**os.environ, "PYTHONPATH": path},
            start_new_session=True,  # a Ctrl-C meant for us must not kill it mid-write
        )
        self.unanswered, self.starting = 1, True  # it says "ready" once chromadb is imported
        return self.process

    def forget(self) -> None:
        """Drop a dead child and whatever it left half-said."""
        if self.process is not None:
            self.stop(0.0)
        self.buffer.clear()
        self.unanswered, self.starting = 0, False

    def request(self, timeout: float, op: str, args: tuple[Any, ...]) -> Any:
        if not self.lock.acquire(timeout=max(timeout, 0.0)):
            raise ChromaStalled(f"the embedded Chroma at {self.path} is still busy")
        try:
            process = self.running()
            if self.starting:
                self._reply(process, time.monotonic() + _STARTUP)
                self.starting = False
            deadline = time.monotonic() + timeout
            while self.unanswered:  # answers to calls whose caller gave up: drop them
                self._reply(process, deadline)
            self._send(process, _frame((op, args)))
            status, value = self._reply(process, deadline)
        finally:
            self.lock.release()
        if status == "error":
            raise value
        return value

    def _send(self, process: subprocess.Popen[bytes], data: bytes) -> None:
        assert process.stdin is not None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(process.stdin.fileno(), view) :]
        except BrokenPipeError:
            self._gone(process)
        self.unanswered += 1

    def _reply(self, process: subprocess.Popen[bytes], deadline: float) -> tuple[str, Any]:
        assert process.stdout is not None
        fd = process.stdout.fileno()
        while True:
            if len(self.buffer) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self.buffer)
                end = _HEADER.size + size
                if len(self.buffer) >= end:
                    body = bytes(self.buffer[_HEADER.size : end])
                    del self.buffer[:end]
                    self.unanswered -= 1
                    reply: tuple[str, Any] = pickle.loads(body)
                    return reply
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ChromaStalled(f"the embedded Chroma at {self.path} did not answer in time")
            if select.select([fd], [], [], remaining)[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    self._gone(process)
                self.buffer += chunk

    def _gone(self, process: subprocess.Popen[bytes]) -> None:
        code = process.poll()
        self.forget()
        raise ChromaChildGone(
            f"the embedded Chroma process for {self.path} exited (code {code}); see its stderr"
        )

    def stop(self, wait: float = _EXIT_WAIT) -> None:
        """End of input lets the child close its client and exit; kill it if it cannot."""
        process, self.process = self.process, None
        if process is None:
            return
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            process.kill()  # most likely waiting on a lock; SQLite undoes a half-done write
            process.wait()


_children: dict[Path, _Child] = {}
_registry = threading.Lock()


class LocalBackend:
    """``ChromaSink``'s backend for an embedded store: each call runs in the folder's child."""

    def __init__(self, path: Path, timeout: float) -> None:
        key = Path(path).resolve()
        with _registry:
            child = _children.setdefault(key, _Child(key))
            child.users += 1
            if child.lock.acquire(blocking=False):  # else a call is under way: it is running
                try:
                    child.running()  # start now: it imports chromadb while we load the model
                finally:
                    child.lock.release()
        self._child: _Child | None = child
        self.timeout = timeout

    def call(self, op: str, *args: Any) -> Any:
        if self._child is None:
            raise ChromaChildGone("this Chroma sink is closed")
        return self._child.request(self.timeout + _GRACE, op, args)

    def close(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        with _registry:  # a new sink on this folder waits until the old child is gone
            child.users -= 1
            if child.users == 0:
                del _children[child.path]
                with child.lock:
                    child.stop()


# -- the child ----------------------------------------------------------------------------


class _Ownership:
    """An exclusive ``flock`` on a file in the store folder, held for the child's life."""

    def __init__(self, path: Path) -> None:
        self.path = path / OWNER_LOCK
        self.handle: IO[str] | None = None

    def ensure(self) -> None:
        if self.handle is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise StoreOwned(
                f"another writer is using the embedded Chroma at {self.path.parent} "
                f"(process {holder}); leave OUTBOX_CHROMA_MODE unset (a shared server) in "
                "every process using it, or set OUTBOX_CHROMA_URL"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getppid()}\n")
        handle.flush()
        self.handle = handle


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    data = stream.read(size)
    return data if data is not None and len(data) == size else None


def _portable(exc: Exception) -> Exception:
    """The exception itself when it survives pickling (the sink classifies it by class)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def serve(path: Path, requests: IO[bytes], replies: IO[bytes]) -> None:
    """Answer framed ``(op, args)`` requests until the parent closes our input."""
    import chromadb

    from outbox.sinks.chroma_client import CollectionOps

    ownership = _Ownership(path)
    ops: CollectionOps | None = None
    replies.write(_frame(_READY))
    replies.flush()
    while (header := _read_exactly(requests, _HEADER.size)) is not None:
        body = _read_exactly(requests, _HEADER.unpack(header)[0])
        if body is None:
            break
        op, args = pickle.loads(body)
        try:
            if op not in OPS:
                raise RuntimeError(f"unknown operation {op!r}")
            ownership.ensure()
            if ops is None:
                ops = CollectionOps(chromadb.PersistentClient(str(path)))
            reply: tuple[str, Any] = ("ok", getattr(ops, op)(*args))
        except Exception as exc:
            reply = ("error", _portable(exc))
        replies.write(_frame(reply))
        replies.flush()
    if ops is not None:
        ops.close()


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print from a library lands on stderr, not in the replies
    with contextlib.suppress(BrokenPipeError):  # the parent went away mid-reply
        serve(Path(sys.argv[1]), sys.stdin.buffer, replies)


if __name__ == "__main__":
    from outbox.sinks import chroma_local  # the imported module, so pickled errors name it

    chroma_local.main()
