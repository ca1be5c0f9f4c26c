"""The layer contracts in pyproject.toml hold, and each one fails when an import breaks it.

`.ci/run` runs ``lint-imports`` before the tests; these tests run the same checker on the real
package and on a copy with one forbidden import planted, so a contract that stopped catching
anything (a typo in a module name, a layer left out) fails here instead of passing silently.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``root``, with the repository's contracts."""
    return subprocess.run(
        [str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "HOME": str(root)},
    )


def test_the_package_keeps_every_contract() -> None:
    result = _lint(REPO)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "BROKEN" not in result.stdout
    assert result.stdout.count("KEPT") >= 5


# (module to plant the import in, the module it imports, how the broken contract's name starts)
PLANTED = [
    ("outbox.store.records", "outbox.api", "Layers"),
    ("outbox.core.keys", "outbox.faces.cli", "Layers"),
    ("outbox.mirror.jsonl", "outbox.write.writer", "Layers"),
    ("outbox.write.writer", "outbox.sinks.registry", "The write path"),
    ("outbox.sinks.registry", "outbox.dispatch.retry", "A sink imports"),
    ("outbox.faces.cli.common", "outbox.store.storage", "Faces reach"),
    ("outbox.memory_core", "outbox.sinks.base", "memory-core imports"),
]


@pytest.fixture(scope="module")
def copy_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("contracts")
    shutil.copytree(REPO / "outbox", root / "outbox", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(("source", "imported", "contract"), PLANTED, ids=[p[0] for p in PLANTED])
def test_a_planted_import_breaks_its_contract(
    copy_root: Path, source: str, imported: str, contract: str
) -> None:
    """Planted inside a function: a lazy import counts as much as one at the top."""
    target = copy_root / (source.replace(".", "/") + ".py")
    original = target.read_text(encoding="utf-8")
    planted = f"{original}\n\ndef _planted() -> None:\n    import {imported}  # noqa\n"
    target.write_text(planted, encoding="utf-8")
    try:
        result = _lint(copy_root)
    finally:
        target.write_text(original, encoding="utf-8")
    assert result.returncode != 0
    sections = _broken_sections(result.stdout)
    found = [body for name, body in sections.items() if name.startswith(contract)]
    assert found, result.stdout[-3000:]
    assert f"{source} -> {imported}" in found[0], result.stdout[-3000:]


def _broken_sections(report: str) -> dict[str, str]:
    """Each broken contract's name and what the checker says about it (a name is the line
    above a rule of dashes as long as it)."""
    lines = report.split("Broken contracts", 1)[-1].splitlines()
    sections: dict[str, str] = {}
    name = ""
    for line, below in zip(lines, [*lines[1:], ""], strict=True):
        if below and set(below) == {"-"} and len(below) == len(line):
            name = line
            sections[name] = ""
        elif name:
            sections[name] += line + "\n"
    return sections
