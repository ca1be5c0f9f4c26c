"""One shared Chroma server per store folder, started by whichever process needs it, and
reachable by its owner alone.

An embedded Chroma folder may be open in one process only (two writers corrupt it), so when
``OUTBOX_CHROMA_URL`` is unset every process on the machine talks to one server process for
the folder: the first that needs it starts it detached (``chroma_supervisor``), the others find
it at a fixed Unix socket in the folder. It lives on when its starter dies.

Why not ``chroma run``: chromadb 1.5.9's ``chroma run`` (Chroma CLI 1.4.4) serves HTTP on a
TCP port with no authentication at all (it passes the no-op ``()`` authenticator to its
frontend), and any local user can connect to a loopback port; so another user could list,
read and delete every memory. Instead the supervisor opens the folder itself with chromadb's
embedded client and answers the sink's calls (``CollectionOps``) over a Unix socket in the
owner-only (0700) folder: no TCP port exists, the filesystem keeps other users from the
socket, and each connection starts with a mutual challenge on a per-folder key, so a client
sends nothing until the server has proved it holds the key, and the server runs nothing for a
client that has not. The address is never read from a file another process could write.

Files in the store folder (all 0600, the folder 0700; a symlink at any of these names, or a
folder or file another user owns or may write, is refused before anything is written):

* ``outbox-server.key``: the folder's secret, made once by the first starter;
* ``outbox-server.sock``: the server's socket;
* ``outbox-server.json``: the server's process id, replaced atomically;
* ``outbox-server.log``: the supervisor's lines;
* ``outbox-start.lock``: one process at a time checks, starts or restarts the server (taken
  with ``core/file_lock``; the supervisor holds it with a plain flock while it stops idle);
* ``outbox-owner.lock``: flock held by the server for its whole life (an embedded child takes
  the same one, so the two modes never open one folder together);
* ``outbox-users.lock``: a shared flock per process using the server; with none left for
  ``OUTBOX_CHROMA_IDLE`` the server stops.

Nothing here imports chromadb; its exceptions arrive pickled from the server.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO, Any

import outbox
from outbox.core.errors import OutboxError
from outbox.core.file_lock import exclusive
from outbox.core.folders import ensure_private_dir
from outbox.core.safe_files import (
    UnsafeFile,
    check_file,
    check_folder,
    check_unshared,
    open_file,
    open_stream,
)
from outbox.core.states import FailureReason
from outbox.sinks.base import Transient
from outbox.sinks.chroma_client import chroma_failure
from outbox.sinks.chroma_local import OWNER_LOCK, ChromaStalled

log = logging.getLogger(__name__)

STATE = "outbox-server.json"
LOG = "outbox-server.log"
START_LOCK = "outbox-start.lock"
USERS_LOCK = "outbox-users.lock"
SOCKET = "outbox-server.sock"
KEY = "outbox-server.key"
# How long a new server may take to answer its first ping (Python start, then chromadb's
# import and the store's opening, on a busy machine), and how long a live one may stay silent
# before it is stopped.
STARTUP = 60.0
HANDSHAKE = 10.0
_TRIES = 3
_POLL = 0.1
_LOG_LIMIT = 8 << 20
_FILES = {
    OWNER_LOCK: "Chroma owner lock",
    USERS_LOCK: "Chroma users lock",
    START_LOCK: "Chroma server's start lock",
    LOG: "Chroma server log",
    LOG + ".1": "old Chroma server log",
    STATE: "Chroma server state file",
    KEY: "Chroma server key",
    SOCKET: "Chroma server socket",
}
_GREETING = b"outbox-chroma-1"
_NONCE = 32


class ChromaServerDown(Transient, OutboxError):
    """The shared Chroma server could not be started or reached; retried as a lost
    connection, never as a busy database."""

    def __init__(self, message: str) -> None:
        super().__init__(message, FailureReason.TRANSPORT_CLOSED)


class ImpostorServer(ChromaServerDown):
    """Something answers at the folder's socket but cannot prove it holds the folder's key;
    nothing was sent to it."""


@dataclass(frozen=True)
class ServerState:
    """What ``outbox-server.json`` says: the supervisor's process id (it has the store open).
    It names no address: the socket's place is fixed by the folder."""

    pid: int


