"""Embedded Chroma in a child process, so a stalled store cannot freeze this one.

chromadb's Rust bindings keep the GIL while a client start, an upsert or a count waits on a
SQLite lock: with another process holding ``BEGIN EXCLUSIVE`` on chroma.sqlite3, every Python
thread of the process stops for the whole hold, the dispatcher's timeout and the caller's own
writes included (measured; only ``get`` lets go). So a child owns the ``PersistentClient``
and this process waits on a ``multiprocessing.connection`` pair (a socketpair only the two
ends hold: nothing to authenticate), whose ``poll`` a timeout can bound.

Used only when ``OUTBOX_CHROMA_MODE=embedded``; by default every process shares one server
(``chroma_service``). The mode stays because the shared server does not cover every case: it
outlives the process that started it, while a single process (a script, a sandbox, the test
suite) may want the folder opened inside it and nothing left running after it exits. There is one
child per store folder per process, shared by every sink on that folder, and a lock file
keeps the children of other processes and the shared server out: two processes writing one
folder corrupt it. A call that times out is not cancelled; the
child finishes it and its answer is read and dropped before the next request.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import IO, Any, NoReturn

import outbox
from outbox.core.errors import OutboxError
from outbox.core.folders import ensure_private_dir
from outbox.core.safe_files import check_folder, open_stream
from outbox.core.states import FailureReason
from outbox.sinks.base import Transient

OWNER_LOCK = "outbox-owner.lock"
OPS = frozenset(
    {"open", "upsert", "query", "query_text", "nearest", "nearest_text", "count", "drop", "delete"}
)
# How a Chroma process refuses a call it does not know (one an older version started).
UNKNOWN_OPERATION = "unknown operation"
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


class _Child:
    """The child process of one store folder, and the one-at-a-time conversation with it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.users = 0
        self.lock = threading.Lock()
        self.process: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.unanswered = 0
        self.starting = False

    def running(self) -> tuple[subprocess.Popen[bytes], Connection]:
        if self.process is not None and self.conn is not None and self.process.poll() is None:
            return self.process, self.conn
        self.forget()
        root = str(Path(outbox.__file__).resolve().parent.parent)
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        ours, theirs = Pipe()
        command = [sys.executable, "-m", "outbox.sinks.chroma_local", str(self.path)]
        try:
            self.process = subprocess.Popen(
                [*command, str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),  # its end, and no other process's
                env={**os.environ, "PYTHONPATH": path},
                start_new_session=True,  # a Ctrl-C meant for us must not kill it mid-write
                umask=0o077,  # Chroma's own files 0600, its folders 0700
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the child's copy is its own: its exit is our end of input
        self.conn = ours
        self.unanswered, self.starting = 1, True  # it says "ready" once chromadb is imported
        return self.process, self.conn

    def forget(self) -> None:
        """Drop a dead child and whatever it left unanswered."""
        if self.process is not None:
            self.stop(0.0)
        self.unanswered, self.starting = 0, False

    def request(self, timeout: float, op: str, args: tuple[Any, ...]) -> Any:
        if not self.lock.acquire(timeout=max(timeout, 0.0)):
            raise ChromaStalled(f"the embedded Chroma at {self.path} is still busy")
        try:
            process, conn = self.running()
            if self.starting:
                self._reply(process, conn, time.monotonic() + _STARTUP)
                self.starting = False
            deadline = time.monotonic() + timeout
            while self.unanswered:  # answers to calls whose caller gave up: drop them
                self._reply(process, conn, deadline)
            try:
                conn.send((op, args))
            except OSError:  # a broken pipe or a reset: it is gone
                self._gone(process)
            self.unanswered += 1
            status, value = self._reply(process, conn, deadline)
        finally:
            self.lock.release()
        if status == "error":
            raise value
        return value

    def _reply(
        self, process: subprocess.Popen[bytes], conn: Connection, deadline: float
    ) -> tuple[str, Any]:
        # The child sends each answer whole, so once the first byte is there recv is quick.
        if not conn.poll(max(deadline - time.monotonic(), 0.0)):
            raise ChromaStalled(f"the embedded Chroma at {self.path} did not answer in time")
        try:
            reply: tuple[str, Any] = conn.recv()
        except (EOFError, OSError):
            self._gone(process)
        self.unanswered -= 1
        return reply

    def _gone(self, process: subprocess.Popen[bytes]) -> NoReturn:
        code = process.poll()
        self.forget()
        raise ChromaChildGone(
            f"the embedded Chroma process for {self.path} exited (code {code}); see its stderr"
        )

    def stop(self, wait: float = _EXIT_WAIT) -> None:
        """End of input lets the child close its client and exit; kill it if it cannot."""
        process, self.process = self.process, None
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()
        if process is None:
            return
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

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """No Chroma on the folder for the block, for work on its files (a forget's purge):
        the child exits and this process holds the owner lock; the next call starts a child."""
        child = self._child
        if child is None:
            raise ChromaChildGone("this Chroma sink is closed")
        if not child.lock.acquire(timeout=self.timeout + _GRACE):
            raise ChromaStalled(f"the embedded Chroma at {child.path} is still busy")
        try:
            child.stop()  # end of input: it closes its client and exits, freeing the lock
            child.unanswered, child.starting = 0, False
            ownership = _Ownership(child.path, os.getpid())
            ownership.ensure()
            try:
                yield
            finally:
                ownership.release()
        finally:
            child.lock.release()

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

    def __init__(self, path: Path, holder: int | None = None) -> None:
        self.path = path / OWNER_LOCK
        self.handle: IO[str] | None = None
        self.holder = holder  # whose pid the file names: the child's parent unless given

    def ensure(self) -> None:
        if self.handle is not None:
            return
        ensure_private_dir(self.path.parent)  # owner-only, as the shared server makes it
        check_folder(self.path.parent, "Chroma folder (OUTBOX_CHROMA_PATH)")
        handle = open_stream(self.path, "Chroma owner lock")
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
        handle.write(f"{self.holder or os.getppid()}\n")
        handle.flush()
        self.handle = handle

    def release(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            handle.close()  # closing the only descriptor lets go of the lock


def portable(exc: Exception) -> Exception:
    """The exception itself when it survives pickling (the sink classifies it by class)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def serve(path: Path, conn: Connection) -> None:
    """Answer ``(op, args)`` requests until the parent closes its end."""
    import chromadb

    from outbox.sinks.chroma_client import CollectionOps

    ownership = _Ownership(path)
    ops: CollectionOps | None = None
    conn.send(_READY)
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            break
        try:
            if op not in OPS:
                raise RuntimeError(f"{UNKNOWN_OPERATION} {op!r}")
            ownership.ensure()
            if ops is None:
                ops = CollectionOps(chromadb.PersistentClient(str(path)))
            reply: tuple[str, Any] = ("ok", getattr(ops, op)(*args))
        except Exception as exc:
            reply = ("error", portable(exc))
        conn.send(reply)
    if ops is not None:
        ops.close()


def main() -> None:
    os.umask(0o077)  # whoever started us: what Chroma writes stays the owner's
    os.dup2(2, 1)  # a stray print from a library lands on stderr, not the parent's output
    conn = Connection(int(sys.argv[2]))
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the parent went away
        serve(Path(sys.argv[1]), conn)


if __name__ == "__main__":
    from outbox.sinks import chroma_local  # the imported module, so pickled errors name it

    chroma_local.main()
