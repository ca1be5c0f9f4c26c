"""Does every dashboard page answer in under 200 ms with 100,000 records in the store?

    .venv/bin/python -m benchmarks.ui                 # 100,000 records (about 2 minutes)
    .venv/bin/python -m benchmarks.ui --records 5000  # a smoke run

One store is filled through the storage's own insert (as ``benchmarks/bulk.py`` does, plus
sessions, agents and tags): 500 sessions, 8 agents of which one is rare, a common and a rare
tag. Its deliveries are then spread over the last hour as a running store's are: most
delivered, some pending, some retrying after a failure, some dead. The JSONL log gets the
accepted and delivered lines of every record (the memory page reads it), with no chain: only
its size matters here. Then a real ``outbox ui`` process serves the store, and each page is
fetched over HTTP, in alternating rounds, after a warm-up: the figures include the server,
the templates and the network stack, as a browser sees them. Results go to
``benchmarks/results/ui.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from benchmarks.common import bench_settings, memory_text, open_outbox, outbox_environ, percentile
from outbox import Settings
from outbox.core.record import build_record
from outbox.core.slugs import markdown_filename
from outbox.mirror.jsonl import accepted_event
from outbox.store.engine import make_engine
from outbox.store.sqlite_writes import sqlite_path
from outbox.store.storage import Storage

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "ui.json"
GOAL_MS = 200.0
SINK = "outbox.testing.sinks:NoopSink"
AGENTS = ("planner", "coder", "reviewer", "tester", "writer", "ops", "researcher")
RARE_AGENT, RARE_TAG, COMMON_TAG = "auditor", "incident", "turn"
SESSIONS = 500


def fill(settings: Settings, count: int, *, seed: int = 11) -> float:
    """Write ``count`` records with sessions, agents and tags, then give their deliveries
    the states and times of a store that has been delivering for the last hour; returns
    seconds taken."""
    began = time.perf_counter()
    rng = random.Random(seed)
    db = sqlite_path(settings.db_url)
    assert db is not None
    engine = make_engine(settings)
    storage = Storage(engine)
    now = time.time()
    log_lines: list[str] = []
    try:
        with engine.begin() as conn:
            for number in range(count):
                agent = RARE_AGENT if number % 997 == 0 else rng.choice(AGENTS)
                tags = [COMMON_TAG, f"agent:{agent}"] + ([RARE_TAG] if number % 1009 == 0 else [])
                record = build_record(
                    memory_text(number, rng, 400),
                    tags=tags,
                    metadata={"session_id": f"s-{number % SESSIONS}", "agent": agent},
                    timestamp=datetime.fromtimestamp(now - 7200 + number * 7200 / count, UTC),
                )
                name = markdown_filename(record.timestamp, record.slug)
                seq = storage.records.insert_record(
                    conn,
                    record,
                    sinks=settings.sinks,
                    markdown_name=name,
                    origin="ui-bench",
                    now=now,
                )
                log_lines.append(json.dumps(accepted_event(record, seq or 0, name, [])))
                log_lines.append(json.dumps({"event": "delivered", "key": record.key}))
        _spread_deliveries(db, now, rng)
    finally:
        engine.dispose()
    settings.jsonl_path.write_text("\n".join(log_lines) + "\n", encoding="utf-8")
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return time.perf_counter() - began


def _spread_deliveries(db: Path, now: float, rng: random.Random) -> None:
    """94 % delivered over the last hour, 4 % pending, 1 % retrying, 1 % dead."""
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        ids = [row[0] for row in conn.execute("SELECT id FROM deliveries")]
        changes: list[tuple[Any, ...]] = []
        for delivery_id in ids:
            roll = rng.random()
            at = now - rng.random() * 3600
            if roll < 0.94:
                change = ("delivered", 1, at, None, None, f"noop-{delivery_id}", at, at)
            elif roll < 0.98:
                continue
            elif roll < 0.99:
                change = ("pending", 2, at + 30, "Transport closed", "transport_closed", None,
                          None, at)  # fmt: skip
            else:
                change = ("dead", 10, at, "rejected: too long", "rejected", None, None, at)
            changes.append((*change, delivery_id))
        conn.executemany(
            "UPDATE deliveries SET state = ?, attempts = ?, available_at = ?, last_error = ?, "
            "error_class = ?, sink_id = ?, delivered_at = ?, updated_at = ? WHERE id = ?",
            changes,
        )


# Pages a person opens, with the worst cases of each filter: a tag or agent that matches
# nothing makes the query read the most before it can answer.
def pages(settings: Settings, count: int) -> dict[str, str]:
    db = sqlite_path(settings.db_url)
    assert db is not None
    with contextlib.closing(sqlite3.connect(db)) as conn:
        newest = conn.execute("SELECT key FROM records ORDER BY seq DESC LIMIT 1").fetchone()[0]
        oldest = conn.execute("SELECT key FROM records ORDER BY seq LIMIT 1").fetchone()[0]
        middle = conn.execute(
            "SELECT ts, key FROM records ORDER BY seq LIMIT 1 OFFSET ?", (count // 2,)
        ).fetchone()
    return {
        "overview": "/",
        "memories": "/memories",
        "memories, a page half-way down": "/memories?" + urlencode({"before": "|".join(middle)}),
        "memories of one session": "/memories?session=s-7",
        "memories of a rare agent": f"/memories?agent={RARE_AGENT}",
        "memories of an unknown agent": "/memories?agent=nobody",
        "memories with a common tag": f"/memories?tag={COMMON_TAG}",
        "memories with a rare tag": f"/memories?tag={RARE_TAG}",
        "memories with an unknown tag": "/memories?tag=nothing-has-it",
        "search (lexical leg)": "/memories?q=dispatcher+lease+retry+backoff",
        "search for one memory": f"/memories?q=note+{count // 3}",
        "a memory (newest: its log lines at the end)": f"/memories/{newest}",
        "a memory (oldest: its log lines at the start)": f"/memories/{oldest}",
        "dead letters": "/dead",
    }


@contextlib.contextmanager
def served(settings: Settings) -> Iterator[tuple[int, str]]:
    """A real ``outbox ui`` on the store: (port, session token)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox", "ui", "--port", "0"],
        cwd=settings.home.parent,
        env=outbox_environ(settings),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            found = re.search(r"http://127\.0\.0\.1:(\d+)/\?token=([\w-]+)", line)
            if found:
                yield int(found.group(1)), found.group(2)
                break
        else:
            raise RuntimeError("outbox ui printed no address")
    finally:
        process.terminate()
        process.wait(timeout=30)


