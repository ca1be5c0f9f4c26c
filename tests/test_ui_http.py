"""``outbox ui`` over plain HTTP, no browser: every page needs the session token, a request
without it (or from another site) changes nothing, a foreign Host is refused, memory text
is escaped, and the command fails with one clear line when it cannot serve."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox import Outbox
from outbox.faces.ui.access import local_path
from tests.helpers.subproc import child_env, run_cli
from tests.ui_browser import UiServer, start_ui, stop_ui, ui_fixture, ui_settings  # noqa: F401

SCRIPT = "<script>alert(1)</script> was in a memory"


def make_dead_letter(server: UiServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """One memory the fault-injection sink rejects for good: a dead letter."""
    monkeypatch.setenv("OUTBOX_FAULTY_REJECT", "poison")
    with server.open() as ob:
        key = ob.add("a poison memory the sink refuses").key
        ob.drain(timeout=20)
        assert [row.state for row in ob.deliveries_of([key])[key]] == ["dead"]
    monkeypatch.delenv("OUTBOX_FAULTY_REJECT")
    return key


def states(server: UiServer, key: str) -> list[str]:
    with server.open() as ob:
        return [row.state for row in ob.deliveries_of([key])[key]]


def form_token(server: UiServer, path: str = "/dead") -> str:
    status, _headers, body = server.request("GET", path, headers={"Cookie": server.cookie})
    assert status == 200
    found = re.search(r'name="csrf" value="([0-9a-f]{64})"', body)
    assert found, "no form token on the page"
    return found.group(1)


def test_every_page_needs_the_session_token(ui: UiServer) -> None:
    for path in ("/", "/memories", "/dead", "/memories/abc"):
        status, headers, body = ui.request("GET", path)
        assert status == 403, path
        assert "session token" in body
        assert "content-security-policy" in headers
    assert ui.request("GET", "/?token=not-the-token")[0] == 403

    status, headers, _body = ui.request("GET", f"/memories?tag=x&token={ui.token}")
    assert status == 303
    assert headers["location"] == "/memories?tag=x"  # the token leaves the address bar
    cookie = headers["set-cookie"]
    assert cookie.startswith(f"outbox_ui_{ui.port}={ui.token};")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie

    status, headers, body = ui.request("GET", "/", headers={"Cookie": ui.cookie})
    assert status == 200 and "<h1>Overview</h1>" in body
    assert "script-src 'self'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY"
    # The static files carry no secret and need no token.
    assert ui.request("GET", "/static/ui.css")[0] == 200


def test_a_request_without_the_token_changes_nothing(
    ui: UiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = make_dead_letter(ui, monkeypatch)
    with ui.open() as ob:
        kept = ob.add("a memory nobody may forget without the token").key
    csrf = form_token(ui)
    origin = f"http://127.0.0.1:{ui.port}"
    everything = urlencode({"all": "1", "csrf": csrf})
    refused = [
        # no cookie at all, with or without the form token
        ("POST", "/dead/retry", everything, {"Origin": origin}),
        ("POST", f"/memories/{kept}/forget", urlencode({"csrf": csrf}), {"Origin": origin}),
        # the cookie, but no form token or a wrong one
        ("POST", "/dead/discard", "all=1", {"Cookie": ui.cookie, "Origin": origin}),
        ("POST", "/dead/discard", "all=1&csrf=" + "0" * 64, {"Cookie": ui.cookie}),
        ("POST", f"/memories/{kept}/forget", "", {"Cookie": ui.cookie, "Origin": origin}),
        # cookie and form token, sent from another site
        ("POST", "/dead/discard", everything, {"Cookie": ui.cookie, "Origin": "http://evil.test"}),
        ("POST", "/dead/discard", everything, {"Cookie": ui.cookie, "Origin": "null"}),
        ("POST", "/dead/discard", everything,
         {"Cookie": ui.cookie, "Referer": "http://127.0.0.1:1/attack"}),
    ]  # fmt: skip
    for method, path, body, headers in refused:
        status, _headers, text = ui.request(method, path, body=body, headers=headers)
        assert status == 403, (path, headers, text)
    # Actions are POST only: a GET (an <img> on another page) reaches no action.
    for path in ("/dead/retry?all=1", f"/memories/{kept}/forget"):
        assert ui.request("GET", path, headers={"Cookie": ui.cookie})[0] == 405
    assert states(ui, dead) == ["dead"]
    with ui.open() as ob:
        assert ob.catalog.show(kept).record.record.content.startswith("a memory nobody")

    # The same request with the token, from the dashboard itself, does change it.
    status, headers, _text = ui.request(
        "POST", "/dead/retry", body=everything, headers={"Cookie": ui.cookie, "Origin": origin}
    )
    assert status == 303 and "Retried+1+dead+letter" in headers["location"]
    assert states(ui, dead) == ["pending"]


def _same_origin_path(location: str) -> bool:
    """A Location a browser can only read as a path on this server: one ``/``, then neither
    another slash nor a backslash (which browsers read as a slash), nor a scheme."""
    return re.fullmatch(r"/(?![/\\])[^\s\\]*", location) is not None


def test_no_redirect_leaves_the_dashboards_origin(
    ui: UiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token visit redirects to the path without the token: a path that starts like a
    scheme-relative URL (``//host``, ``/\\host``, ``%2F%2Fhost``) or an absolute-form target
    must still come back as a path on this server, without the token."""
    assert _same_origin_path("/memories?tag=x")
    assert not _same_origin_path("//evil.example/")
    assert not _same_origin_path("/\\evil.example")
    targets = [
        f"//evil.example/?token={ui.token}",
        f"//evil.example?token={ui.token}&tag=x",
        f"///evil.example/?token={ui.token}",
        f"/\\evil.example?token={ui.token}",
        f"/\\/evil.example?token={ui.token}",
        f"/%2F%2Fevil.example?token={ui.token}",
        f"/%5C%5Cevil.example?token={ui.token}",
        f"/%09/evil.example?token={ui.token}",
        f"https://evil.example/?token={ui.token}",
        f"/https://evil.example/?token={ui.token}",
    ]
    for target in targets:
        status, headers, _body = ui.request("GET", target)
        assert status == 303, target
        location = headers["location"]
        assert _same_origin_path(location), (target, location)
        assert ui.token not in location and "token=" not in location, (target, location)
        assert headers["set-cookie"].startswith(f"outbox_ui_{ui.port}={ui.token};")
    # The redirects after an action stay on the dashboard too.
    make_dead_letter(ui, monkeypatch)
    origin = f"http://127.0.0.1:{ui.port}"
    body = urlencode({"all": "1", "csrf": form_token(ui), "sink": "//evil.example"})
    status, headers, _text = ui.request(
        "POST", "/dead/discard", body=body, headers={"Cookie": ui.cookie, "Origin": origin}
    )
    assert status == 303 and _same_origin_path(headers["location"]), headers["location"]


