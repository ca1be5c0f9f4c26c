"""Fixtures shared by the sink tests: real Chroma servers and a real BrainLayer folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.brainlayer_env import BrainLayerEnv, setup_brainlayer
from tests.chroma_server import ChromaServer


@pytest.fixture(scope="module")
def chroma_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChromaServer]:
    """One server per test module, shared by its tests (each uses its own collection)."""
    with ChromaServer(tmp_path_factory.mktemp("chroma-server") / "data") as server:
        yield server


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[ChromaServer]:
    """A server this test may stop and freeze without disturbing the others."""
    with ChromaServer(tmp_path / "server-data") as server:
        yield server


@pytest.fixture
def bl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BrainLayerEnv:
    """BrainLayer with every path inside the test's folder."""
    return setup_brainlayer(tmp_path / "bl", monkeypatch)
