"""The dashboard's test fixtures: a real ``outbox ui`` process over a test store, and a real
headless Chromium (Debian's package, launched by its own executable; nothing downloaded).

Test modules import the fixtures they use from here (``ui_fixture``, ``page_fixture``
and ``browser_context_fixture``, each registered under the name without ``_fixture``).
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from outbox import Outbox, Settings, load_settings
from tests.conftest import FAULTY
from tests.helpers.subproc import child_env

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
URL_LINE = re.compile(r"(http://127\.0\.0\.1:(\d+)/\?token=([\w-]+))")


@dataclass
class UiServer:
    """A running ``outbox ui``: its address with the token, and the store it serves."""

    url: str
    base: str
    port: int
    token: str
    process: subprocess.Popen[str]
    settings: Settings

    def open(self) -> Outbox:
        """The same store from the test's side, to set up and check what the UI shows."""
        return Outbox.open(self.settings)

    def request(
        self,
        method: str,
        path: str,
        *,
        body: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], str]:
        """One plain HTTP request (no browser, no cookie unless given): status, headers
        (lower-case names), body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            sent = {"Host": f"127.0.0.1:{self.port}", **(headers or {})}
            if body is not None:
                sent.setdefault("Content-Type", "application/x-www-form-urlencoded")
            conn.request(method, path, body=body, headers=sent)
            answer = conn.getresponse()
            found = {name.lower(): value for name, value in answer.getheaders()}
            return answer.status, found, answer.read().decode("utf-8", "replace")
        finally:
            conn.close()

    @property
    def cookie(self) -> str:
        return f"outbox_ui_{self.port}={self.token}"


def ui_settings(root: Path) -> Settings:
    return load_settings(
        env={}, home=root / ".outbox", markdown_dir=root / "docs.local" / "decisions", sinks=FAULTY
    )


def start_ui(root: Path, settings: Settings, **env: str) -> UiServer:
    """``outbox ui --port 0`` on ``settings``'s store; returns once it printed its URL."""
    child = child_env(home=settings.home, markdown_dir=str(settings.markdown_dir), **env)
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox", "ui", "--port", "0"],
        cwd=root,
        env=child,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    deadline = time.monotonic() + 60
    seen: list[str] = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        found = URL_LINE.search(line)
        if found:
            url, port, token = found.group(1), int(found.group(2)), found.group(3)
            return UiServer(url, url.split("/?")[0], port, token, process, settings)
    process.kill()
    _out, err = process.communicate(timeout=10)
    raise AssertionError(f"outbox ui printed no URL: {''.join(seen)!r} {err!r}")


def stop_ui(server: UiServer) -> str:
    """SIGTERM, as a person's Ctrl-C or a service manager would; returns its stderr."""
    server.process.send_signal(signal.SIGTERM)
    try:
        _out, err = server.process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        _out, err = server.process.communicate(timeout=10)
    return err


@pytest.fixture(name="ui")
def ui_fixture(tmp_path: Path) -> Iterator[UiServer]:
    """A fresh store with nothing in it yet, served by a real ``outbox ui``."""
    settings = ui_settings(tmp_path)
    Outbox.open(settings).close()
    server = start_ui(tmp_path, settings)
    yield server
    stop_ui(server)


def chromium_or_skip() -> None:
    """CI installs Chromium (``.ci/run``): there a missing one fails; elsewhere it skips
    with the reason shown."""
    if CHROMIUM.is_file():
        return
    message = f"{CHROMIUM} is missing: apt-get install -y chromium"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module", name="browser_context")
def browser_context_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium per test module, with a fresh profile folder."""
    chromium_or_skip()
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 860},
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(name="page")
def page_fixture(browser_context: Any) -> Iterator[Any]:
    """A new tab with no cookie from an earlier test."""
    browser_context.clear_cookies()
    tab = browser_context.new_page()
    tab.set_default_timeout(20_000)
    yield tab
    tab.close()


def host_of(url: str) -> str:
    return urlsplit(url).netloc


def png_colours(data: bytes) -> int:
    """How many distinct colours an 8-bit RGB or RGBA PNG has (a blank page has one or
    two): a small decoder, so the check needs no imaging library."""
    import struct
    import zlib

    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    at, chunks, header = 8, [], b""
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        at += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6), f"unexpected PNG format {depth}/{colour}"
    step = 3 if colour == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = width * step
    previous = bytearray(stride)
    colours: set[bytes] = set()
    for row in range(height):
        start = row * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        for i in range(stride):
            left = line[i - step] if i >= step else 0
            up = previous[i]
            corner = previous[i - step] if i >= step else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                guess = left + up - corner
                pa, pb, pc = abs(guess - left), abs(guess - up), abs(guess - corner)
                best = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + best) & 0xFF
        colours.update(bytes(line[i : i + step]) for i in range(0, stride, step * 7))
        previous = line
    return len(colours)
