"""``outbox demo``: the whole loop on the embedded default, in its own folder, in seconds.

Write turns (durable at once, queued for Chroma), recall them before any embedding ran,
drain them into Chroma (the store's own local server) with the offline MiniLM model, then
find one by a paraphrase that shares almost no words with it, and verify the mirrors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from outbox.api import Outbox
from outbox.core.config import load_settings
from outbox.memory_core import MemoryService

TURNS = [
    (
        "What did we decide about deploys?",
        "Recall the release checklist.",
        "The deploy pipeline now waits for the database migration to finish before it starts "
        "the web workers.",
    ),
    (
        "How does Alice like answers?",
        "Style preference from last week.",
        "Alice prefers short answers with the code first and the explanation after it.",
    ),
    (
        "Which storage engine backs the outbox?",
        "Architecture decision record 7.",
        "We chose SQLite in WAL mode with synchronous FULL for the outbox database.",
    ),
    (
        "Why is the build machine slow at night?",
        "Look at the cron table.",
        "The nightly embedding backfill saturates both CPU cores for about forty minutes.",
    ),
    (
        "Where do the staging credentials live?",
        "Ops wiki, secrets page.",
        "Staging credentials are rotated monthly and kept in the team vault, never in git.",
    ),
]
PARAPHRASE = "what has to be finished before the application servers come up?"


def run(folder: Path, say: Callable[[str], None] = print) -> bool:
    """Run the demo in ``folder``; returns whether every step came out as it should."""
    folder = folder.absolute()  # a relative markdown folder would resolve against the root
    settings = load_settings(
        env={}, home=folder / ".outbox", markdown_dir=folder / "decisions", sinks="chroma"
    )
    service = MemoryService(Outbox.open(settings))
    ob = service.outbox
    try:
        say(f"1. Writing {len(TURNS)} turns with add_memory (no model on this path):")
        keys = []
        for prompt, thought, response in TURNS:
            started = time.perf_counter()
            answer = service.add_memory(prompt, thought, response, session_id="demo")
            took = (time.perf_counter() - started) * 1000
            keys.append(answer["id"])
            say(f"   {answer['message'][:60]}…  ({took:.1f} ms, {answer['status']})")
        pending = ob.status()["sinks"]["chroma"]["pending"]
        say(f"2. Before any embedding: {pending} pending for Chroma, and recall already works:")
        newest = service.query_recent_turns(limit=1)["turns"][0]
        say(f"   query_recent_turns → {newest['response'][:70]}…")
        lexical = service.query_raw_memories("nightly backfill", n_results=1)["results"][0]
        say(
            f"   query_raw_memories('nightly backfill') → [{lexical['source']}] "
            f"{lexical['response'][:50]}…"
        )
        say("3. Draining into Chroma (the store's local server) with the offline MiniLM model…")
        started = time.perf_counter()
        report = ob.drain(timeout=120)
        say(f"   delivered {report.delivered} in {time.perf_counter() - started:.1f} s")
        stored = ob.wait_delivered(keys[0], "chroma", timeout=5)
        say(f"   {stored.text}")
        say(f"4. A paraphrase with few shared words: {PARAPHRASE!r}")
        found = service.query_raw_memories(PARAPHRASE, n_results=1)
        best = found["results"][0] if found["results"] else {"id": None, "source": None}
        if best["id"] is None:  # say so, never a traceback: the demo then ends incomplete
            say(f"   → nothing found ({found.get('degraded') or 'no memory above the floor'})")
        else:
            say(f"   → [{best['source']}] {best['response']}")
        check = ob.verify()
        say(
            f"5. outbox verify: {'OK' if check.ok else 'MISMATCH'} ({check.records} records, "
            f"{check.jsonl_lines} JSONL lines, {check.markdown_files} markdown files in "
            f"{settings.markdown_dir})"
        )
        return report.ok and best["id"] == keys[0] and best["source"] == "vector" and check.ok
    finally:
        service.close()
