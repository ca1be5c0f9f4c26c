"""The write path never imports a sink, a model or chromadb: that separation is the guarantee
that a save cannot wait on them. Checked in a fresh interpreter after a real write."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = (
    "chromadb",
    "onnxruntime",
    "tokenizers",
    "numpy",
    "brainlayer",
    "apsw",
    "mcp",
    "outbox.sinks.chroma",
    "outbox.sinks.brainlayer",
    "outbox.dispatch.dispatcher",
)

SCRIPT = """
import json, sys
from outbox.faces.cli import main
code = main(["add", "a memory written with nothing heavy loaded", "--json"])
heavy = %r
loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
print(json.dumps({"code": code, "loaded": loaded}))
"""


def test_outbox_add_loads_no_sink_model_or_chromadb(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT % (HEAVY,)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "OUTBOX_SINKS": "chroma,brainlayer", "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["code"] == 0
    assert report["loaded"] == []


# -- the façade is the only way in for the command line and memory-core ----------------------

# Attributes of ``Outbox`` that are its insides: the store, its engines and the write path.
FACADE_INSIDES = frozenset({"storage", "reader", "engine", "writer"})


def _facade_users() -> list[Path]:
    """The modules that must reach the outbox through ``Outbox``'s public surface only."""
    package = Path(__file__).resolve().parent.parent / "outbox"
    return [
        package / "memory_core.py",
        # The metrics endpoint reads the dispatcher's own numbers and the store at each scrape.
        *sorted(p for p in (package / "faces").rglob("*.py") if p.name != "metrics.py"),
    ]


