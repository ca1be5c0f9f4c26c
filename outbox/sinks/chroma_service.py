"""One shared ``chroma run`` server per store folder, started by whichever process needs it.

An embedded Chroma folder may be open in one process only (two writers corrupt it), so when
``OUTBOX_CHROMA_URL`` is unset every process on the machine talks to one loopback server for
the folder: the first that needs it starts it detached (``chroma_supervisor``), the others
find it through a state file. It lives on when its starter dies. Files in the store folder:

* ``outbox-server.json``: the server's port and process ids, replaced atomically;
* ``outbox-server.log``: the server's output and its supervisor's own lines;
* ``outbox-start.lock``: one process at a time checks, starts or restarts the server (taken
  with ``core/file_lock``; the supervisor holds it with a plain flock while it stops idle);
* ``outbox-owner.lock``: flock held by the server for its whole life (an embedded child takes
  the same one, so the two modes never open one folder together);
* ``outbox-users.lock``: a shared flock per process using the server; with none left for
  ``OUTBOX_CHROMA_IDLE`` the server stops.

Nothing here imports chromadb; the HTTP calls themselves are ``chroma_client.ServerBackend``'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import outbox
from outbox.core.errors import OutboxError
from outbox.core.file_lock import exclusive
from outbox.core.folders import ensure_private_dir
from outbox.core.states import FailureReason
from outbox.sinks.base import Transient
from outbox.sinks.chroma_client import ServerBackend, chroma_failure
from outbox.sinks.chroma_local import OWNER_LOCK

log = logging.getLogger(__name__)

STATE = "outbox-server.json"
LOG = "outbox-server.log"
START_LOCK = "outbox-start.lock"
USERS_LOCK = "outbox-users.lock"
HOST = "127.0.0.1"
# How long a new server may take to answer its first heartbeat (Python start, then Chroma's
# own start, on a busy machine), and how long a live one may stay silent before it is stopped.
STARTUP = 60.0
_TRIES = 3
_POLL = 0.1
_LOG_LIMIT = 8 << 20


class ChromaServerDown(Transient, OutboxError):
    """The shared Chroma server could not be started or reached; retried as a lost
    connection, never as a busy database."""

    def __init__(self, message: str) -> None:
        super().__init__(message, FailureReason.TRANSPORT_CLOSED)


@dataclass(frozen=True)
class ServerState:
    """What ``outbox-server.json`` says: the supervisor's pid, Chroma's pid and its port."""

    pid: int
    chroma_pid: int
    port: int
    host: str = HOST


def chroma_command() -> str:
    """The ``chroma`` console script of this interpreter's environment, else on PATH."""
    beside = Path(sys.executable).with_name("chroma")
    found = str(beside) if beside.exists() else shutil.which("chroma")
    if not found:
        raise ChromaServerDown(
            f"no chroma command beside {sys.executable} or on PATH (pip install chromadb), "
            "or set OUTBOX_CHROMA_URL to a running server"
        )
    return found


