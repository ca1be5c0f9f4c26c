"""``outbox ui`` in a real headless Chromium: every page loads, the memories page filters
and searches, a memory opens whole, a dead letter is retried and a memory forgotten by
clicking, a script in a memory stays text, a cross-site form changes nothing, and the
overview's screenshot is a real picture, not a blank page."""

from __future__ import annotations

import http.server
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.ui_browser import (  # noqa: F401
    UiServer,
    browser_context_fixture,
    page_fixture,
    png_colours,
    ui_fixture,
)

SCRIPT = "<script>alert(1)</script> stays text"


def seed(server: UiServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Memories in two sessions by two agents, one with a script in it, all delivered but
    one the sink refuses for good (a dead letter)."""
    monkeypatch.setenv("OUTBOX_FAULTY_REJECT", "poison")
    with server.open() as ob:
        keys = {
            "decision": ob.add(
                "We chose SQLite in WAL mode with synchronous FULL.",
                tags=["decision"],
                metadata={"session_id": "s-1", "agent": "planner"},
                timestamp="2026-11-29T08:00:00Z",
            ).key,
            "deploy": ob.add(
                "Deploys go out on Tuesdays after the canary is green.",
                tags=["ops"],
                metadata={"session_id": "s-2", "agent": "ops"},
                timestamp="2026-11-29T09:00:00Z",
            ).key,
            "script": ob.add(SCRIPT, metadata={"session_id": "s-2", "agent": "ops"}).key,
            "poison": ob.add("a poison memory the sink refuses", tags=["bad"]).key,
        }
        ob.drain(timeout=20)
    monkeypatch.delenv("OUTBOX_FAULTY_REJECT")
    return keys


def open_dashboard(page: Any, server: UiServer, dialogs: list[str]) -> None:
    """Open the printed address (the token becomes a cookie); every dialog is recorded
    and accepted."""

    def answer(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.on("dialog", answer)
    page.goto(server.url)
    assert page.url == server.base + "/"


def test_overview_shows_counts_chart_and_is_not_blank(
    ui: UiServer, page: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(ui, monkeypatch)
    dialogs: list[str] = []
    open_dashboard(page, ui, dialogs)
    sink_row = page.locator("#sinks tbody tr").first
    cells = sink_row.locator("td").all_inner_texts()
    with ui.open() as ob:
        counts = ob.status()["sinks"][ob.settings.sinks[0]]
    assert cells[0] == ui.settings.sinks[0]
    assert cells[1:6] == [str(counts[state]) for state in ("pending", "leased", "delivered",
                                                              "dead", "discarded")]  # fmt: skip
    assert cells[3] == "3" and cells[4] == "1"
    bars = page.locator("svg rect.bar-delivered")
    assert bars.count() >= 1
    assert "3 delivered" in page.locator("figcaption").first.inner_text()
    assert page.locator("svg rect.bar-failed").count() == 1
    shot = page.screenshot(clip={"x": 0, "y": 0, "width": 800, "height": 600})
    assert png_colours(shot) > 20  # text, cards, table and bars: far from a blank page
    assert dialogs == []


def test_memories_filter_search_and_open_one(
    ui: UiServer, page: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = seed(ui, monkeypatch)
    dialogs: list[str] = []
    open_dashboard(page, ui, dialogs)
    page.click("nav >> text=Memories")
    shown = page.locator("#memories tbody tr td:nth-child(2)").all_inner_texts()
    assert len(shown) == 4 and shown[-1] == keys["decision"][:12]  # the oldest is last

    page.fill("input[name=tag]", "decision")
    page.click("form.filters button")
    assert page.locator("#memories tbody tr").count() == 1
    page.goto(ui.base + "/memories?agent=ops")
    assert page.locator("#memories tbody tr").count() == 2
    page.goto(ui.base + "/memories?session=s-1")
    assert page.locator("#memories tbody tr td:nth-child(2)").all_inner_texts() == [
        keys["decision"][:12]
    ]

    page.goto(ui.base + "/memories")
    page.fill("input[name=q]", "canary tuesdays")
    page.press("input[name=q]", "Enter")
    page.wait_for_url(re.compile(r"/memories\?q=canary\+tuesdays"))
    found = page.locator("#memories tbody tr")
    # Recall's best hit first; its session neighbour may follow, lifted as context.
    assert "Deploys go out on Tuesdays" in found.first.inner_text()
    assert "We chose SQLite" not in page.locator("#memories").inner_text()

    page.click(f"text={keys['deploy'][:12]}")
    page.wait_for_url(f"**/memories/{keys['deploy']}")
    assert page.locator("#key").inner_text() == keys["deploy"]
    assert page.locator("#content").inner_text() == (
        "Deploys go out on Tuesdays after the canary is green."
    )
    assert '"agent": "ops"' in page.locator("#metadata").inner_text()
    assert "delivered" in page.locator("#deliveries").inner_text()
    with ui.open() as ob:
        markdown = ob.markdown_path(keys["deploy"])
    assert markdown is not None and str(markdown) in page.locator("dl.facts").inner_text()
    log = page.locator("#log tbody tr").all_inner_texts()
    assert [row.split("\t")[1] for row in log] == ["accepted", "delivered"]
    assert dialogs == []


def test_a_script_in_a_memory_renders_as_text(
    ui: UiServer, page: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = seed(ui, monkeypatch)
    dialogs: list[str] = []
    open_dashboard(page, ui, dialogs)
    page.goto(ui.base + "/memories")
    assert SCRIPT in page.locator("#memories").inner_text()
    page.goto(f"{ui.base}/memories/{keys['script']}")
    assert page.locator("#content").inner_text() == SCRIPT
    assert page.locator("main script").count() == 0
    page.goto(ui.base + "/memories?q=alert")
    page.wait_for_load_state("load")
    assert dialogs == []  # alert(1) never ran


def test_retry_a_dead_letter_by_clicking(
    ui: UiServer, page: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = seed(ui, monkeypatch)
    dialogs: list[str] = []
    open_dashboard(page, ui, dialogs)
    page.click("nav >> text=Dead letters")
    row = page.locator("#dead tbody tr")
    assert row.count() == 1
    text = row.first.inner_text()
    assert keys["poison"][:12] in text and "rejected" in text
    row.first.locator("button", has_text="Retry").click()
    page.wait_for_url(re.compile(r"/dead\?note="))
    assert page.locator(".note").inner_text() == "Retried 1 dead letter"
    assert page.locator("#dead tbody tr").inner_text() == "no dead letters"
    with ui.open() as ob:
        (delivery,) = ob.deliveries_of([keys["poison"]])[keys["poison"]]
        assert (delivery.state, delivery.attempts) == ("pending", 0)
        ob.drain(timeout=20)  # the sink takes it now
        (delivery,) = ob.deliveries_of([keys["poison"]])[keys["poison"]]
        assert delivery.state == "delivered" and delivery.sink_id
    assert dialogs == []


def test_forget_a_memory_by_clicking(
    ui: UiServer, page: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from outbox.testing.sinks import FaultySink

    keys = seed(ui, monkeypatch)
    key, text = keys["decision"], "We chose SQLite in WAL mode"
    sink = FaultySink.from_settings(ui.settings)
    assert key in sink.stored()
    with ui.open() as ob:
        markdown = ob.markdown_path(key)
    assert markdown is not None and markdown.is_file()
    dialogs: list[str] = []
    open_dashboard(page, ui, dialogs)
    page.goto(f"{ui.base}/memories/{key}")
    page.click("button:has-text('Forget this memory')")
    page.wait_for_url(re.compile(rf"/memories/{key}\?note="))
    assert dialogs and "Forget this memory everywhere?" in dialogs[0]
    assert page.locator(".note").inner_text().startswith(f"Forgotten {key[:12]}")
    assert page.locator("#forgotten").count() == 1
    assert page.locator("#content").count() == 0
    assert text not in page.content()

    assert not markdown.exists()
    assert text.encode() not in ui.settings.jsonl_path.read_bytes()
    with ui.open() as ob:
        ob.drain(timeout=20)  # the sink's delete
        assert ob.verify().ok
    assert key not in FaultySink.from_settings(ui.settings).stored()
    page.goto(ui.base + "/memories")
    assert key[:12] not in page.locator("#memories").inner_text()


@pytest.fixture
def attacker(ui: UiServer) -> Iterator[str]:
    """Another site on this machine: a page whose script posts a form to the dashboard."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (
                f'<form id="f" method="post" action="{ui.base}/dead/discard">'
                '<input name="all" value="1"></form>'
                "<script>document.getElementById('f').submit()</script>"
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: Any) -> None:
            """Quiet."""

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_a_cross_site_form_changes_nothing(
    ui: UiServer, page: Any, attacker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The browser holds the dashboard's cookie, and the other site is on the same host
    (so even a SameSite=Strict cookie goes along): its form still changes nothing."""
    keys = seed(ui, monkeypatch)
    dialogs: list[str] = []
    open_dashboard(page, ui, dialogs)
    with page.expect_response(lambda response: "/dead/discard" in response.url) as answer:
        page.goto(attacker)
    assert answer.value.status == 403
    with ui.open() as ob:
        assert [row.state for row in ob.deliveries_of([keys["poison"]])[keys["poison"]]] == ["dead"]


def test_overview_lists_a_running_dispatcher(ui: UiServer, page: Any) -> None:
    """A real ``outbox run`` beats; the overview names its host and pid as alive."""
    import socket
    import subprocess
    import sys
    import time

    from tests.helpers.subproc import child_env

    daemon = subprocess.Popen(
        [sys.executable, "-m", "outbox", "run"],
        cwd=ui.settings.home.parent,
        env=child_env(home=ui.settings.home, markdown_dir=str(ui.settings.markdown_dir)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with ui.open() as ob:
                if any(row["pid"] == daemon.pid for row in ob.status()["dispatchers"]):
                    break
            time.sleep(0.2)
        dialogs: list[str] = []
        open_dashboard(page, ui, dialogs)
        row = page.locator("#dispatchers tbody tr", has_text=str(daemon.pid))
        assert row.count() == 1
        text = row.inner_text()
        assert socket.gethostname() in text and "alive" in text
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
