"""A real ``chroma run`` server for tests: start, stop, freeze and thaw it by its process id.

Tests that need a Chroma server share one per module through a module-scoped fixture, e.g.::

    @pytest.fixture(scope="module")
    def chroma_server(tmp_path_factory):
        with ChromaServer(tmp_path_factory.mktemp("chroma-server")) as server:
            yield server

``server.url`` goes into ``OUTBOX_CHROMA_URL``. ``stop()`` then ``start()`` restarts it on the
same data folder and port (an outage); ``freeze()``/``thaw()`` send SIGSTOP/SIGCONT (a server
that accepts connections but never answers), and ``with server.frozen():`` does both.

The shared server the library starts by itself for a store folder outlives the test that
started it; ``stop_shared_server(folder)`` ends it, and ``shared_server_processes(folder)``
lists what runs for it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType


def free_port() -> int:
    """A loopback port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chroma_executable() -> str:
    """The ``chroma`` console script of the running interpreter's environment."""
    beside = Path(sys.executable).with_name("chroma")
    found = str(beside) if beside.exists() else shutil.which("chroma")
    if not found:
        raise RuntimeError("the chroma console script is not installed (pip install chromadb)")
    return found


class ChromaServer:
    """One ``chroma run --host 127.0.0.1`` process on ``path``; its output goes to ``log_path``."""

    def __init__(self, path: Path, port: int | None = None) -> None:
        self.path = Path(path)
        self.port = port or free_port()
        self.log_path = self.path.with_name(self.path.name + ".log")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("the Chroma server is not running")
        return self.process.pid

    def healthy(self, timeout: float = 1.0) -> bool:
        """True when ``GET /api/v2/heartbeat`` answers 200 within ``timeout``."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v2/heartbeat", timeout=timeout) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def start(self, timeout: float = 60.0) -> ChromaServer:
        """Start the server and wait for its heartbeat; raise with the log tail if it dies."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the Chroma server is already running")
        self.path.mkdir(parents=True, exist_ok=True)
        command = [chroma_executable(), "run", "--path", str(self.path)]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        env = {**os.environ, "ANONYMIZED_TELEMETRY": "False"}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"chroma run exited early:\n{self._log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"chroma run gave no heartbeat within {timeout:g}s:\n{self._log_tail()}")

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (thawing it first if frozen), then SIGKILL if it does not exit in time."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGCONT)
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)

    def freeze(self) -> None:
        """SIGSTOP: the socket still accepts connections, but nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Frozen for the block, thawed after it whatever happened."""
        self.freeze()
        try:
            yield
        finally:
            self.thaw()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> ChromaServer:
        return self.start()

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self.stop()


def _chroma_processes() -> dict[int, list[str]]:
    """Every live process (but this one) with ``chroma`` in its arguments."""
    found: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        args = [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]
        if any("chroma" in arg for arg in args):
            found[int(entry.name)] = args
    return found


def shared_server_processes(folder: Path) -> dict[int, list[str]]:
    """The live processes (supervisor, ``chroma run``) whose arguments name ``folder``."""
    needle = str(Path(folder).resolve())
    return {pid: args for pid, args in _chroma_processes().items() if needle in args}


def supervisors(folder: Path) -> list[int]:
    """The pids of the supervisors running a shared server for ``folder``."""
    return sorted(
        pid
        for pid, args in shared_server_processes(folder).items()
        if "outbox.sinks.chroma_supervisor" in args
    )


def stop_shared_server(folder: Path, timeout: float = 30.0) -> None:
    """End the library's shared server of ``folder``: SIGTERM, then SIGKILL what is left."""
    for pid in shared_server_processes(folder):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while shared_server_processes(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in shared_server_processes(folder):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def processes_under(root: Path) -> dict[int, list[str]]:
    """The Chroma processes (supervisor, ``chroma run``, embedded child) whose arguments name
    a path below ``root``: the ones a test of that folder started."""
    prefix = str(Path(root).resolve()) + os.sep
    return {
        pid: args
        for pid, args in _chroma_processes().items()
        if any(arg.startswith(prefix) for arg in args)
    }


def stop_servers_under(root: Path) -> None:
    """End every shared server whose store lies below ``root`` (a test's own folder), so no
    test leaves one running until its idle stop."""
    prefix = str(Path(root).resolve()) + os.sep
    folders = {arg for args in processes_under(root).values() for arg in args}
    for folder in folders:
        if folder.startswith(prefix):
            stop_shared_server(Path(folder))
