"""The write path never imports a sink, a model or chromadb: that separation is the guarantee
that a save cannot wait on them. Checked in a fresh interpreter after a real write."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
from outbox.cli import main
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
