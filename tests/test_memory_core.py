"""memory-core on the real outbox and real embedded Chroma: read-after-write recall."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox import Outbox, Settings, ValidationError, load_settings
from outbox.faces.demo import TURNS
from outbox.memory_core import PROMPT, RESPONSE, THOUGHT, MemoryService, compose_turn, split_turn


@pytest.fixture
def chroma_settings(tmp_path: Path) -> Settings:
    return load_settings(
        env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "md", sinks="chroma"
    )


fields_text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1
).filter(lambda s: s.strip())
labelled = st.one_of(fields_text, st.sampled_from([THOUGHT, RESPONSE, PROMPT, "\n", "a" + THOUGHT]))


@settings(max_examples=200)
@given(labelled, labelled, labelled)
def test_a_turn_splits_back_exactly(prompt: str, thought: str, response: str) -> None:
    content = compose_turn(prompt, thought, response)
    lengths = [len(prompt), len(thought), len(response)]
    assert split_turn(content, lengths) == {
        "prompt": prompt,
        "thought": thought,
        "response": response,
    }


@pytest.mark.parametrize("field", ["prompt", "thought", "response"])
@pytest.mark.parametrize("value", ["", "   \n\t", None])
def test_each_field_is_gated_and_nothing_is_written(
    outbox: Outbox, field: str, value: str | None
) -> None:
    service = MemoryService(outbox)
    args = {"prompt": "p", "thought": "t", "response": "r", field: value}
    with pytest.raises(ValidationError) as err:
        service.add_memory(**args)  # type: ignore[arg-type]
    assert str(err.value).startswith(f"invalid {field}:")
    assert outbox.status()["records"] == 0
    assert not outbox.settings.markdown_dir.exists() or not any(
        outbox.settings.markdown_dir.glob("*.md")
    )


def test_recent_turns_page_newest_first(outbox: Outbox) -> None:
    service = MemoryService(outbox)
    written = [service.add_memory(f"question {i}", "t", f"answer {i}")["id"] for i in range(25)]
    seen: list[str] = []
    cursor = None
    while True:
        page = service.query_recent_turns(limit=10, before=cursor)
        seen += [turn["id"] for turn in page["turns"]]
        cursor = page["nextCursor"]
        if cursor is None:
            break
    assert seen == list(reversed(written))
    other = service.add_memory("elsewhere", "t", "r", session_id="other")["id"]
    only = service.query_recent_turns(session_id="other")
    assert [turn["id"] for turn in only["turns"]] == [other]


def test_read_after_write_then_recall_by_meaning(chroma_settings: Settings) -> None:
    service = MemoryService(Outbox.open(chroma_settings))
    try:
        keys = [service.add_memory(*turn, session_id="s")["id"] for turn in TURNS]
        # Before any embedding: the graph and the lexical leg see each write at once.
        assert service.query_recent_turns(limit=1)["turns"][0]["id"] == keys[-1]
        hit = service.query_raw_memories("nightly backfill cores", n_results=3)["results"][0]
        assert (hit["id"], hit["legs"]) == (keys[3], ["lexical"])

        report = service.outbox.drain(timeout=120)
        assert report.ok, report.to_dict()
        best = service.query_raw_memories(
            "what has to be finished before the application servers come up?", n_results=3
        )["results"][0]
        assert (best["id"], best["source"]) == (keys[0], "vector")
        assert best["response"] == TURNS[0][2]
        # Delivered records leave the pending overlay but stay in the lexical leg.
        leftover = service.outbox.pending_matches("nightly backfill", vector_sink="chroma", limit=5)
        assert leftover == []
        after = service.query_raw_memories("nightly backfill cores", n_results=3)["results"][0]
        assert after["id"] == keys[3]
        assert "lexical" in after["legs"] and "vector" in after["legs"]
    finally:
        service.close()


def test_a_fallback_turn_replays_to_the_same_turn(settings: Settings) -> None:
    locked = replace(settings, busy_timeout=0.2)
    with Outbox.open(locked) as ob:
        service = MemoryService(ob)
        holder = sqlite3.connect(str(settings.home / "outbox.db"), isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            answer = service.add_memory("p: x", "Agent Thought: tricky", "r", session_id="s9")
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert answer["status"] == "fallback"
        assert answer["visibility"]["recencyQueryable"] is False
    with Outbox.open(settings) as ob:
        turn = MemoryService(ob).query_recent_turns(limit=1)["turns"][0]
        assert turn["id"] == answer["id"]
        assert (turn["prompt"], turn["thought"], turn["response"]) == (
            "p: x",
            "Agent Thought: tricky",
            "r",
        )
        assert turn["sessionId"] == "s9"


def test_add_memory_keeps_succeeding_during_a_heavy_backfill(chroma_settings: Settings) -> None:
    backlog = 2000
    with Outbox.open(chroma_settings) as ob:
        ob.add_many(
            {"content": f"backlog memory {i}: " + "words about the nightly rebuild " * 6}
            for i in range(backlog)
        )
    env = dict(os.environ)
    env.update(
        OUTBOX_HOME=str(chroma_settings.home),
        OUTBOX_MARKDOWN_DIR=str(chroma_settings.markdown_dir),
        OUTBOX_SINKS="chroma",
        OUTBOX_POLL_INTERVAL="0.1",
    )
    dispatcher = subprocess.Popen(
        [sys.executable, "-m", "outbox", "run"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        with Outbox.open(chroma_settings) as ob:
            service = MemoryService(ob)
            deadline = time.monotonic() + 120
            while ob.status()["sinks"]["chroma"]["delivered"] < 50:
                assert time.monotonic() < deadline, "the dispatcher never started delivering"
                time.sleep(0.1)
            for i in range(40):
                answer = service.add_memory(f"live question {i}", "thinking", f"live answer {i}")
                assert answer["status"] == "queued"
                newest = service.query_recent_turns(limit=1)["turns"][0]
                assert newest["id"] == answer["id"]
            counts = ob.status()["sinks"]["chroma"]
            assert counts["pending"] + counts["leased"] > 0, "the backfill was not running"
    finally:
        dispatcher.send_signal(signal.SIGTERM)
        code = dispatcher.wait(timeout=60)
    assert code == 0
