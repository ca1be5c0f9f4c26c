"""What the daemon and the operator commands say, with real processes: log levels that work
before and after the subcommand, one line per batch that gives a failure's cause without
quoting a memory, errors that name the path or setting to fix, the status table, and the
Prometheus endpoint scraped over HTTP."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from outbox import Outbox, Settings
from outbox.core.states import FallbackReason
from outbox.faces.cli.status import status_text
from outbox.faces.metrics import (
    FAILURE_REASONS,
    FALLBACK_REASONS,
    OTHER,
    OUTCOMES,
    closed_label,
    sink_labels,
)
from outbox.mirror import markdown
from outbox.testing.sinks import FaultySink
from tests.conftest import FAULTY
from tests.helpers.faults import held_write_lock
from tests.helpers.subproc import child_env, run_cli

CANARY = "CANARY-51d0-private-words"


@pytest.fixture
def env(settings: Settings, tmp_path: Path) -> dict[str, str]:
    return child_env(
        settings.home,
        markdown_dir=str(settings.markdown_dir),
        faulty_db=str(tmp_path / "sink.db"),
        poll_interval="0.1",
        heartbeat_interval="0.2",
    )


def _batch_lines(stderr: bytes) -> list[str]:
    return [line for line in stderr.decode().splitlines() if " ms: " in line]


# -- log levels and the batch line ------------------------------------------------------------


def test_verbose_and_quiet_work_after_the_subcommand_as_before_it(
    env: dict[str, str], tmp_path: Path
) -> None:
    def drain(*flags: str) -> subprocess.CompletedProcess[bytes]:
        for n in range(3):
            assert run_cli(["add", f"memory {n} {flags}"], cwd=tmp_path, env=env).returncode == 0
        return run_cli(["drain", "--json"] if not flags else [*flags], cwd=tmp_path, env=env)

    after = drain("drain", "-v", "--json")
    before = drain("-v", "drain", "--json")
    default = drain()
    quiet = run_cli(["status", "-q"], cwd=tmp_path, env=env)
    assert [done.returncode for done in (after, before, default, quiet)] == [0, 0, 0, 0]
    for verbose in (after, before):
        (line,) = _batch_lines(verbose.stderr)
        assert f"{FAULTY}: 3 records in " in line and ": 3 delivered, 0 retrying, 0 dead" in line
        assert b"INFO outbox.faces.cli.delivery: draining sqlite:///" in verbose.stderr
        assert b"drain done in" in verbose.stderr
        assert b"alembic" not in verbose.stderr, "other libraries' INFO needs -vv"
    assert default.stderr == b"", "a drain that went well logs nothing by default"
    assert quiet.stdout.startswith(b"records: 9\n") and quiet.stderr == b""
    refused = run_cli(["status", "-v", "-q"], cwd=tmp_path, env=env)
    assert refused.returncode == 2 and b"not allowed with argument" in refused.stderr


def test_a_failed_batch_says_why_and_names_the_record_not_its_words(
    env: dict[str, str], tmp_path: Path
) -> None:
    failing = {
        **env,
        "OUTBOX_FAULTY_FAIL_RATE": "1",
        "OUTBOX_FAULTY_ERROR": f"Transport closed while sending {CANARY}",
    }
    added = run_cli(["add", "--json", f"a memory that holds {CANARY}"], cwd=tmp_path, env=env)
    key = json.loads(added.stdout)["key"]
    drained = run_cli(["drain"], cwd=tmp_path, env=failing)
    assert drained.returncode == 1
    (line,) = _batch_lines(drained.stderr)
    assert line.startswith("outbox: WARNING ")
    assert "1 record in " in line and "0 delivered, 1 retrying, 0 dead" in line
    assert "failed (1 transport_closed)" in line
    assert f"`outbox dead show {key[:12]}` prints it" in line
    assert CANARY.encode() not in drained.stderr
    # The operator asks for it: status shows the sink's own error, and the record's prefix.
    status = run_cli(["status"], cwd=tmp_path, env=env).stdout.decode()
    assert f"the latest ({key[:12]}, transport_closed): Transport closed while" in status
    report = json.loads(run_cli(["status", "--json"], cwd=tmp_path, env=env).stdout)
    assert report["sinks"][FAULTY]["last_error"]["key"] == key[:12]
    # Refused for good: the dead letter's own line says what to do; dead list shows why.
    poison = run_cli(["add", "--json", f"poison {CANARY}"], cwd=tmp_path, env=env)
    dead_key = json.loads(poison.stdout)["key"]
    dead = run_cli(["drain"], cwd=tmp_path, env={**env, "OUTBOX_FAULTY_REJECT": "poison"})
    assert CANARY.encode() not in dead.stderr
    (said,) = [line for line in dead.stderr.decode().splitlines() if "dead letter:" in line]
    assert f"delivery of {dead_key[:12]} to {FAULTY} failed (rejected)" in said
    assert f"`outbox dead show {dead_key[:12]}`, then retry or discard" in said
    listed = run_cli(["dead", "list"], cwd=tmp_path, env=env).stdout.decode()
    assert f"{dead_key}  {FAULTY}  attempts=1  reason=rejected  error: Rejected: content" in listed


def test_a_drain_after_switching_embedder_names_the_setting_to_fix(tmp_path: Path) -> None:
    """The issue's case: a store built with one embedder, drained with another. The line used
    to say ``failed (unknown); will retry``; it now carries the sink's own advice."""
    from tests.sinks.chroma_support import chroma_settings

    built = chroma_settings(tmp_path, embedding="hashing")
    with Outbox.open(built) as ob:
        ob.add("the first memory, embedded by the hashing model")
        assert ob.drain(timeout=120).ok
        ob.add("the second memory, drained after the switch")
    env = child_env(
        built.home,
        sinks="chroma",
        markdown_dir=str(built.markdown_dir),
        chroma_path=str(built.chroma_path),
        chroma_mode="embedded",
        chroma_collection=built.chroma_collection,
        embedding="minilm",
    )
    drained = run_cli(["drain", "--timeout", "60"], cwd=tmp_path, env=env, timeout=180)
    assert drained.returncode == 1
    (line,) = _batch_lines(drained.stderr)
    assert "failed (1 unknown): EmbeddingMismatch:" in line
    assert "OUTBOX_EMBEDDING gives 'outbox_minilm_l6_v2_int8'" in line
    assert "run `outbox reindex`" in line


