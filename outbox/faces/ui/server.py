"""Serving the dashboard: bind first (so the printed address is the real one, even for
``--port 0``), print the URL with a fresh session token, then run uvicorn until SIGINT or
SIGTERM.
"""

from __future__ import annotations

import contextlib
import errno
import secrets
import signal
import socket
import sys
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from outbox.core.errors import OutboxError
from outbox.faces.ui.access import TOKEN_PARAM, Access

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from outbox.api import Outbox

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, or an error line that says what to change."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OutboxError(
                f"port {port} on {host} is in use; choose another with --port"
            ) from None
        raise OutboxError(
            f"cannot listen on {host}:{port} ({exc.strerror}); check --host"
        ) from None
    sock.listen(128)
    return sock


def url(host: str, port: int, token: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    if host in ("0.0.0.0", "::"):
        shown = socket.gethostname()
    return f"http://{shown}:{port}/?{TOKEN_PARAM}={token}"


def serve(ob: Outbox, host: str, port: int, out: TextIO = sys.stdout) -> None:
    """Serve ``ob`` on ``host:port`` until interrupted."""
    from outbox.faces.ui.app import build_app

    sock = bind(host, port)
    port = sock.getsockname()[1]
    token = secrets.token_urlsafe(32)
    app = build_app(ob, Access.for_bind(token, host, port))
    if host not in LOOPBACK:
        sys.stderr.write(
            f"outbox ui: WARNING: listening on {host}:{port}, not on loopback. Anyone who can\n"
            "outbox ui: WARNING: reach this address and learns the token can read every memory\n"
            "outbox ui: WARNING: and forget it, and the traffic is plain HTTP (no TLS).\n"
        )
    out.write(f"outbox ui: serving {ob.settings.home} at\n    {url(host, port, token)}\n")
    out.write("outbox ui: open that address (it carries the session token); Ctrl-C stops.\n")
    out.flush()
    _run(app, sock)


def _run(app: Starlette, sock: socket.socket) -> None:
    """uvicorn, stopped by SIGINT or SIGTERM without raising the signal again afterwards
    (as uvicorn does), so ``outbox ui`` returns and closes the outbox like any command."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            wanted = (signal.SIGINT, signal.SIGTERM)
            before = {sig: signal.signal(sig, self.stop) for sig in wanted}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

        def stop(self, _sig: int, _frame: FrameType | None) -> None:
            # A second Ctrl-C stops without waiting for open connections.
            self.force_exit = self.should_exit
            self.should_exit = True

    # No access log: a first request's address carries the token.
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    Server(config).run(sockets=[sock])