def fetch(port: int, cookie: str, path: str) -> float:
    """Milliseconds from sending the request to the last byte of a 200 answer."""
    began = time.perf_counter()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Cookie": cookie})
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer.read()
        assert answer.status == 200, (path, answer.status)
    return (time.perf_counter() - began) * 1000


def measure(port: int, token: str, paths: dict[str, str], rounds: int) -> dict[str, Any]:
    cookie = f"outbox_ui_{port}={token}"
    for path in paths.values():  # warm-up: connections, templates, page cache
        for _ in range(3):
            fetch(port, cookie, path)
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):  # alternating, so a noisy neighbour hits every page alike
        for name, path in paths.items():
            samples[name].append(fetch(port, cookie, path))
    return {
        name: {
            "path": paths[name],
            "median_ms": round(percentile(values, 0.5), 1),
            "p95_ms": round(percentile(values, 0.95), 1),
            "max_ms": round(max(values), 1),
            "under_goal": percentile(values, 0.95) < GOAL_MS,
        }
        for name, values in samples.items()
    }


def screenshots(port: int, token: str, folder: Path, memory: str) -> list[Path]:
    """The pages as Chromium draws them, for the docs (Debian's Chromium, headless)."""
    from playwright.sync_api import sync_playwright

    shots = {
        "ui-overview.png": "/",
        "ui-memories.png": "/memories",
        "ui-memory.png": f"/memories/{memory}",
        "ui-dead-letters.png": "/dead",
    }
    folder.mkdir(parents=True, exist_ok=True)
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
    with tempfile.TemporaryDirectory() as profile, sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path="/usr/bin/chromium", headless=True, args=flags,
            viewport={"width": 1280, "height": 800},
        )  # fmt: skip
        page = context.new_page()
        page.goto(f"http://127.0.0.1:{port}/?token={token}")
        for name, path in shots.items():
            page.goto(f"http://127.0.0.1:{port}{path}")
            page.screenshot(path=str(folder / name))
        context.close()
    return [folder / name for name in shots]


SHOWCASE = (
    ("We chose SQLite in WAL mode with synchronous FULL: a save is durable when add returns.",
     ["decision", "storage"], "planner"),
    ("Deploys go out on Tuesdays after the canary has been green for an hour.", ["ops"], "ops"),
    ("The <script>alert(1)</script> in this memory is shown as text, never run.",
     ["security"], "reviewer"),
)  # fmt: skip


def showcase(settings: Settings) -> str:
    """A few memories written through ``add`` (so they have their markdown file and log
    lines) at the top of the list; returns the key of the first."""
    with open_outbox(settings) as ob:
        keys = [
            ob.add(text, importance=7, tags=tags,
                   metadata={"session_id": "s-demo", "agent": agent}).key
            for text, tags, agent in SHOWCASE
        ]  # fmt: skip
    return keys[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dir", type=Path, help="scratch folder (default: a temporary one)")
    parser.add_argument("--screenshots", type=Path, help="also save each page as a PNG here")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        folder = args.dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        settings = bench_settings(folder / "store", sinks=SINK)
        open_outbox(settings).close()
        built = fill(settings, args.records)
        os.chmod(settings.jsonl_path, 0o600)
        memory = showcase(settings)
        print(f"filled {args.records:,} records in {built:.1f} s", flush=True)
        with served(settings) as (port, token):
            results = measure(port, token, pages(settings, args.records), args.rounds)
            shots = screenshots(port, token, args.screenshots, memory) if args.screenshots else []
    width = max(map(len, results))
    print(
        f"{'page':<{width}}  median  p95     max   (ms, {args.rounds} rounds, goal {GOAL_MS:.0f})"
    )
    for name, row in results.items():
        mark = "ok" if row["under_goal"] else "OVER"
        figures = f"{row['median_ms']:>6}  {row['p95_ms']:>6}  {row['max_ms']:>6}"
        print(f"{name:<{width}}  {figures}  {mark}")
    for shot in shots:
        print(f"screenshot: {shot}")
    RESULTS.write_text(
        json.dumps(
            {
                "when": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "load_average": os.getloadavg(),
                "records": args.records,
                "rounds": args.rounds,
                "goal_ms": GOAL_MS,
                "pages": results,
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )


if __name__ == "__main__":
    main()