# -- errors that name what to fix ---------------------------------------------------------------


def test_outbox_home_that_is_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    afile = tmp_path / "not-a-folder"
    afile.write_text("")
    env = child_env(afile)
    for args in (["add", "a memory with nowhere to go"], ["status"]):
        done = run_cli(args, cwd=tmp_path, env=env)
        assert done.returncode == 2
        assert done.stderr.decode() == (
            f"outbox: bad setting OUTBOX_HOME: {afile} is a file, not a folder; "
            "point OUTBOX_HOME at a folder\n"
        )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["not-a-folder"], "nothing written"
    inside = run_cli(["status"], cwd=tmp_path, env=child_env(afile / "home"))
    assert f"{afile / 'home'} is inside {afile}, which is a file".encode() in inside.stderr


@pytest.mark.parametrize("damage", ["a folder", "garbage"])
def test_status_on_a_database_it_cannot_open_names_the_file(tmp_path: Path, damage: str) -> None:
    home = tmp_path / ".outbox"
    home.mkdir(mode=0o700)
    database = home / "outbox.db"
    if damage == "a folder":
        database.mkdir(mode=0o700)
        cause = "unable to open database file"
    else:
        database.write_bytes(b"this is not SQLite " * 300)
        database.chmod(0o600)
        cause = "file is not a database"
    for args in (["status"], ["dead", "list"]):
        done = run_cli(args, cwd=tmp_path, env=child_env(home))
        assert done.returncode == 1
        (line,) = done.stderr.decode().splitlines()
        assert f"the database {database} ({cause}); " in line, line
        assert "OUTBOX_DB_URL" in line and "Traceback" not in line


def test_the_status_table_fits_long_sink_names_and_counts_discarded(
    settings: Settings, tmp_path: Path
) -> None:
    short = "outbox.testing.sinks:FaultySink"
    settings = replace(settings, sinks=(short,), max_retries=0)
    with Outbox.open(settings) as ob:
        ob.add("poison memory")
        ob.add_many(["kept one", "kept two"])
        sink = FaultySink(tmp_path / "s.db", short)
        sink.reject = "poison"
        assert not ob.drain(sink_objects={short: sink}).ok
        assert ob.dead.discard() == 1
        text = status_text(ob.status())
    header, row = text.splitlines()[1:3]
    assert header.split()[:7] == [
        "sink", "pending", "leased", "delivered", "dead", "discarded", "forgotten"
    ]  # fmt: skip
    assert row.startswith(short + "  ")
    # Every count ends where its heading ends, whatever the sink name's length.
    cells = row[len(short) :].split()[:6]
    assert [int(cell) for cell in cells] == [0, 0, 2, 0, 1, 0]
    for word in header.split()[1:7]:
        end = header.index(word) + len(word)
        assert row[end - 1].isdigit() and row[end] == " ", (word, header, row)