def private_folder(folder: Path) -> None:
    """The Chroma folder: created 0700 (parents too) if missing; refused if another user
    owns it or may write it, or if a link or someone else's file sits at a name we open (so
    the refusal is one line here, not a server that failed to start)."""
    ensure_private_dir(folder)
    check_folder(folder, "Chroma folder (OUTBOX_CHROMA_PATH)")
    for name, what in _FILES.items():
        check_file(folder / name, what)


def server_key(folder: Path, create: bool = False) -> bytes:
    """The folder's secret (``create``: made now if missing, 0600, never through a link)."""
    path = folder / KEY
    try:
        fd = open_file(path, os.O_RDONLY, what="Chroma server key")
    except FileNotFoundError:
        if not create:
            raise ChromaServerDown(f"no Chroma server key in {folder}") from None
        with contextlib.suppress(FileExistsError):  # another starter made it first
            fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what="Chroma server key")
            with os.fdopen(fd, "wb") as out:
                out.write(secrets.token_bytes(_NONCE))
        fd = open_file(path, os.O_RDONLY, what="Chroma server key")
    with os.fdopen(fd, "rb") as handle:
        check_unshared(path, handle.fileno(), "Chroma server key")
        key = handle.read(4 * _NONCE)
    if len(key) < _NONCE:
        raise UnsafeFile(f"Chroma server key {path} is too short; remove it to make a new one")
    return key


def _proof(key: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, side + first + second, hashlib.sha256).digest()


def prove_server(conn: Connection, key: bytes) -> None:
    """The server's half of the handshake: prove the key, then check the client's proof."""
    greeting = conn.recv_bytes(len(_GREETING) + _NONCE)
    if not greeting.startswith(_GREETING) or len(greeting) != len(_GREETING) + _NONCE:
        raise ConnectionError("not an outbox client")
    theirs, ours = greeting[len(_GREETING) :], secrets.token_bytes(_NONCE)
    conn.send_bytes(ours + _proof(key, b"server", theirs, ours))
    if not hmac.compare_digest(conn.recv_bytes(64), _proof(key, b"client", ours, theirs)):
        raise ConnectionError("the client does not hold the key")
    conn.send_bytes(b"ok")


def prove_client(conn: Connection, key: bytes, where: Path) -> None:
    """The client's half: nothing but nonces and proofs is sent until the server proved it
    holds the key (an impostor learns no document)."""
    ours = secrets.token_bytes(_NONCE)
    conn.send_bytes(_GREETING + ours)
    answer = conn.recv_bytes(2 * _NONCE)
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if len(theirs) != _NONCE or not hmac.compare_digest(
        proof, _proof(key, b"server", ours, theirs)
    ):
        raise ImpostorServer(
            f"the process at {where} could not prove it is this store's Chroma server; "
            "nothing was sent to it"
        )
    conn.send_bytes(_proof(key, b"client", theirs, ours))
    if conn.recv_bytes(8) != b"ok":
        raise ImpostorServer(f"the Chroma server at {where} refused this client's key")


