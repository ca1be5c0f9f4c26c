"""The detached process that serves a store folder's shared Chroma, to its owner alone.

Started by ``chroma_service`` in a session of its own, so it outlives the process that
started it. It takes the store's owner lock, opens the folder with chromadb's embedded client
(the only process that does), and answers ``CollectionOps`` calls on a Unix socket in the
folder; each connection first passes the mutual key challenge of ``chroma_service``. Its umask
is 077, so Chroma's own files come out 0600 and its folders 0700. It stops when sent SIGTERM
or when no process has used it for the idle time (0: never).

Usage: ``python -m outbox.sinks.chroma_supervisor FOLDER IDLE_SECONDS``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import stat
import sys
import threading
import time
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

from outbox.core.errors import OutboxError
from outbox.core.safe_files import open_stream
from outbox.sinks.chroma_local import OPS, OWNER_LOCK, UNKNOWN_OPERATION, portable
from outbox.sinks.chroma_service import (
    HANDSHAKE,
    SOCKET,
    START_LOCK,
    USERS_LOCK,
    ServerState,
    bounded,
    private_folder,
    prove_server,
    remove_state,
    server_key,
    socket_address,
    try_flock,
    write_state,
)

_TICK = 1.0
_OWNER_WAIT = 5.0  # a client may be probing the owner lock at this very moment


def say(message: str) -> None:
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    print(f"{stamp} outbox chroma supervisor {os.getpid()}: {message}", flush=True)


def take_owner(folder: Path) -> IO[str] | None:
    handle = open_stream(folder / OWNER_LOCK, "Chroma owner lock")
    deadline = time.monotonic() + _OWNER_WAIT
    while not try_flock(handle, fcntl.LOCK_EX):
        if time.monotonic() > deadline:
            handle.seek(0)
            say(f"{folder} is already owned by process {handle.read().strip() or 'unknown'}")
            handle.close()
            return None
        time.sleep(0.05)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()} shared chroma server\n")
    handle.flush()
    return handle


def listen(folder: Path) -> socket.socket:
    """The folder's socket; a stale one of ours is replaced (we hold the owner lock, so no
    live server uses it), anything else at that name is refused."""
    path = folder / SOCKET
    with contextlib.suppress(FileNotFoundError):
        info = os.lstat(path)
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
            raise OutboxError(f"{path} is not a socket of this user; remove it")
        path.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with socket_address(path) as address:
        server.bind(address)  # 0700 under our umask, in a 0700 folder
    server.listen(16)
    return server


class Service:
    """The embedded store and the calls made on it, one at a time (the store is one writer)."""

    def __init__(self, folder: Path) -> None:
        import chromadb

        from outbox.sinks.chroma_client import CollectionOps

        self.ops = CollectionOps(chromadb.PersistentClient(str(folder)))
        self.lock = threading.Lock()

    def answer(self, op: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        if op == "ping":
            return "ok", os.getpid()
        try:
            if op not in OPS:
                raise RuntimeError(f"{UNKNOWN_OPERATION} {op!r}")
            with self.lock:
                return "ok", getattr(self.ops, op)(*args)
        except Exception as exc:
            return "error", portable(exc)

    def converse(self, sock: socket.socket, key: bytes) -> None:
        """One client: the handshake (bounded: a silent peer is dropped), then its calls,
        which may wait on the store as long as they need."""
        with sock, Connection(os.dup(sock.fileno())) as conn:
            bounded(sock, HANDSHAKE)
            try:
                prove_server(conn, key)
            except (OSError, EOFError, ConnectionError):
                return  # not ours; nothing of the store was read or sent
            bounded(sock, 0)
            with contextlib.suppress(OSError, EOFError):
                while True:
                    op, args = conn.recv()
                    conn.send(self.answer(op, args))


def accept(server: socket.socket, service: Service, key: bytes) -> None:
    while True:
        try:
            sock, _address = server.accept()
        except OSError:
            return  # closed: we are stopping
        threading.Thread(target=service.converse, args=(sock, key), daemon=True).start()


def idle_stop(folder: Path, users: IO[str]) -> bool:
    """Whether nobody uses the server and no process is starting one; on True both locks
    stay held until we exit, so a newcomer waits for us and then starts a fresh server."""
    start = open_stream(folder / START_LOCK, "Chroma server's start lock")
    if not try_flock(start, fcntl.LOCK_EX):
        start.close()
        return False
    if not try_flock(users, fcntl.LOCK_EX):
        start.close()
        return False
    _held.append(start)
    return True


_held: list[IO[str]] = []


def unused(users: IO[str]) -> bool:
    if not try_flock(users, fcntl.LOCK_EX):
        return False
    fcntl.flock(users, fcntl.LOCK_UN)
    return True


def watch(folder: Path, idle: float, stop: threading.Event) -> str:
    """Wait until there is a reason to stop, and say which."""
    users = open_stream(folder / USERS_LOCK, "Chroma users lock")
    _held.append(users)
    idle_since: float | None = None
    while not stop.wait(_TICK):
        if idle <= 0 or not unused(users):
            idle_since = None
            continue
        idle_since = idle_since or time.monotonic()
        if time.monotonic() - idle_since >= idle and idle_stop(folder, users):
            return f"no process used it for {idle:g} s (OUTBOX_CHROMA_IDLE)"
    return "asked to stop"


def main(argv: list[str]) -> int:
    os.umask(0o077)
    folder, idle = Path(argv[0]), float(argv[1])
    try:
        private_folder(folder)
        owner = take_owner(folder)
        if owner is None:
            return 1
        key = server_key(folder)
        service = Service(folder)
        server = listen(folder)
    except OutboxError as exc:
        say(f"not started: {exc}")
        return 1
    stop = threading.Event()

    def on_signal(_number: int, _frame: Any) -> None:
        stop.set()

    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, on_signal)
    threading.Thread(target=accept, args=(server, service, key), daemon=True).start()
    write_state(folder, ServerState(os.getpid()))
    say(f"serves {folder} on {folder / SOCKET} (owner only)")
    reason = "stopped"
    try:
        reason = watch(folder, idle, stop)
    finally:
        remove_state(folder, os.getpid())
        server.close()
        with contextlib.suppress(FileNotFoundError):
            (folder / SOCKET).unlink()
        with service.lock:  # let a call under way finish, then close the store
            service.ops.close()
        say(f"stopped: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
