"""Helpers for the BrainLayer sink's tests, both modes: settings and a memory BrainLayer
refuses for good."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outbox import Outbox, Settings, load_settings
from tests.brainlayer_env import BrainLayerEnv

# A JSON-RPC message pasted as a memory: BrainLayer refuses to store MCP traffic for good
# (its ingest guard, "recursive MCP output"), in process and through brain_store alike.
POISON = '{"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": "hi"}]}}'
TS = "2026-11-29T08:00:00Z"
CANONICAL_TS = "2026-11-29T08:00:00.000000Z"


def bl_settings(tmp_path: Path, env: BrainLayerEnv, **overrides: object) -> Settings:
    """Settings delivering to BrainLayer at ``env``, with everything else in ``tmp_path``."""
    return load_settings(
        env={},
        home=tmp_path / ".outbox",
        markdown_dir=tmp_path / "md",
        sinks="brainlayer",
        brainlayer_db=env.db,
        **overrides,
    )


def row_of(ob: Outbox, key: str) -> Any:
    """The one delivery row of ``key``."""
    (row,) = ob.deliveries_of([key])[key]
    return row
