"""Issue 21, cases 1-4: the shared Chroma server and its folder are the owner's alone.

Real processes throughout: the library's own shared server (its supervisor with the store
open), a second local user (``nobody``, through ``tests/helpers/other_user.py``) as the
attacker, real files searched byte for byte for the secret words.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import chromadb
import pytest

from outbox import Outbox, Settings, load_settings
from outbox.core.safe_files import UnsafeFile
from outbox.sinks.chroma import ChromaSink
from outbox.sinks.chroma_local import OWNER_LOCK
from outbox.sinks.chroma_service import (
    KEY,
    LOG,
    SOCKET,
    START_LOCK,
    STATE,
    USERS_LOCK,
    ImpostorServer,
    ServerState,
    SharedServer,
    connect,
    read_state,
    write_state,
)
from tests.chroma_server import shared_server_processes, stop_shared_server
from tests.helpers.other_user import as_other_user, needs_other_user, reachable

SECRET = "Marguerite's locker code is plum-tangerine-4471"
WORDS = b"plum-tangerine-4471"


@pytest.fixture
def base() -> Iterator[Path]:
    """A store folder other users may traverse up to the store's own files."""
    folder = reachable()
    yield folder
    stop_shared_server(folder / "vectors" / "chroma")
    shutil.rmtree(folder, ignore_errors=True)


def store_settings(base: Path, mode: str = "server") -> Settings:
    """OUTBOX_CHROMA_PATH outside OUTBOX_HOME, in folders that do not exist yet."""
    return load_settings(
        env={},
        home=base / ".outbox",
        markdown_dir=base / "md",
        sinks="chroma",
        chroma_path=base / "vectors" / "chroma",
        chroma_mode=mode,
        embedding="hashing",
    )


def deliver_secret(settings: Settings) -> str:
    with Outbox.open(settings) as ob:
        key = ob.add(SECRET).key
        assert ob.drain(timeout=120).ok
    return key


def owner_count(settings: Settings, key: str) -> int:
    """The secret's documents, counted by the owner with a client of its own (the server is
    stopped first: one process at a time opens the folder)."""
    stop_shared_server(settings.chroma_path)
    client = chromadb.PersistentClient(str(settings.chroma_path))
    try:
        name = ChromaSink.from_settings(settings).active_index().collection
        return len(client.get_collection(name).get(ids=[key], include=[])["ids"])
    finally:
        client.close()


def files_with_words(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and WORDS in p.read_bytes()]


ATTACK = r"""
import json, os, socket, sys, urllib.request
folder = sys.argv[1]
seen = {"listed": None, "read": [], "socket": None, "tcp": []}
try:
    seen["listed"] = os.listdir(folder)
except OSError as exc:
    seen["listed"] = type(exc).__name__
for name in json.loads(sys.argv[2]):
    try:
        with open(os.path.join(folder, name), "rb") as handle:
            seen["read"].append([name, handle.read().hex()])
    except OSError as exc:
        seen["read"].append([name, type(exc).__name__])
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    client.connect(os.path.join(folder, "outbox-server.sock"))
    seen["socket"] = "connected"
except OSError as exc:
    seen["socket"] = type(exc).__name__
for port in json.loads(sys.argv[3]):
    url = f"http://127.0.0.1:{port}/api/v2/tenants/default_tenant/databases/default_database/collections"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            seen["tcp"].append([port, reply.read().decode(errors="replace")])
    except Exception as exc:
        seen["tcp"].append([port, type(exc).__name__])
print(json.dumps(seen))
"""


