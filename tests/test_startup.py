"""The command line imports only what the command it runs uses, so it starts fast.

Checked through ``sys.modules`` of a real process, never by a clock (the timings are in
``benchmarks/startup.py``): ``outbox --help`` loads no database layer, no write path, no
sink and no heavy library; ``outbox add`` on an existing store loads the write path but no
sink, no dispatcher, no migration tool, none of the heavy libraries the other commands
use and, on a store in its steady state, not SQLAlchemy either. A command module that
imported its heavy parts at the top would show up here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outbox import Outbox, Settings
from tests.helpers.subproc import child_env

# What no short command may load: each costs tens to hundreds of milliseconds to import.
HEAVY = (
    "chromadb",
    "onnxruntime",
    "numpy",
    "tokenizers",
    "brainlayer",
    "mcp",
    "prometheus_client",
    "starlette",
    "uvicorn",
    "jinja2",
    "alembic",
    "psycopg",
)

LOADED = """
import json, sys
from outbox.faces.cli import main
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "modules": sorted(sys.modules)}, out)
"""


def loaded_by(args: list[str], cwd: Path, env: dict[str, str]) -> list[str]:
    """The modules a real ``outbox ARGS`` process has loaded when it finishes."""
    out = cwd / "modules.json"
    done = subprocess.run(
        [sys.executable, "-c", LOADED, str(out), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    found = json.loads(out.read_text())
    assert found["code"] == 0, done.stderr.decode()
    return list(found["modules"])


def under(modules: list[str], *packages: str) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


def test_help_loads_no_database_write_path_or_sink(tmp_path: Path) -> None:
    modules = loaded_by(["--help"], tmp_path, child_env(tmp_path / ".outbox"))
    assert "outbox.faces.cli" in modules  # the parser itself did run
    assert under(modules, "sqlalchemy", "sqlite3", "yaml") == []
    assert under(modules, "outbox.api", "outbox.store", "outbox.write", "outbox.mirror") == []
    assert under(modules, "outbox.sinks", "outbox.dispatch") == []
    assert under(modules, *HEAVY) == []


@pytest.mark.parametrize("command", ["add", "run"])
def test_each_command_help_is_as_light(tmp_path: Path, command: str) -> None:
    modules = loaded_by([command, "--help"], tmp_path, child_env(tmp_path / ".outbox"))
    assert under(modules, "sqlalchemy", "outbox.api", "outbox.sinks", *HEAVY) == []


def test_add_loads_the_write_path_and_nothing_it_does_not_use(
    settings: Settings, tmp_path: Path
) -> None:
    with Outbox.open(settings) as ob:  # a store in its steady state: current, repaired
        ob.add("a memory written before the command runs")
        ob.wait_mirrored(10)
        ob.sync_mirrors()
    env = child_env(settings.home, markdown_dir=str(settings.markdown_dir), sinks="chroma")
    modules = loaded_by(["add", "a memory saved from the shell"], tmp_path, env)
    assert "outbox.write.writer" in modules  # the write did run, through the write path
    # Chroma is the configured sink, and still nothing of it is loaded to write.
    assert under(modules, "outbox.sinks", "outbox.dispatch", "outbox.operations.reindex") == []
    assert (
        under(modules, "outbox.faces.metrics", "outbox.faces.ui", "outbox.operations.rebuild") == []
    )
    # Nor the database toolkit: a steady store is written on the bare driver.
    assert under(modules, "sqlalchemy", "outbox.api", "outbox.store.storage", *HEAVY) == []
    with Outbox.open(settings) as ob:
        assert ob.storage.records.count_records() == 2
        assert ob.last_repair is not None and ob.last_repair.lines_appended == 0