def read_state(folder: Path) -> ServerState | None:
    try:
        data = json.loads((folder / STATE).read_text(encoding="utf-8"))
        return ServerState(int(data["pid"]), int(data["chroma_pid"]), int(data["port"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_state(folder: Path, state: ServerState) -> None:
    """Write-then-rename, so a reader sees the old file or the new one, never half of one."""
    temporary = folder / f".{STATE}.{os.getpid()}"
    temporary.write_text(json.dumps(asdict(state)), encoding="utf-8")
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
    with (folder / OWNER_LOCK).open("a+", encoding="utf-8") as handle:
        if try_flock(handle, fcntl.LOCK_EX):
            fcntl.flock(handle, fcntl.LOCK_UN)
            return None
        handle.seek(0)
        return handle.read().strip() or "unknown"


def answers(state: ServerState, timeout: float = 2.0) -> bool:
    """Whether Chroma's heartbeat answers on the state's port (a pid alone may be reused)."""
    url = f"http://{state.host}:{state.port}/api/v2/heartbeat"
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with direct.open(url, timeout=timeout) as reply:
            return bool(reply.status == 200 and b"heartbeat" in reply.read(4096))
    except (OSError, ValueError):
        return False


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
        """A running, answering server: found, or started (once, under the start lock)."""
        ensure_private_dir(self.folder)
        state = read_state(self.folder)
        if state is not None and answers(state) and owner_of(self.folder):
            return state
        lock, bound = self.folder / START_LOCK, 2 * STARTUP + 30
        with exclusive(
            lock,
            "Chroma server's start lock",
            lambda: ChromaServerDown(
                f"the Chroma server's start lock stayed locked for {bound:g} s: {lock}"
            ),
            wait=bound,
        ):
            return self._start_or_wait()

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """No Chroma on the folder for the block, for work on its files (a forget's purge):
        the server is stopped, the start lock keeps a new one from starting and the owner
        lock an embedded one; the next call after the block starts a fresh server."""
        lock, bound = self.folder / START_LOCK, 2 * STARTUP + 30
        with exclusive(
            lock,
            "Chroma server's start lock",
            lambda: ChromaServerDown(
                f"the Chroma server's start lock stayed locked for {bound:g} s: {lock}"
            ),
            wait=bound,
        ):
            state, owner = read_state(self.folder), owner_of(self.folder)
            if state is not None and owner is not None and owner.split()[0] == str(state.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(state.pid, signal.SIGTERM)
            with (self.folder / OWNER_LOCK).open("a+", encoding="utf-8") as handle:
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
            if state is not None and owner and answers(state):
                return state
            if child is not None and child.poll() is not None:  # it gave up; see the log
                child = None
            if child is None and owner is None:
                if not self.wanted():
                    raise ChromaServerDown(f"closed: no new Chroma server for {self.folder}")
                if tries == _TRIES:
                    raise ChromaServerDown(
                        f"chroma run for {self.folder} did not start ({tries} tries); "
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
            f"the Chroma server for {self.folder} (process {owner}) gave no heartbeat within "
            f"{STARTUP:g} s; see {self.log_path}"
        )

    def _spawn(self) -> subprocess.Popen[bytes]:
        """Start the supervisor in its own session: no signal meant for us reaches it."""
        for child in [c for c in _started if c.poll() is not None]:
            _started.remove(child)
        with contextlib.suppress(OSError):
            if self.log_path.stat().st_size > _LOG_LIMIT:
                os.replace(self.log_path, self.log_path.with_name(LOG + ".1"))
        root = str(Path(outbox.__file__).resolve().parent.parent)
        command = [sys.executable, "-m", "outbox.sinks.chroma_supervisor", str(self.folder)]
        command += [chroma_command(), repr(self.idle)]
        env = dict(os.environ, ANONYMIZED_TELEMETRY="False")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        log.info("starting a shared Chroma server for %s (log: %s)", self.folder, self.log_path)
        with self.log_path.open("ab") as out:
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=str(self.folder),
                env=env,
                start_new_session=True,
            )
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
                ensure_private_dir(folder)
                handle = (folder / USERS_LOCK).open("a+", encoding="utf-8")
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


def _server_gone(exc: BaseException) -> bool:
    failure = chroma_failure(exc)
    return isinstance(failure, Transient) and failure.reason is FailureReason.TRANSPORT_CLOSED


class SharedBackend:
    """``ChromaSink``'s backend for the shared server: found or started on the first call, and
    again after it went away (the call is then made once more: upsert, query, count and open
    may all be repeated safely)."""

    def __init__(self, folder: Path, timeout: float, idle: float) -> None:
        self.server = SharedServer(folder, idle, wanted=lambda: not self._closed)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._inner: ServerBackend | None = None
        self._using = False
        self._closed = False

    def _connected(self) -> ServerBackend:
        with self._lock:
            if self._closed:
                raise ChromaServerDown("this Chroma sink is closed")
            if self._inner is None:
                if not self._using:  # before the server is found: it cannot stop under us
                    USERS.acquire(self.server.folder)
                    self._using = True
                state = self.server.endpoint()
                self._inner = ServerBackend(state.host, state.port, False, self.timeout)
            return self._inner

    def _forget(self, inner: ServerBackend) -> None:
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