def bounded(sock: socket.socket, timeout: float) -> None:
    """Blocking I/O that gives up after ``timeout`` (a frozen peer becomes an error)."""
    whole = int(timeout)
    value = struct.pack("ll", whole, int((timeout - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


# A Unix socket's path must fit ``sun_path`` (108 bytes on Linux, the NUL included). A store
# in a deep folder has a longer one; it is then reached through a descriptor of its folder,
# which /proc names in a few bytes, so the socket stays in the owner-only folder.
_SUN_PATH = 107


@contextlib.contextmanager
def socket_address(path: Path) -> Iterator[str]:
    """The address to bind or connect ``path`` by: the path itself when it fits, else the
    same file through a descriptor of its folder (``/proc/self/fd/N/name``)."""
    if len(os.fsencode(str(path))) <= _SUN_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def connect(folder: Path, timeout: float) -> Connection:
    """An authenticated connection to the folder's server; ChromaServerDown if none answers."""
    path = folder / SOCKET
    check_file(path, "Chroma server socket")
    key = server_key(folder)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        bounded(sock, timeout)
        with socket_address(path) as address:
            sock.connect(address)
    except OSError as exc:
        sock.close()
        raise ChromaServerDown(f"no Chroma server answers at {path} ({exc.strerror})") from None
    conn = Connection(sock.detach())
    try:
        prove_client(conn, key, path)
    except (OSError, EOFError) as exc:
        conn.close()
        raise ChromaServerDown(
            f"the Chroma server at {path} did not finish the handshake ({type(exc).__name__})"
        ) from None
    except BaseException:
        conn.close()
        raise
    return conn


def read_state(folder: Path) -> ServerState | None:
    try:
        fd = open_file(folder / STATE, os.O_RDONLY, what="Chroma server state file")
    except FileNotFoundError:
        return None
    try:
        with os.fdopen(fd, encoding="utf-8") as handle:
            return ServerState(int(json.load(handle)["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_state(folder: Path, state: ServerState) -> None:
    """Write-then-rename, so a reader sees the old file or the new one, never half of one;
    the temporary file is made new (a link or file planted at its name is refused)."""
    temporary = folder / f".{STATE}.{os.getpid()}"
    check_file(temporary, "Chroma server state file")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)  # our own, left by a process of ours that died with this pid
    fd = open_file(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, what="Chroma server state")
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(asdict(state), out)
    os.replace(temporary, folder / STATE)


def remove_state(folder: Path, pid: int | None = None) -> None:
    """Remove the state file (only if it names ``pid``, when given)."""
    state = read_state(folder)
    if pid is None or (state is not None and state.pid == pid):
        with contextlib.suppress(FileNotFoundError):
            (folder / STATE).unlink()


def try_flock(handle: IO[Any], mode: int) -> bool:
    try:
        fcntl.flock(handle, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def wait_flock(handle: IO[Any], mode: int, timeout: float, what: str) -> None:
    """flock with a bound: a holder that never lets go becomes an error naming the file."""
    deadline = time.monotonic() + timeout
    while not try_flock(handle, mode):
        if time.monotonic() > deadline:
            raise ChromaServerDown(f"{what} stayed locked for {timeout:g} s: {handle.name}")
        time.sleep(0.05)


def owner_of(folder: Path) -> str | None:
    """Who holds the store's owner lock (its file's text), or None when nobody does."""
    with open_stream(folder / OWNER_LOCK, "Chroma owner lock") as handle:
        if try_flock(handle, fcntl.LOCK_EX):
            fcntl.flock(handle, fcntl.LOCK_UN)
            return None
        handle.seek(0)
        return handle.read().strip() or "unknown"


def answers(folder: Path, state: ServerState, timeout: float = 2.0) -> bool:
    """Whether the server named by ``state`` answers at the folder's socket and proves it
    holds the key (a pid alone may be reused, a socket taken over)."""
    try:
        conn = connect(folder, timeout)
    except ChromaServerDown:
        return False
    with conn:
        try:
            conn.send(("ping", ()))
            if not conn.poll(timeout):
                return False
            status, pid = conn.recv()
        except (OSError, EOFError, ValueError):
            return False
    return bool(status == "ok" and pid == state.pid)


_started: list[subprocess.Popen[bytes]] = []


class SharedServer:
    """One store folder's shared server, as a process that wants to use it sees it."""

    def __init__(
        self, folder: Path, idle: float, wanted: Callable[[], bool] = lambda: True
    ) -> None:
        self.folder = Path(folder).resolve()
        self.idle = idle
        self.wanted = wanted  # asked before starting one: a closed sink must not
        self.log_path = self.folder / LOG

    def endpoint(self) -> ServerState:
        """A running server that proved it holds the key: found, or started (once, under the
        start lock)."""
        private_folder(self.folder)
        state = read_state(self.folder)
        if state is not None and answers(self.folder, state) and owner_of(self.folder):
            return state
        with self._start_lock():
            server_key(self.folder, create=True)
            return self._start_or_wait()

    def _start_lock(self) -> contextlib.AbstractContextManager[None]:
        """The start lock: one process at a time starts (or stops) the folder's server."""
        lock, bound = self.folder / START_LOCK, 2 * STARTUP + 30
        return exclusive(
            lock,
            "Chroma server's start lock",
            lambda: ChromaServerDown(
                f"the Chroma server's start lock stayed locked for {bound:g} s: {lock}"
            ),
            wait=bound,
        )

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """No Chroma on the folder for the block, for work on its files (a forget's purge):
        the server is stopped, the start lock keeps a new one from starting and the owner
        lock an embedded one; the next call after the block starts a fresh server."""
        with self._start_lock():
            state, owner = read_state(self.folder), owner_of(self.folder)
            if state is not None and owner is not None and owner.split()[0] == str(state.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(state.pid, signal.SIGTERM)
            with open_stream(self.folder / OWNER_LOCK, "Chroma owner lock") as handle:
                wait_flock(handle, fcntl.LOCK_EX, STARTUP, "the Chroma store's owner lock")
                handle.seek(0)
                handle.truncate()
                handle.write(f"{os.getpid()} chroma purge\n")
                handle.flush()
                yield

    def _start_or_wait(self) -> ServerState:
        child: subprocess.Popen[bytes] | None = None
        tries, stopped = 0, False
        deadline = time.monotonic() + STARTUP
        while True:
            state = read_state(self.folder)
            owner = owner_of(self.folder)
            if state is not None and owner and answers(self.folder, state):
                return state
            if child is not None and child.poll() is not None:  # it gave up; see the log
                child = None
            if child is None and owner is None:
                if not self.wanted():
                    raise ChromaServerDown(f"closed: no new Chroma server for {self.folder}")
                if tries == _TRIES:
                    raise ChromaServerDown(
                        f"the Chroma server for {self.folder} did not start ({tries} tries); "
                        f"see {self.log_path}"
                    )
                remove_state(self.folder)
                child, tries = self._spawn(), tries + 1
                deadline = time.monotonic() + STARTUP
            elif time.monotonic() > deadline:
                if child is None and not stopped and self._stop_stuck(state, owner):
                    stopped, deadline = True, time.monotonic() + STARTUP
                    continue
                raise self._down(owner)
            time.sleep(_POLL)

    def _stop_stuck(self, state: ServerState | None, owner: str | None) -> bool:
        """Stop a server that holds the store but has not answered for a whole startup
        bound, so that a new one can start; only one the state file and the lock agree on."""
        if state is None or owner is None or owner.split()[0] != str(state.pid):
            return False
        log.warning(
            "the Chroma server for %s (process %d) stopped answering; stopping it (log: %s)",
            self.folder,
            state.pid,
            self.log_path,
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.pid, signal.SIGTERM)
        return True

    def _down(self, owner: str | None) -> ChromaServerDown:
        if owner is not None and "server" not in owner:
            return ChromaServerDown(
                f"an embedded Chroma (process {owner}) has {self.folder} open; set the same "
                "OUTBOX_CHROMA_MODE (server, the default) in every process using it"
            )
        return ChromaServerDown(
            f"the Chroma server for {self.folder} (process {owner}) did not answer within "
            f"{STARTUP:g} s; see {self.log_path}"
        )

    def _log_file(self) -> int:
        """The log, appended to (0600, never through a link); moved aside when large."""
        with contextlib.suppress(OSError):
            info = os.lstat(self.log_path)
            if stat.S_ISREG(info.st_mode) and info.st_size > _LOG_LIMIT:
                os.replace(self.log_path, self.log_path.with_name(LOG + ".1"))
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        return open_file(self.log_path, flags, what="Chroma server log")

    def _spawn(self) -> subprocess.Popen[bytes]:
        """Start the supervisor in its own session (no signal meant for us reaches it), with
        an owner-only umask, so every file Chroma makes is 0600 and every folder 0700."""
        for child in [c for c in _started if c.poll() is not None]:
            _started.remove(child)
        root = str(Path(outbox.__file__).resolve().parent.parent)
        command = [sys.executable, "-m", "outbox.sinks.chroma_supervisor", str(self.folder)]
        command.append(repr(self.idle))
        env = dict(os.environ, ANONYMIZED_TELEMETRY="False")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        log.info("starting a shared Chroma server for %s (log: %s)", self.folder, self.log_path)
        out = self._log_file()
        try:
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(self.folder),
                env=env,
                start_new_session=True,
                umask=0o077,
            )
        finally:
            os.close(out)
        _started.append(child)  # kept so it is reaped if it exits while we live
        return child


class _Users:
    """This process's shared hold on a store's users lock, one per folder for every sink."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: dict[Path, tuple[IO[str], int]] = {}

    def acquire(self, folder: Path) -> None:
        with self.lock:
            handle, count = self.held.get(folder, (None, 0))
            if handle is None:
                private_folder(folder)
                handle = open_stream(folder / USERS_LOCK, "Chroma users lock")
                try:  # held exclusively only while an idle server shuts down
                    wait_flock(handle, fcntl.LOCK_SH, STARTUP, "the Chroma server's users lock")
                except BaseException:
                    handle.close()
                    raise
            self.held[folder] = (handle, count + 1)

    def release(self, folder: Path) -> None:
        with self.lock:
            handle, count = self.held.pop(folder)
            if count > 1:
                self.held[folder] = (handle, count - 1)
            else:
                handle.close()


USERS = _Users()


class SocketBackend:
    """The calls of ``CollectionOps``, sent to the folder's server over one authenticated
    connection; a call that outlives ``timeout`` drops the connection (its late answer with
    it) and raises ``ChromaStalled``."""

    def __init__(self, folder: Path, timeout: float) -> None:
        self.folder, self.timeout = folder, timeout
        self._lock = threading.Lock()
        self._conn: Connection | None = None

    def call(self, op: str, *args: Any) -> Any:
        with self._lock:
            if self._conn is None:
                self._conn = connect(self.folder, self.timeout)
            conn = self._conn
            try:
                conn.send((op, args))
                if not conn.poll(self.timeout):
                    self._drop()
                    raise ChromaStalled(f"the Chroma server for {self.folder} did not answer")
                status, value = conn.recv()
            except (OSError, EOFError) as exc:
                self._drop()
                if isinstance(exc, OSError) and exc.errno in (errno.EAGAIN, errno.ETIMEDOUT):
                    raise ChromaStalled(f"the Chroma server for {self.folder} stalled") from None
                raise ChromaServerDown(f"the Chroma server for {self.folder} went away") from None
        if status == "error":
            raise value
        return value

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._drop()


def _server_gone(exc: BaseException) -> bool:
    if isinstance(exc, ChromaServerDown):
        return not isinstance(exc, ImpostorServer)
    failure = chroma_failure(exc)
    return isinstance(failure, Transient) and failure.reason is FailureReason.TRANSPORT_CLOSED


class SharedBackend:
    """``ChromaSink``'s backend for the shared server: found or started on the first call, and
    again after it went away (the call is then made once more: upsert, query, count and open
    may all be repeated safely)."""

    # The server keeps a built-in embedder loaded and embeds query texts (``query_text``).
    embeds_queries = True

    def __init__(self, folder: Path, timeout: float, idle: float) -> None:
        self.server = SharedServer(folder, idle, wanted=lambda: not self._closed)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._inner: SocketBackend | None = None
        self._using = False
        self._closed = False

    def _connected(self) -> SocketBackend:
        with self._lock:
            if self._closed:
                raise ChromaServerDown("this Chroma sink is closed")
            if self._inner is None:
                if not self._using:  # before the server is found: it cannot stop under us
                    USERS.acquire(self.server.folder)
                    self._using = True
                self.server.endpoint()
                self._inner = SocketBackend(self.server.folder, self.timeout)
            return self._inner

    def _forget(self, inner: SocketBackend) -> None:
        with self._lock:
            if self._inner is inner:
                self._inner = None
        inner.close()

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """The shared server stopped for the block (``SharedServer.stopped``); this
        backend's connection is dropped first, and the next call finds the new server."""
        with self._lock:
            inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()
        with self.server.stopped():
            yield

    def call(self, op: str, *args: Any) -> Any:
        inner = self._connected()
        try:
            return inner.call(op, *args)
        except Exception as exc:
            if not _server_gone(exc):
                raise
            log.info("the Chroma server for %s went away; finding it again", self.server.folder)
            self._forget(inner)
        return self._connected().call(op, *args)

    def close(self) -> None:
        self._closed = True  # at once: a call still finding the server must not start one
        with self._lock:
            inner, self._inner = self._inner, None
            using, self._using = self._using, False
        if inner is not None:
            inner.close()
        if using:
            USERS.release(self.server.folder)
