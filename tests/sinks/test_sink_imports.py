"""What importing the sink interface costs: a custom sink's module and the registry must not
drag in a sink library, a model runtime or pytest (the conformance suite needs pytest, so
only a test imports it)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("chromadb", "onnxruntime", "tokenizers", "brainlayer", "apsw", "mcp", "httpx", "pytest")
LIGHT = (
    "outbox",
    "outbox.testing",
    "outbox.testing.sinks",
    "outbox.sinks.base",
    "outbox.sinks.registry",
    "outbox.dispatch.classify",
    "outbox.sinks.chroma",
    "outbox.sinks.brainlayer",
    "outbox.sinks.brainlayer_mcp",
)

SCRIPT = """
import importlib, json, sys
for name in %r:
    importlib.import_module(name)
heavy = %r
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""


def test_the_sink_interface_loads_no_sink_library_and_no_pytest() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT % (LIGHT, HEAVY)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
