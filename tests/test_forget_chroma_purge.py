"""Issue 21, case 5: after ``outbox forget`` and the drain that deletes the document, no file
under the Chroma folder still holds its words or its tag (Chroma's log, its collection schema,
its full-text index, free pages), and none does after 100 more deliveries and a restart.

Real processes and real files: the ``outbox`` command delivers into the library's shared
shared Chroma server (the default) or its embedded child, and every file is read byte for
byte. Recall by meaning still works afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from outbox import Outbox, load_settings
from tests.chroma_server import shared_server_processes, stop_shared_server
from tests.helpers.subproc import child_env, run_cli
from tests.test_forget import OTHERS, holding, outbox_files

SECRET = "The lab door code is periwinkle-axolotl-quarzite, shared with nobody."
TAG = "zanzibarvault"  # a tag only the secret memory carries
# Words no key, hash or timestamp can spell by chance (a four-digit word turned up in the
# hex of a later record's key: a false alarm about one run in ten).
WORDS = (b"periwinkle", b"axolotl", b"quarzite", TAG.encode())
FILLER = "Routine note number {} about the weekly grocery list and the garden hose."


def _key(result: object) -> str:
    assert getattr(result, "returncode", 1) == 0, getattr(result, "stderr", b"")
    return str(json.loads(getattr(result, "stdout", b"{}"))["key"])


@pytest.mark.parametrize("mode", ["server", "embedded"])
def test_forgotten_words_leave_every_chroma_file(tmp_path: Path, mode: str) -> None:
    home, md = tmp_path / ".outbox", tmp_path / "md"
    env = child_env(home, sinks="chroma", markdown_dir=str(md), chroma_mode=mode)
    settings = load_settings(env=env, home=home)
    chroma = settings.chroma_path
    assert chroma.is_relative_to(home)  # the scans below cover it
    try:
        secret = _key(run_cli(["add", SECRET, "--tag", TAG, "--json"], cwd=tmp_path, env=env))
        kept = [_key(run_cli(["add", text, "--json"], cwd=tmp_path, env=env)) for text in OTHERS]
        drained = run_cli(["drain", "--timeout", "300"], cwd=tmp_path, env=env, timeout=400)
        assert drained.returncode == 0, drained.stderr
        assert holding(outbox_files(chroma), WORDS), "control: Chroma's files hold the words"

        assert run_cli(["forget", secret[:12]], cwd=tmp_path, env=env).returncode == 0
        drained = run_cli(["drain", "--timeout", "300"], cwd=tmp_path, env=env, timeout=400)
        assert drained.returncode == 0 and b"deleted 1" in drained.stdout, drained.stdout
        assert holding(outbox_files(home, md), WORDS) == []

        with Outbox.open(settings) as ob:  # 100 more deliveries, through this process
            ob.add_many([FILLER.format(number) for number in range(100)])
            assert ob.drain(timeout=300).ok
        assert holding(outbox_files(home, md), WORDS) == []

        if mode == "server":  # a restart: the next use starts a fresh server on the folder
            stop_shared_server(chroma)
            assert not shared_server_processes(chroma)
        with Outbox.open(settings) as ob:  # embedded: a fresh child opens the folder
            answer = ob.recall("Which answer style suits Alice?", limit=3, min_relevance=0.0)
            (hit, *_) = answer.hits
            assert hit.key == kept[1] and "vector" in hit.legs
            assert secret not in [found.key for found in ob.recall(SECRET).hits]
        assert holding(outbox_files(home, md), WORDS) == []
    finally:
        stop_shared_server(chroma)
