"""Loading custom sinks by ``module:attr``: a class, a factory or a ready object, each named
as configured and saying whether it is a vector index (False unless it says so)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from outbox import Settings, load_settings
from outbox.core.errors import ConfigError
from outbox.core.record import Record
from outbox.sinks.base import Delivered, Outcome, Sink
from outbox.sinks.registry import load_sink


class Quiet:
    """A custom sink that does not say whether it is a vector index."""

    def __init__(self, _settings: Settings | None = None) -> None:
        self.name = "quiet"

    def deliver(self, batch: Sequence[Record]) -> list[Outcome]:
        return [Delivered(record.key) for record in batch]

    def close(self) -> None:
        """Nothing held."""


class Index(Quiet):
    semantic = True


def quiet_factory(settings: Settings) -> Quiet:
    return Quiet(settings)


READY = Quiet()
NOT_A_SINK = object()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return load_settings(env={}, home=tmp_path / ".outbox", markdown_dir=tmp_path / "md")


@pytest.mark.parametrize(
    ("attr", "semantic"),
    [("Quiet", False), ("Index", True), ("quiet_factory", False), ("READY", False)],
)
def test_custom_sinks_are_named_and_say_what_they_are(
    settings: Settings, attr: str, semantic: bool
) -> None:
    name = f"{__name__}:{attr}"
    sink = load_sink(name, settings)
    assert isinstance(sink, Sink)
    assert (sink.name, sink.semantic) == (name, semantic)


def test_an_object_without_deliver_is_a_config_error(settings: Settings) -> None:
    with pytest.raises(ConfigError, match="deliver"):
        load_sink(f"{__name__}:NOT_A_SINK", settings)