@given(st.text())
def test_a_redirect_target_is_always_a_local_path(target: str) -> None:
    """Pure: whatever path a request names, the redirect goes to a path on this server."""
    location = local_path(target)
    assert location.startswith("/")
    assert location[1:2] not in ("/", "\\") and not (location[1:2] or "a") <= " "
    assert location.lstrip("/\\") in target


def test_a_foreign_host_name_is_refused(ui: UiServer) -> None:
    """A DNS-rebinding page reaches the server under its own name: refused before the
    token is even looked at."""
    for host in (f"evil.test:{ui.port}", "127.0.0.1:1", ""):
        status, _headers, body = ui.request("GET", "/", headers={"Host": host, "Cookie": ui.cookie})
        assert status == 400, host
        assert "Host" in body
    assert (
        ui.request("GET", "/", headers={"Host": f"localhost:{ui.port}", "Cookie": ui.cookie})[0]
        == 200
    )


def test_memory_text_is_escaped_on_every_page(
    ui: UiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUTBOX_FAULTY_REJECT", "<script>")
    with ui.open() as ob:
        key = ob.add(SCRIPT, tags=["<b>tag</b>"], metadata={"agent": "<i>agent</i>"}).key
        ob.drain(timeout=20)
    for path in ("/memories", f"/memories/{key}", "/dead", "/memories?tag=%3Cb%3Etag%3C/b%3E"):
        status, _headers, body = ui.request("GET", path, headers={"Cookie": ui.cookie})
        assert status == 200, path
        assert "<script>alert" not in body and "<b>tag" not in body and "<i>agent" not in body
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in body, path


def test_an_unknown_or_ambiguous_key_is_one_clear_page(ui: UiServer) -> None:
    status, _headers, body = ui.request("GET", "/memories/abcdef", headers={"Cookie": ui.cookie})
    assert status == 404 and "no record with a key starting abcdef" in body
    status, _headers, body = ui.request("GET", "/memories/xyz", headers={"Cookie": ui.cookie})
    assert status == 400 and "hex digits" in body


def test_no_store_is_one_clear_error(tmp_path: Path) -> None:
    result = run_cli(["ui", "--port", "0"], cwd=tmp_path, env=child_env(home=tmp_path / "none"))
    assert result.returncode == 1
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1 and "no outbox store" in lines[0]
    assert not (tmp_path / "none").exists()


def test_a_port_in_use_is_one_clear_error(tmp_path: Path) -> None:
    settings = ui_settings(tmp_path)
    Outbox.open(settings).close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_cli(
            ["ui", "--port", str(port)],
            cwd=tmp_path,
            env=child_env(home=settings.home, markdown_dir=str(settings.markdown_dir)),
        )
    assert result.returncode == 1
    assert result.stderr.decode().splitlines() == [
        f"outbox: port {port} on 127.0.0.1 is in use; choose another with --port"
    ]


def test_a_non_loopback_address_warns_loudly(tmp_path: Path) -> None:
    """127.0.0.2 is still this machine, but not an address the dashboard trusts as
    loopback: it says so, and then answers to any Host name (the token still guards)."""
    settings = ui_settings(tmp_path)
    Outbox.open(settings).close()
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox", "ui", "--port", "0", "--host", "127.0.0.2"],
        cwd=tmp_path,
        env=child_env(home=settings.home, markdown_dir=str(settings.markdown_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.readline()
        assert process.stdout.readline().strip().startswith("http://127.0.0.2:")
        warning = [process.stderr.readline() for _ in range(3)]
        assert all(text.startswith("outbox ui: WARNING:") for text in warning)
        assert "not on loopback" in warning[0] and "plain HTTP" in warning[2]
    finally:
        process.terminate()
        process.communicate(timeout=30)


def test_sigterm_stops_the_server_cleanly(tmp_path: Path) -> None:
    settings = ui_settings(tmp_path)
    Outbox.open(settings).close()
    server = start_ui(tmp_path, settings)
    assert server.request("GET", "/", headers={"Cookie": server.cookie})[0] == 200
    stderr = stop_ui(server)
    assert server.process.returncode == 0, stderr
    assert "Traceback" not in stderr


def test_the_wheel_ships_the_templates_and_static_files(tmp_path: Path) -> None:
    """Nothing is fetched at run time, so everything the pages use must be in the wheel."""
    import zipfile

    from tests.helpers.subproc import REPO

    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("memory_outbox-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    package = REPO / "outbox" / "faces" / "ui"
    shipped = {
        path.relative_to(REPO).as_posix()
        for folder in ("templates", "static")
        for path in (package / folder).iterdir()
    }
    assert len(shipped) >= 9 and shipped <= names


def test_the_overview_counts_the_records_the_memories_page_lists(ui: UiServer) -> None:
    """After forgetting one of seven, the overview's figure is the six the memories page
    lists, and the forgotten one has a figure of its own."""
    with ui.open() as ob:
        keys = [ob.add(f"memory number {n} on the dashboard").key for n in range(7)]
        ob.forget(keys[2])
    headers = {"Cookie": ui.cookie}
    status, _headers, overview = ui.request("GET", "/", headers=headers)
    assert status == 200
    figures = dict(
        (label, int(figure))
        for figure, label in re.findall(
            r'<span class="figure">(\d+)</span><span>([a-z ]+)</span>', overview
        )
    )
    status, _headers, memories = ui.request("GET", "/memories", headers=headers)
    assert status == 200
    listed = len(re.findall(r'<a href="/memories/[0-9a-f]{64}">', memories))
    assert listed == 6
    assert figures["records"] == listed
    assert figures["forgotten"] == 1


def test_a_lost_database_is_one_clear_page_and_is_not_created(tmp_path: Path) -> None:
    """The database deleted while its log names a record: every page says to run `outbox
    rebuild` (503), never an empty store, and nothing creates an empty database file."""
    settings = ui_settings(tmp_path)
    with Outbox.open(settings) as ob:
        key = ob.add("a memory whose database is then lost").key
    for leftover in settings.home.glob("outbox.db*"):
        leftover.unlink()
    server = start_ui(tmp_path, settings)
    try:
        for path in ("/", "/memories", "/memories?q=memory", f"/memories/{key[:12]}", "/dead"):
            status, _headers, body = server.request("GET", path, headers={"Cookie": server.cookie})
            assert status == 503, path
            assert "outbox rebuild" in body and "holds none of the records" in body, path
    finally:
        stop_ui(server)
    assert not list(settings.home.glob("outbox.db*"))