def _imported(node: object, package: list[str]) -> list[str]:
    """The dotted names an import statement brings in (relative ones resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _package_of(path: Path) -> list[str]:
    """The package a file sits in, for resolving its relative imports; a file outside the
    package (a self-test's sample) counts as in ``outbox``."""
    parts = path.resolve().parent.parts
    if "outbox" not in parts:
        return ["outbox"]
    return list(parts[len(parts) - 1 - parts[::-1].index("outbox") :])


def _without_type_checking_blocks(tree: ast.Module) -> ast.Module:
    """The module without its ``if TYPE_CHECKING:`` blocks: names imported only for type
    hints (the store's row types the façade returns) reach nothing at run time."""
    tree.body = [
        node
        for node in tree.body
        if not (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        )
    ]
    return tree


def _past_the_facade(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every place in ``path`` that imports the store or touches the
    façade's insides, by attribute or by ``getattr``."""
    package = _package_of(path)
    found: list[tuple[int, str]] = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(_without_type_checking_blocks(tree)):
        line = getattr(node, "lineno", 0)
        names = _imported(node, package)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names.append(f"{node.value.id}.{node.attr}")
        found += [
            (line, name)
            for name in names
            if name in ("outbox.store", "store") or name.startswith("outbox.store.")
        ]
        if isinstance(node, ast.Attribute) and node.attr in FACADE_INSIDES:
            found.append((line, f".{node.attr}"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in FACADE_INSIDES
        ):
            found.append((line, f"getattr .{node.args[1].value}"))
    return found


def test_cli_memory_core_mcp_and_demo_use_only_the_facade() -> None:
    users = _facade_users()
    assert len(users) > 3 and all(path.exists() for path in users)
    offences = {path.name: _past_the_facade(path) for path in users}
    assert {name: found for name, found in offences.items() if found} == {}


def test_the_facade_check_catches_what_it_looks_for(tmp_path: Path) -> None:
    """The scan above is only worth something if it fails on each shape it forbids."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import outbox.store.recall\n"
        "from outbox.store.storage import Storage\n"
        "from outbox.store import recall\n"
        "from outbox import store\n"
        "from .store import wakeup\n"
        "import outbox\n"
        "def f(ob):\n"
        "    return ob.storage, ob.reader, ob.engine, ob.writer, getattr(ob, 'storage')\n"
        "def g():\n"
        "    return outbox.store.recall\n",
        encoding="utf-8",
    )
    found = _past_the_facade(sample)
    assert {line for line, _what in found} == {1, 2, 3, 4, 5, 8, 10}
    assert sorted(what for line, what in found if line == 8) == [
        ".engine",
        ".reader",
        ".storage",
        ".writer",
        "getattr .storage",
    ]


# -- ``import outbox`` stays light --------------------------------------------------------

LIGHT_SCRIPT = """
import json, sys
import {module}
heavy = ("sqlalchemy", "chromadb", "onnxruntime", "mcp", "mcp_types", "brainlayer")
ours = ("outbox.api", "outbox.write", "outbox.store", "outbox.dispatch")
loaded = sorted(
    m for m in sys.modules
    if m.split(".")[0] in heavy or any(m == o or m.startswith(o + ".") for o in ours)
)
print(json.dumps(loaded))
"""

PUBLIC_SCRIPT = """
import json, sys
from outbox import Outbox
import outbox
names = {name: getattr(outbox, name).__module__ for name in outbox.__all__ if name != "Outcome"}
print(json.dumps({"outbox": Outbox.__module__, "sqlalchemy": "sqlalchemy" in sys.modules,
                  "names": names, "dir": sorted(set(outbox.__all__) - set(dir(outbox)))}))
"""


def _python(script: str, cwd: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd)},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_importing_outbox_and_its_leaf_modules_loads_nothing_heavy(tmp_path: Path) -> None:
    for module in ("outbox", "outbox.core.states", "outbox.core.keys", "outbox.sinks.base"):
        loaded = json.loads(_python(LIGHT_SCRIPT.format(module=module), tmp_path))
        assert loaded == [], f"import {module} loaded {loaded}"


def test_every_public_name_still_imports_from_outbox(tmp_path: Path) -> None:
    report = json.loads(_python(PUBLIC_SCRIPT, tmp_path))
    assert report["outbox"] == "outbox.api"
    assert report["sqlalchemy"] is True  # used, so loaded: laziness, not absence
    assert report["names"]["Delivered"] == "outbox.sinks.base"
    assert report["names"]["DeliveryState"] == "outbox.core.states"
    assert report["dir"] == []


# -- which part may import which ------------------------------------------------------------
# The write path never reaches a sink or the dispatcher (so a save cannot wait on a model), a
# sink never imports the dispatcher (it raises the library's own errors instead), and the
# dispatcher never imports the façade (it is handed storage, mirrors, sinks and settings).

PACKAGE = Path(__file__).resolve().parent.parent / "outbox"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def imports(path: Path, *, top_level_only: bool, typing_too: bool) -> set[str]:
    """Modules ``path`` imports: at module level only, or anywhere (lazy imports too);
    with or without those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _package_of(path)
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_block(child) and not typing_too:
                continue
            found.update(_imported(child, package))
            inside = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if not (top_level_only and inside):
                visit(child)

    visit(tree)
    return found


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def reach(start: str) -> set[str]:
    """Every ``outbox`` module that importing ``start`` runs (module-level imports only)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in MODULES:
            continue
        seen.add(name)
        todo.extend(imports(MODULES[name], top_level_only=True, typing_too=False))
    return seen


def under(names: set[str], prefix: str) -> set[str]:
    return {name for name in names if name == prefix or name.startswith(prefix + ".")}


@pytest.mark.parametrize("start", ["outbox.write.writer", "outbox.api", "outbox.write.fallback"])
def test_the_write_path_reaches_no_sink_and_no_dispatcher(start: str) -> None:
    reached = reach(start)
    assert "outbox.write.writer" in reach("outbox.api")  # the scan does follow imports
    assert under(reached, "outbox.sinks") == set()
    assert under(reached, "outbox.dispatch") == set()


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("sinks/*.py")), ids=lambda path: path.name)
def test_no_sink_imports_the_dispatcher(path: Path) -> None:
    found = imports(path, top_level_only=False, typing_too=True)
    assert under(found, "outbox.dispatch") == set()
    assert under(found, "outbox.api") == set()


@pytest.mark.parametrize("path", sorted(PACKAGE.glob("dispatch/*.py")), ids=lambda path: path.name)
def test_the_dispatcher_never_imports_the_facade(path: Path) -> None:
    found = imports(path, top_level_only=False, typing_too=True)
    assert under(found, "outbox.api") == set()
    assert "outbox.Outbox" not in found


def test_the_rules_catch_a_violation(tmp_path: Path) -> None:
    """The scan is not vacuous: a lazy façade import inside a function is found."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from outbox.api import Outbox\n"
        "def f():\n    from outbox.dispatch.retry import RetryPolicy\n",
        encoding="utf-8",
    )
    everything = imports(sample, top_level_only=False, typing_too=True)
    assert under(everything, "outbox.api") and under(everything, "outbox.dispatch")
    assert imports(sample, top_level_only=True, typing_too=False) == {
        "typing",
        "typing.TYPE_CHECKING",
    }


# -- the faces reach no sink ------------------------------------------------------------------
# Recall is a library call (``Outbox.recall``, which opens Chroma's index itself) and delivery
# is ``Outbox.drain()`` / ``Outbox.dispatcher()`` (``outbox drain``, ``run``, ``mcp --drain``,
# the demo), so no face needs a sink: memory-core and every module under ``outbox/faces``
# import nothing under ``outbox.sinks``, not lazily inside a function, not for type hints,
# and not through the ``outbox`` package's own names (``from outbox import Sink``). There is
# no exception today.


def _sink_names() -> set[str]:
    """The names ``outbox`` hands out from ``outbox.sinks`` (``Sink``, ``Delivered``, …)."""
    import outbox

    return {
        f"outbox.{name}" for name, home in outbox._HOMES.items() if under({home}, "outbox.sinks")
    }


def sink_imports(path: Path) -> set[str]:
    """Every sink module or sink name ``path`` imports, anywhere in it."""
    found = imports(path, top_level_only=False, typing_too=True)
    return under(found, "outbox.sinks") | (found & _sink_names())


def _faces() -> list[Path]:
    return [PACKAGE / "memory_core.py", *sorted((PACKAGE / "faces").rglob("*.py"))]


@pytest.mark.parametrize("path", _faces(), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_no_face_imports_a_sink(path: Path) -> None:
    assert sink_imports(path) == set()


def test_recall_loads_its_vector_leg_only_when_called() -> None:
    """Importing the recall use case (as ``Outbox.recall`` does on first use) loads no sink:
    the Chroma sink is imported by the first recall that asks the vector index."""
    reached = reach("outbox.recall.service")
    assert "outbox.recall.fusion" in reached
    assert under(reached, "outbox.sinks") == set()
    assert "outbox.sinks.chroma" in imports(
        MODULES["outbox.recall.service"], top_level_only=False, typing_too=False
    )


def test_the_sink_rule_catches_each_way_in(tmp_path: Path) -> None:
    """Lazy, type-only and package-name imports of a sink are all found; others are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "from outbox import Outbox, Sink\n"
        "if TYPE_CHECKING:\n    from outbox.sinks.base import Delivered\n"
        "def f():\n    import outbox.sinks.chroma\n"
        "    from outbox.core.states import BuiltinSink\n",
        encoding="utf-8",
    )
    assert sink_imports(sample) == {
        "outbox.Sink",
        "outbox.sinks.base",
        "outbox.sinks.base.Delivered",
        "outbox.sinks.chroma",
    }