def listening_tcp_ports(pids: list[int]) -> list[int]:
    """The TCP ports these processes listen on (read from /proc: their sockets' inodes)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd) if fd.is_symlink() else ""
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# -- case 1: another local user reads or deletes nothing --------------------------------------


@needs_other_user
def test_another_user_can_neither_read_nor_delete_through_the_shared_server(base: Path) -> None:
    settings = store_settings(base)
    (base / "vectors").mkdir()
    (base / "vectors").chmod(0o711)  # the owner's own parent, open to pass: the attack gets
    key = deliver_secret(settings)  # as far as the Chroma folder the library made
    folder = settings.chroma_path
    sink = ChromaSink.from_settings(settings)  # the server keeps running for the attack
    try:
        assert sink.count() == 1
        servers = list(shared_server_processes(folder))
        assert servers, "the shared server is not running"
        ports = listening_tcp_ports(servers)
        assert ports == [], f"the shared server listens on TCP ports {ports}"
        names = sorted(p.name for p in folder.iterdir())
        # The attacker tries every name in the folder, the socket, and any ports it had.
        attack = as_other_user(ATTACK, str(folder), json.dumps(names), json.dumps(ports))
        assert attack.returncode == 0, attack.stderr
        seen = json.loads(attack.stdout)
        # Refused by the Chroma folder's own mode (0700), not by the test's temporary folder:
        # the folder above it lets anyone through.
        assert base.stat().st_mode & 0o001 and (folder.parent.stat().st_mode & 0o001)
        assert seen["listed"] == "PermissionError", seen
        assert seen["socket"] == "PermissionError", seen
        assert all(outcome == "PermissionError" for _name, outcome in seen["read"]), seen
        assert WORDS.hex() not in attack.stdout
        assert sink.count() == 1  # nothing was deleted through the server either
    finally:
        sink.close()
    assert owner_count(settings, key) == 1
    # The words are in Chroma's files: what the attacker could not read held them.
    assert files_with_words(folder), "the test's secret never reached Chroma's files"


# -- case 2: the library talks only to a server that proves it holds the key ------------------


class Recorder:
    """A listener that keeps every byte sent to it: a foreign process on a port or a socket."""

    def __init__(self, family: int, address: str | tuple[str, int]) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(8)
        self.received = bytearray()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            # Answers like a server that does not hold the key: a framed reply of 64 bytes.
            conn.sendall((64).to_bytes(4, "big") + os.urandom(64))
            while chunk := conn.recv(65536):
                self.received += chunk

    def close(self) -> None:
        self.sock.close()


def test_a_state_file_naming_another_port_or_an_impostor_gets_no_document(base: Path) -> None:
    settings = store_settings(base)
    deliver_secret(settings)
    folder = settings.chroma_path
    state = read_state(folder)
    assert state is not None
    port_listener = Recorder(socket.AF_INET, ("127.0.0.1", 0))
    try:
        # The live pids kept, another port named: the address is never read from the file.
        port = port_listener.sock.getsockname()[1]
        forged = {"pid": state.pid, "chroma_pid": state.pid, "port": port}
        (folder / STATE).write_text(json.dumps(forged), encoding="utf-8")
        with Outbox.open(settings) as ob:
            ob.add(SECRET + " (second copy)")
            assert ob.drain(timeout=120).ok
        assert port_listener.connections == 0 and not port_listener.received
    finally:
        port_listener.close()

    # An impostor at the socket itself (the server gone, its place taken).
    stop_shared_server(folder)
    impostor = Recorder(socket.AF_UNIX, str(folder / SOCKET))
    try:
        server = SharedServer(folder, 600.0)
        with pytest.raises(ImpostorServer, match="nothing was sent"):
            connect(server.folder, 5.0)
        # The sink, finding no server that proves itself, starts its own in that place.
        sink = ChromaSink.from_settings(settings)
        try:
            assert sink.count() == 2
        finally:
            sink.close()
        assert impostor.connections >= 1
        assert WORDS not in impostor.received and b"locker" not in impostor.received
    finally:
        impostor.close()
        (folder / SOCKET).unlink(missing_ok=True)


# -- case 3: every folder and file made for Chroma is the owner's alone -------------------------


@needs_other_user
@pytest.mark.parametrize("mode", ["server", "embedded"])
def test_chroma_folders_and_files_outside_home_are_owner_only(base: Path, mode: str) -> None:
    settings = store_settings(base, mode)
    deliver_secret(settings)
    stop_shared_server(settings.chroma_path)
    made = [base / "vectors", *sorted(base.joinpath("vectors").rglob("*"))]
    loose = {
        str(p.relative_to(base)): oct(stat.S_IMODE(p.lstat().st_mode))
        for p in made
        if p.lstat().st_mode & 0o077
    }
    assert loose == {}, f"{mode}: not owner-only: {loose}"
    database = settings.chroma_path / "chroma.sqlite3"
    assert WORDS in database.read_bytes()
    attack = as_other_user(
        "import sys\ntry:\n    open(sys.argv[1], 'rb').read(); print('read')\n"
        "except OSError as exc:\n    print(type(exc).__name__)",
        str(database),
    )
    # The folders above are this test's own 0711 ones: the 0700 Chroma folders stop it.
    assert attack.stdout.strip() == "PermissionError", attack.stdout + attack.stderr


# -- case 4: planted folders and links are refused, nothing written through a link ------------


@needs_other_user
@pytest.mark.parametrize("planted", ["other user's folder", "world-writable folder"])
def test_a_chroma_folder_not_the_owners_alone_is_refused(base: Path, planted: str) -> None:
    settings = store_settings(base)
    folder = settings.chroma_path
    folder.mkdir(parents=True, mode=0o700)
    if planted == "world-writable folder":
        folder.chmod(0o777)
    else:
        os.chown(folder, 65534, 65534)
    with pytest.raises(UnsafeFile, match=r"Chroma folder \(OUTBOX_CHROMA_PATH\)") as refused:
        SharedServer(folder, 600.0).endpoint()
    assert "\n" not in str(refused.value)
    assert not list(folder.iterdir()), "something was written into the planted folder"
    assert not shared_server_processes(folder)


@pytest.mark.parametrize(
    "name", [OWNER_LOCK, USERS_LOCK, START_LOCK, LOG, STATE, f".{STATE}.{{pid}}", KEY]
)
def test_a_link_at_any_name_the_server_opens_is_refused(base: Path, name: str) -> None:
    settings = store_settings(base)
    folder = settings.chroma_path
    folder.mkdir(parents=True, mode=0o700)
    victim = base / "victim.txt"
    victim.write_text("untouched\n", encoding="utf-8")
    (folder / name.format(pid=os.getpid())).symlink_to(victim)
    with pytest.raises(UnsafeFile, match="symbolic link") as refused:
        if name.startswith("."):  # the state file's temporary name, written by a supervisor
            write_state(folder, ServerState(os.getpid()))
        else:
            SharedServer(folder, 600.0).endpoint()
    assert "\n" not in str(refused.value)
    assert victim.read_text(encoding="utf-8") == "untouched\n"
    stop_shared_server(folder)
