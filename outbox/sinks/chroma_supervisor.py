"""The detached process that runs a store folder's shared ``chroma run`` server.

Started by ``chroma_service`` in a session of its own, so it outlives the process that
started it. It takes the store's owner lock and hands it to ``chroma run`` too, so the lock is
free only once both are gone; Chroma is told to die with it (Linux), so a server is never
left behind to share the folder with the next one. It stops Chroma when sent SIGTERM, when
Chroma exits, or when no process has used it for the idle time (0: never).

Usage: ``python -m outbox.sinks.chroma_supervisor FOLDER CHROMA_COMMAND IDLE_SECONDS``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from outbox.sinks.chroma_local import OWNER_LOCK
from outbox.sinks.chroma_service import (
    HOST,
    START_LOCK,
    USERS_LOCK,
    ServerState,
    remove_state,
    try_flock,
    write_state,
)

_TICK = 1.0
_EXIT_WAIT = 20.0
_OWNER_WAIT = 5.0  # a client may be probing the owner lock at this very moment


def say(message: str) -> None:
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    print(f"{stamp} outbox chroma supervisor {os.getpid()}: {message}", flush=True)


def free_port() -> int:
    """A loopback port nobody listens on now; if Chroma loses it to a race it exits, and the
    process that started us starts another supervisor."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def take_owner(folder: Path) -> IO[str] | None:
    handle = (folder / OWNER_LOCK).open("a+", encoding="utf-8")
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


def _die_with_parent() -> None:
    """In Chroma's process before exec: SIGTERM it when the supervisor dies (Linux only)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_chroma(folder: Path, command: str, port: int, owner: IO[str]) -> subprocess.Popen[bytes]:
    argv = [command, "run", "--path", str(folder), "--host", HOST, "--port", str(port)]
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        pass_fds=(owner.fileno(),),  # the lock stays held while Chroma lives
        preexec_fn=_die_with_parent,
        env=dict(os.environ, ANONYMIZED_TELEMETRY="False"),
    )


def idle_stop(folder: Path, users: IO[str]) -> bool:
    """Whether nobody uses the server and no process is starting one; on True both locks
    stay held until we exit, so a newcomer waits for us and then starts a fresh server."""
    start = (folder / START_LOCK).open("a+", encoding="utf-8")
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


def watch(folder: Path, chroma: subprocess.Popen[bytes], idle: float, stop: threading.Event) -> str:
    """Wait until there is a reason to stop, and say which."""
    users = (folder / USERS_LOCK).open("a+", encoding="utf-8")
    _held.append(users)
    idle_since: float | None = None
    while not stop.wait(_TICK):
        if chroma.poll() is not None:
            return f"chroma run exited with code {chroma.returncode}"
        if idle <= 0 or not unused(users):
            idle_since = None
            continue
        idle_since = idle_since or time.monotonic()
        if time.monotonic() - idle_since >= idle and idle_stop(folder, users):
            return f"no process used it for {idle:g} s (OUTBOX_CHROMA_IDLE)"
    return "asked to stop"


def terminate(chroma: subprocess.Popen[bytes]) -> None:
    if chroma.poll() is not None:
        return
    chroma.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
    chroma.terminate()
    try:
        chroma.wait(_EXIT_WAIT)
    except subprocess.TimeoutExpired:
        chroma.kill()
        chroma.wait()


def main(argv: list[str]) -> int:
    folder, command, idle = Path(argv[0]), argv[1], float(argv[2])
    folder.mkdir(parents=True, exist_ok=True)
    owner = take_owner(folder)
    if owner is None:
        return 1
    stop = threading.Event()

    def on_signal(_number: int, _frame: Any) -> None:
        stop.set()

    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(number, on_signal)
    port = free_port()
    chroma = start_chroma(folder, command, port, owner)
    write_state(folder, ServerState(os.getpid(), chroma.pid, port))
    say(f"chroma run {chroma.pid} serves {folder} on {HOST}:{port}")
    reason = "stopped"
    try:
        reason = watch(folder, chroma, idle, stop)
    finally:
        remove_state(folder, os.getpid())
        terminate(chroma)
        say(f"stopped: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