# -- the metrics endpoint -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def daemon(env: dict[str, str], tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = _free_port()
    with (tmp_path / "run.err").open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "outbox", "run", "--metrics-port", str(port)],
            cwd=tmp_path,
            env={**env, "OUTBOX_FAULTY_REJECT": "poison", "OUTBOX_FAULTY_HANG": "0.02"},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    yield process, port
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0


def _scrape(port: int) -> dict[str, float]:
    """Every sample as ``name{label=value,...}`` → value (labels sorted)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _scrape_when_ready(port: int, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _scrape(port)
        except OSError:
            assert time.monotonic() < deadline, "the metrics endpoint never answered"
            time.sleep(0.1)


def test_the_metrics_endpoint_counts_writes_deliveries_and_failures(
    env: dict[str, str], tmp_path: Path, daemon: tuple[subprocess.Popen[bytes], int]
) -> None:
    _process, port = daemon
    before = _scrape_when_ready(port)
    assert before["outbox_up{}"] == 1.0
    assert before.get("outbox_writes_total{reason=,status=queued}", 0.0) == 0.0
    texts = [f"memory {n} scraped" for n in range(4)] + ["poison memory"]
    for text in texts:
        assert run_cli(["add", text], cwd=tmp_path, env=env).returncode == 0
    sink = f"sink={FAULTY}"

    dead = f"outbox_delivery_failures_total{{outcome=dead,reason=rejected,{sink}}}"
    deadline = time.monotonic() + 60
    while True:
        after = _scrape(port)
        # The dead letter is in the database before the daemon counts its batch (the batch
        # observer runs after the settle): wait for both, or a scrape between them fails.
        if (
            after.get(f"outbox_dead_letters{{{sink}}}") == 1.0
            and after.get(f"outbox_deliveries_total{{{sink}}}") == 4.0
            and after.get(dead) == 1.0
        ):
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert after["outbox_writes_total{reason=,status=queued}"] == 5.0
    assert after["outbox_add_seconds_count{}"] == 5.0
    assert 0.0 < after["outbox_add_seconds_sum{}"] < 5 * 60
    assert after[f"outbox_delivery_seconds_count{{{sink}}}"] == 4.0
    assert after[f"outbox_batch_seconds_count{{{sink}}}"] >= 1.0
    assert after[f"outbox_pending{{{sink}}}"] == 0.0
    assert after[f"outbox_oldest_pending_age_seconds{{{sink}}}"] == 0.0
    assert after[f"outbox_delivery_rows{{{sink},state=delivered}}"] == 4.0
    assert after["outbox_records{}"] == 5.0
    assert after["outbox_dispatchers{state=alive}"] == 1.0
    assert after["outbox_fallback_waiting{}"] == 0.0
    said = (tmp_path / "run.err").read_text()
    assert f"metrics on http://127.0.0.1:{port}/metrics" in said


def test_a_forgotten_record_is_counted_apart_from_the_records(
    env: dict[str, str], tmp_path: Path, daemon: tuple[subprocess.Popen[bytes], int]
) -> None:
    """``outbox_records`` is what ``status`` says: the live records; a forget moves one to
    ``outbox_forgotten_records`` as soon as it commits (both are read at the scrape)."""
    _process, port = daemon
    _scrape_when_ready(port)
    keys = []
    for n in range(7):
        done = run_cli(["add", "--json", f"memory {n} to count"], cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr.decode()
        keys.append(json.loads(done.stdout)["key"])
    forgot = run_cli(["forget", keys[0][:12]], cwd=tmp_path, env=env)
    assert forgot.returncode == 0, forgot.stderr.decode()
    scraped = _scrape(port)
    status = json.loads(run_cli(["status", "--json"], cwd=tmp_path, env=env).stdout)
    assert scraped["outbox_records{}"] == status["records"] == 6.0
    assert scraped.get("outbox_forgotten_records{}") == status["forgotten"] == 1.0


def test_a_write_the_database_refused_is_counted_once_by_its_reason(
    env: dict[str, str], tmp_path: Path, daemon: tuple[subprocess.Popen[bytes], int]
) -> None:
    """A fallback write shows while it waits (total and by reason) and counts once as a
    write by its reason; when the daemon imports it, it is not counted again as queued."""
    _process, port = daemon
    assert _scrape_when_ready(port)["outbox_fallback_waiting{}"] == 0.0
    db = Path(env["OUTBOX_HOME"]) / "outbox.db"
    locked = {**env, "OUTBOX_BUSY_TIMEOUT": "0.2"}
    with held_write_lock(db):
        done = run_cli(
            ["add", "--json", "a memory the locked database refused"], cwd=tmp_path, env=locked
        )
        assert done.returncode == 0, done.stderr.decode()
        assert json.loads(done.stdout)["reason"] == "db_busy"
        while_locked = _scrape(port)  # the daemon cannot import it while the lock is held
    assert while_locked["outbox_fallback_waiting{}"] == 1.0
    assert while_locked["outbox_fallback_waiting_by_reason{reason=db_busy}"] == 1.0
    assert while_locked["outbox_writes_total{reason=db_busy,status=fallback}"] == 1.0

    # Imported in a maintenance round: the record is committed first and its file leaves the
    # queue after, so a scrape between the two sees both; the import is done when it has both.
    deadline = time.monotonic() + 60
    while (after := _scrape(port))["outbox_records{}"] < 1.0 or after["outbox_fallback_waiting{}"]:
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert after["outbox_records{}"] == 1.0
    assert after["outbox_writes_total{reason=db_busy,status=fallback}"] == 1.0
    assert after.get("outbox_writes_total{reason=,status=queued}", 0.0) == 0.0


def test_a_fallback_files_free_text_reason_is_counted_as_other_never_shown(
    env: dict[str, str], tmp_path: Path, daemon: tuple[subprocess.Popen[bytes], int]
) -> None:
    """A fallback file's front matter is text anyone with the folder can edit: whatever its
    ``reason`` says (secret words, a newline, quotes, braces), the scrape shows none of it and
    counts the file under ``other``."""
    _process, port = daemon
    _scrape_when_ready(port)
    db = Path(env["OUTBOX_HOME"]) / "outbox.db"
    reason = 'SECRET-label-words "quoted" {x="y"}\nsecond line of the SECRET'
    with held_write_lock(db):
        done = run_cli(
            ["add", "--json", "a memory with an edited reason"],
            cwd=tmp_path,
            env={**env, "OUTBOX_BUSY_TIMEOUT": "0.2"},
        )
        assert done.returncode == 0, done.stderr.decode()
        path = Path(json.loads(done.stdout)["markdown_path"])
        markdown.update_front_matter(path, {"reason": reason})
        assert markdown.read(path)[0]["reason"] == reason
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        scraped = _scrape(port)
    assert "SECRET" not in text
    assert "quoted" not in text
    assert scraped["outbox_fallback_waiting_by_reason{reason=other}"] == 1.0
    assert scraped["outbox_writes_total{reason=other,status=fallback}"] == 1.0
    assert not any("SECRET" in sample for sample in scraped)


@given(st.text(), st.lists(st.text(), max_size=3))
def test_every_label_value_is_from_its_closed_set(value: str, configured: list[str]) -> None:
    """Pure: whatever text reaches a label, the value is one of the label's own words."""
    assert closed_label(value, FALLBACK_REASONS) in FALLBACK_REASONS | {OTHER}
    assert closed_label(value, FAILURE_REASONS) in FAILURE_REASONS | {OTHER}
    assert closed_label(value, OUTCOMES) in OUTCOMES | {OTHER}
    sinks = sink_labels(configured)
    assert closed_label(value, sinks) in sinks | {OTHER}
    assert sinks >= {"chroma", "brainlayer", *configured}
    assert closed_label("db_busy", FALLBACK_REASONS) == "db_busy"
    assert closed_label(FallbackReason.DISK_FULL, FALLBACK_REASONS) == "disk_full"
    assert closed_label(value, frozenset()) == OTHER


def test_a_metrics_port_in_use_is_an_error_naming_it(env: dict[str, str], tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The setting, this time: the same as --metrics-port for every run.
        done = run_cli(["run"], cwd=tmp_path, env={**env, "OUTBOX_METRICS_PORT": str(port)})
    assert done.returncode == 1
    assert done.stderr.decode().splitlines()[-1] == (
        f"outbox: cannot serve metrics on 127.0.0.1:{port} (Address already in use); "
        "pick another port with --metrics-port or OUTBOX_METRICS_PORT"
    )
    bad = run_cli(["run"], cwd=tmp_path, env={**env, "OUTBOX_METRICS_PORT": "70000"})
    assert bad.returncode == 2
    assert bad.stderr == b"outbox: bad setting OUTBOX_METRICS_PORT: must be 0..65535, got 70000\n"
